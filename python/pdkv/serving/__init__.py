"""Reference serving for pdkv: a paged-KV, continuous-batching engine for Hugging Face
causal LMs whose KV pool pdkv can ship between prefill and decode workers.

Needs ``torch`` and ``transformers`` (``pip install pdkv[serve]``). Importing
``pdkv.serving`` itself does not import them; the names below are loaded on first
access, so ``import pdkv`` and ``import pdkv.serving`` work without torch.

Modules
-------
:mod:`pdkv.serving.engine`
    :class:`Engine`, :class:`EngineConfig`, scheduling modes, request handles and
    token events, plus the hooks disaggregation uses. The engine is composed of
    ``engine_types`` (config, events, handles), ``engine_checks`` (request checks),
    ``engine_scheduler`` (scheduling, block growth, preemption), ``engine_requests``
    (live requests, reservations, finishing) and ``engine_runner`` (pool, batch
    packing, layer sinks, forward and sampling).
:mod:`pdkv.serving.kv_pool`
    :class:`PagedKVPool` (per-layer NHD K/V caches in one registrable tensor) and
    :class:`BlockAllocator`.
:mod:`pdkv.serving.attention`
    The paged attention function registered with transformers' ``AttentionInterface``.
:mod:`pdkv.serving.sampling`
    :class:`SamplingParams` and token selection.
:mod:`pdkv.serving.models`
    :func:`load_model`, the default demo model (:func:`default_model_dir`).
:mod:`pdkv.lab.serve.stepbench`
    ``python -m pdkv.lab.serve.stepbench``: engine decode step vs plain HF decode.
:mod:`pdkv.serving.worker`
    :class:`Worker` (prefill, decode or colocated role: an engine behind an aiohttp
    server; prefill workers push KV into decode workers' blocks through pdkv); its
    ``/pd/*`` request handlers are :mod:`pdkv.serving.worker_handlers`.
:mod:`pdkv.serving.handoff`
    :class:`KVSender` / :class:`KVReceiver`: the KV hand-off between a prefill and a
    decode worker (reservations, generations, pushes, releases), without HTTP.
:mod:`pdkv.serving.proxy`
    :class:`Proxy`: the OpenAI-compatible API over the workers (disagg, hybrid,
    colocated modes), load spreading, retries, recompute on KV failure. Its backend is
    composed of ``proxy_config`` (settings), ``proxy_pool`` (workers and pools),
    ``proxy_client`` (signed calls), ``proxy_liveness`` (probes, deadlines),
    ``proxy_discovery`` (registry, worker info, model), ``proxy_routing`` and
    ``proxy_prefill`` (routing, retries, migration, the prefill leg), ``proxy_links``
    (prefill -> decode link health), ``proxy_rerole`` (role changes) and
    ``proxy_metrics``.
:mod:`pdkv.serving.frontend`, :mod:`pdkv.serving.openai_api`, :mod:`pdkv.serving.protocol`
    OpenAI requests/responses, the proxy-worker protocol (both torch-free).
:mod:`pdkv.serving.metrics`
    Counters, gauges and histograms on prometheus_client (``/metrics``).
:mod:`pdkv.serving.limits`
    Connection limit and idle/header/body deadlines of every serving HTTP server.
:mod:`pdkv.serving.launch`
    :class:`Deployment` / :class:`ServerProcess`: serving processes on this machine.
:mod:`pdkv.serving.cli`, :mod:`pdkv.serving.demo`
    ``pdkv serve ROLE`` and ``pdkv demo``.
:mod:`pdkv.serving.calibrate`
    ``python -m pdkv.serving.calibrate``: measures the hybrid threshold on a machine.
:mod:`pdkv.serving.tiny`
    :func:`save_tiny_model`: random-weight model directories for tests and benchmarks.

Example
-------
>>> from pdkv.serving import Engine, EngineConfig, SamplingParams, load_model  # doctest: +SKIP
>>> model = load_model(model_dir, dtype="float32")                            # doctest: +SKIP
>>> engine = Engine(model, EngineConfig(num_blocks=512, mode="chunked"))     # doctest: +SKIP
>>> engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))               # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine",
    "EngineConfig": "engine_types",
    "FinishReason": "engine_types",
    "RequestHandle": "engine_types",
    "SchedulingMode": "engine_types",
    "StepStats": "engine_types",
    "TokenEvent": "engine_types",
    "BlockAllocator": "kv_pool",
    "PagedKVPool": "kv_pool",
    "PAGED_ATTENTION": "attention",
    "PagedBatch": "attention",
    "SeqSpan": "attention",
    "paged_attention_forward": "attention",
    "register_paged_attention": "attention",
    "SamplingParams": "sampling",
    "sample_tokens": "sampling",
    "DEFAULT_MODEL": "models",
    "cache_dir": "models",
    "convert_gguf": "models",
    "default_model_dir": "models",
    "load_model": "models",
    "load_tokenizer": "models",
    "pin_threads": "models",
    "smollm2_gguf_path": "models",
    "KVReceiver": "handoff",
    "KVSender": "handoff",
    "Worker": "worker",
    "WorkerConfig": "worker",
    "WorkerRole": "roles",
    "Proxy": "proxy",
    "ProxyConfig": "proxy_config",
    "ProxyMode": "proxy_config",
    "DEFAULT_HYBRID_THRESHOLD": "proxy_config",
    "Deployment": "launch",
    "ServerProcess": "launch",
    "ServerThread": "aio",
    "save_tiny_model": "tiny",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pdkv.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
