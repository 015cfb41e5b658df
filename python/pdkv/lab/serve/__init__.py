"""``pdkv bench serve``: one request trace replayed against each serving mode
(:mod:`~pdkv.lab.serve.modes` is the command), plus the layer-wise streaming and
decode-step benches."""
