"""Benchmarks: ``pdkv bench transfer`` (transport GB/s and latency against the raw
limits and peer libraries) and ``pdkv bench serve`` (TTFT/ITL/goodput per serving mode)."""
