"""``pdkv bench transfer``: pdkv's GB/s and latency beside the raw limits and peer
libraries, in one run (:mod:`~pdkv.lab.transfer.bench` is the command)."""
