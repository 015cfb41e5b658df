"""``pdkv plan``: the prefill:decode split for a trace and an SLO, from measured capacity
(:mod:`~pdkv.lab.plan.cli` is the command, :mod:`~pdkv.lab.plan.model` the arithmetic)."""
