"""Request traces for ``pdkv bench serve``: seeded synthetic generation, presets, JSONL replay.

A trace is a list of requests, each with an arrival time (seconds from the start of
the run), a prompt length and an output length (tokens). Synthetic traces come from
a :class:`TraceSpec`: an arrival process (:class:`Poisson`, bursty :class:`Gamma`,
:class:`Periodic`) and two length distributions (:class:`Fixed`, :class:`Uniform`,
clipped :class:`LogNormal`, :class:`Mixture`).

Determinism
-----------
Everything is a pure function of the seed. Random numbers are drawn in blocks of
:data:`BLOCK` requests, each block from its own stream keyed by
``(seed, stream, block)``, so:

* the same ``(spec, seed)`` always gives the same trace, on any machine;
* the first *k* requests do not depend on how many requests are generated;
* arrivals are unit-mean gaps divided by the rate, so the trace at rate ``r2`` is the
  trace at rate ``r1`` with its timestamps multiplied by ``r1 / r2`` (common random
  numbers: a rate sweep compares the same requests, not new samples).

Prompts are generated deterministically from ``(seed, request index)``:
:func:`token_prompt` gives token ids of the exact length (``/v1/completions`` takes a
list of ids as ``prompt``), :func:`text_prompt` gives text of about that many tokens
(common English words, one token each in most BPE vocabularies) for servers that only
accept text, such as ``/v1/chat/completions``.

Presets and saturation
----------------------
The presets are sized for the reference setup of issue 6: a ~40M-parameter Llama on
one pinned CPU core, where a 1024-token prefill takes ~0.8 s and a decode step for 8
requests ~50 ms (:class:`CostModel`). On that core, prefill alone saturates at one
1024-token prompt every ~0.8 s (one every 0.5 s is well past it). A request costs
about ``prompt_len * 0.78 ms + (output_len - 1) * 6.25 ms`` of core time at batch 8;
the utilisation ``rho = rate * mean cost`` must stay below 1. Each preset's default
rate keeps ``rho`` near 0.5 on **one** core (so a two-core deployment runs at about a
quarter of its capacity, and a rate sweep up to 2x the default stays unsaturated on
two cores). The numbers below are :func:`saturation_rate` for one core:

================  =====================================  =======  =====  ===========
preset            lengths (prompt / output, tokens)      rate     rho    saturation
================  =====================================  =======  =====  ===========
``chat-short``    lognormal med 128 / med 48             1.0/s    0.45   2.24/s
``rag-long``      lognormal med 1024 / med 48            0.4/s    0.46   0.86/s
``mixed``         80% med 128 + 20% med 1024 / med 64    0.6/s    0.43   1.38/s
``prefill-heavy`` uniform 512-1536 / uniform 16-64       0.5/s    0.52   0.96/s
``chat-bursty``   as ``chat-short``, gamma CV 3          1.0/s    0.45   2.24/s
================  =====================================  =======  =====  ===========

(``rho`` and ``saturation`` are for one core; ``tests/lab`` checks this table
against :func:`utilisation` and :func:`saturation_rate`.)

The decode term assumes full batches of 8; at lower concurrency a step serves fewer
requests for about the same cost, so real utilisation is somewhat higher than
``rho``. Short Poisson bursts exceed the mean rate: ``chat-bursty`` (CV 3) queues
much more than ``chat-short`` at the same mean rate, by design.

JSONL format
------------
One JSON object per line: ``timestamp`` (seconds; ``time_scale`` converts other units),
``prompt_len`` or ``prompt`` (text or a list of token ids), ``output_len``. The aliases
``input_length``/``output_length`` (the Mooncake trace format) are accepted.

Modules
-------
This module is the front door: every name below is importable from here. They live in

* :mod:`~pdkv.lab.serve.trace_dist`: length distributions and arrival processes;
* :mod:`~pdkv.lab.serve.trace_gen`: :class:`TraceRequest`, :class:`Trace`,
  :class:`TraceSpec`, :func:`generate_trace`;
* :mod:`~pdkv.lab.serve.trace_prompts`: :func:`token_prompt`, :func:`text_prompt`;
* :mod:`~pdkv.lab.serve.trace_jsonl`: :func:`save_trace`, :func:`load_trace`;
* :mod:`~pdkv.lab.serve.trace_presets`: :class:`CostModel`, :func:`utilisation`,
  :func:`saturation_rate`, :data:`PRESETS`, :func:`get_preset`;
* :mod:`~pdkv.lab.serve.trace_rng`: :data:`BLOCK` and the seeded random streams.

Example
-------
>>> trace = get_preset("mixed").with_rate(0.3).generate(seed=1, num_requests=2)
>>> first = trace.requests[0]
>>> (first.index, first.arrival_s), len(trace.prompt(first)) == first.prompt_len
((0, 0.0), True)
"""

from __future__ import annotations

from pdkv.lab.serve.trace_dist import (
    ArrivalProcess,
    Fixed,
    Gamma,
    LengthDist,
    LogNormal,
    Mixture,
    Periodic,
    Poisson,
    Uniform,
    arrival_from_dict,
    length_dist_from_dict,
    parse_arrival,
    parse_length_dist,
)
from pdkv.lab.serve.trace_gen import Trace, TraceRequest, TraceSpec, generate_trace
from pdkv.lab.serve.trace_jsonl import load_trace, save_trace
from pdkv.lab.serve.trace_presets import PRESETS, CostModel, get_preset, saturation_rate, utilisation
from pdkv.lab.serve.trace_prompts import Prompt, text_prompt, token_prompt
from pdkv.lab.serve.trace_rng import BLOCK

__all__ = [
    "BLOCK",
    "PRESETS",
    "ArrivalProcess",
    "CostModel",
    "Fixed",
    "Gamma",
    "LengthDist",
    "LogNormal",
    "Mixture",
    "Periodic",
    "Poisson",
    "Prompt",
    "Trace",
    "TraceRequest",
    "TraceSpec",
    "Uniform",
    "arrival_from_dict",
    "generate_trace",
    "get_preset",
    "length_dist_from_dict",
    "load_trace",
    "parse_arrival",
    "parse_length_dist",
    "saturation_rate",
    "save_trace",
    "text_prompt",
    "token_prompt",
    "utilisation",
]
