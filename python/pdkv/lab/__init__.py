"""The lab: benchmarks, the planner and the network test bed, built on the library
(:mod:`pdkv`) and the reference serving stack (:mod:`pdkv.serving`); nothing below
imports it.

* :mod:`pdkv.lab.transfer`: ``pdkv bench transfer`` (transport GB/s and latency against
  the raw limits and peer libraries);
* :mod:`pdkv.lab.serve`: ``pdkv bench serve`` (TTFT/ITL/goodput per serving mode) and the
  streaming / decode-step benches;
* :mod:`pdkv.lab.plan`: ``pdkv plan`` (the prefill:decode split from measured capacity);
* :mod:`pdkv.lab.netlab`: ``pdkv netlab`` (hosts in network namespaces behind emulated
  links) and the discovery lab;
* :mod:`pdkv.lab.vllm`: vLLM with pdkv's connector against vLLM's own, measured.

Its native helpers (the ceilings, netlab's delay line) are a module of their own,
``pdkv.lab._pdkv_lab`` (:mod:`pdkv.lab._native` loads it).
"""
