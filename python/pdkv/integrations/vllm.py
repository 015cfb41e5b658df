"""pdkv as a vLLM KV connector: prefill/decode disaggregation through pdkv.

vLLM loads :class:`PdkvConnector` from ``--kv-transfer-config``::

    {"kv_connector": "PdkvConnector",
     "kv_connector_module_path": "pdkv.integrations.vllm",
     "kv_role": "kv_producer",                # prefill; "kv_consumer" on decode
     "kv_load_failure_policy": "recompute",   # decode: recompute the prompt if a pull fails
     "kv_connector_extra_config": {"listen": "127.0.0.1:0"}}

Both instances need the same ``PDKV_SECRET`` in their environment (or
``"secret"`` in the extra config). A proxy (:mod:`pdkv.integrations.vllm_proxy`)
sends each request to prefill with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then to decode with the
``kv_transfer_params`` prefill returned.

How a request flows (pull, like vLLM's NixlConnector):

1. Prefill runs the prompt. :meth:`PdkvConnector.request_finished` keeps the
   request's blocks (``delay_free``) and returns ``kv_transfer_params`` naming
   them and their generations (``remote_block_generations``), the prefill
   workers' pdkv agents (``host:port``, one per TP rank) and a lease deadline.
2. Decode's scheduler claims the prompt's tokens (``get_num_new_matched_tokens``
   returns them as loaded asynchronously), vLLM allocates blocks, and
   ``update_state_after_alloc`` pairs each local block with the prefill block at
   the same position in the prompt (local prefix-cache hits are skipped).
3. Decode's worker reads those blocks straight from prefill's KV cache into its
   own (``Agent.read`` with ``remote_generations``: one copy on the same host via
   ``shm``, scatter-gather TCP across hosts; no staging buffer) and reports them in
   ``get_finished``. The read carries a notification that reaches prefill once
   every byte has landed; prefill's worker passes it to its scheduler
   (``build_connector_worker_meta`` -> ``update_connector_output``).
4. Once every TP rank's release arrived (or the lease, ``kv_lease_s``, ran out on
   prefill's clock), prefill's scheduler has its worker bump the generations of
   the request's blocks (through the connector metadata); the worker reports the
   request as sent only after ``bump_generations`` returned, and only then does
   vLLM free (and later reuse) the blocks.
5. A failed pull (peer gone, timeout, blocks freed since: ``StaleBlock``, bad
   parameters) reports the request's blocks through
   ``get_block_ids_with_load_errors``; with ``kv_load_failure_policy="recompute"``
   vLLM recomputes the prompt locally and the request still completes.

Stale pulls: prefill checks the generations before it sends a byte (over ``shm``,
decode checks prefill's published generation table before and after its copy,
without a round trip), so a pull that comes after prefill freed the blocks (lease
ran out, replayed parameters, clocks that disagree), or while it frees them, fails
with ``StaleBlock`` instead of reading the request that reused them
(docs/generations.md). The scheduler has no agent: it mirrors
the generations (every block starts at 1, as in every pdkv layout) and bumps the
mirror exactly when it tells the worker to bump, for the blocks no other
hand-out still holds (:class:`_HeldBlocks`; a block shared through the prefix
cache stays valid while another hand-out holds it). The lease is only prefill's
garbage-collection timer. Decode checks ``remote_expires_at`` against its own
clock only when prefill sent no generations (an older prefill), or when the
transport cannot check them (``cuda_ipc``, ``nixl``: ``NotSupported``; it then
pulls without them and logs a warning).

Extra config keys (``kv_connector_extra_config``):

``listen``
    ``"host:port"`` of the worker's pdkv agent (default ``"127.0.0.1:0"``; give an
    address decode can reach across hosts). A non-zero port is offset by the TP rank.
``secret``
    Shared secret (default: ``$PDKV_SECRET``; one of them is required).
``transports``
    pdkv transports in order of preference (default: all available, ``shm`` first).
``kv_lease_s``
    Seconds prefill keeps a finished request's blocks for decode (default 120);
    a later pull fails (``StaleBlock``) and decode recomputes.
``transfer_timeout_s``
    Deadline of one pull, and of the first contact with a prefill agent (fetching
    its metadata), default 30.
``kv_cpus``
    CPUs for pdkv's own threads in this worker (a list of CPU numbers, or ``"all"``:
    every CPU the machine has online); default: they inherit the worker's binding
    (``VLLM_CPU_OMP_THREADS_BIND``), i.e. share its compute core. Like the cores
    NixlConnector reserves for KV transfer on CPU (:func:`pdkv.set_thread_cpus`).
``stats_path``
    Append one JSON line per pull (request, blocks, bytes, seconds) to this file.
``compress``
    ``"lossless"`` or ``"auto"`` (lossless when the measured link is slower than the
    codec): decode's pulls over tcp ask prefill for compressed KV, bit-exact
    (docs/compression.md, compressed reads); default ``"off"``. Set on decode;
    prefill answers what the reader asks. No FP8 (see
    :func:`~pdkv.integrations.vllm_layout.connector_compression`).

Only vLLM's own attention layouts with one KV cache group are supported (no
hybrid/sliding-window groups), with equal KV heads, head size, dtype and TP size on
both sides; the connector checks the geometry at the first pull and fails the pull
(so vLLM recomputes) when one differs. Block sizes may differ: prefill sends its
``remote_block_size`` and decode maps the request's token range onto prefill's
blocks (:func:`pdkv.integrations.vllm_layout.pull_span`), one planned read per
request, through the per-token layout of vLLM's CPU cache (``vllm-kv-tokens``,
exported when vLLM's own cache kernel packs it as
:func:`pdkv.integrations.vllm_layout.cpu_token_layout` says); a decode prefix-cache
hit that ends inside one of prefill's blocks is recomputed instead (the planner
moves block lists from their first token).

This module imports vLLM and torch; ``import pdkv`` does not import it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import pdkv
from pdkv.integrations.vllm_layout import (
    check_pullable,
    connector_compression,
    cpu_token,
    cpu_token_layout,
    describe_kv_caches,
    kernel_block_ids,
    kernel_blocks_per_block,
    PullSpan,
    pull_span,
    splits_remote_block,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PdkvConnector", "PdkvConnectorMetadata", "PdkvConnectorStats", "PdkvHandshakeMetadata",
           "PdkvWorkerMetadata"]

logger = init_logger("vllm.kv_connector.pdkv")  # under "vllm": shown with vLLM's own logs

#: Notification payload prefix: ``b"pdkv-vllm release <prefill request id>"``.
_RELEASE = b"pdkv-vllm release "
#: Without block generations (an older prefill), a pull must complete this many
#: seconds before the lease ends to be trusted.
_LEASE_MARGIN_S = 5.0
_GEN_MAX = 2**32 - 1
_LAYOUT = "vllm-kv"
#: vLLM CPU caches packed by the ``vec`` kernels also export where each token's K and
#: V elements sit (:func:`~pdkv.integrations.vllm_layout.cpu_token_layout`); pulls
#: between different block sizes go through it (``_LAYOUT`` only tells whole blocks).
_TOKEN_LAYOUT = "vllm-kv-tokens"
#: ``PDKV_VLLM_DEBUG_GENS=1``: log every hand-out's generations (scheduler) and every
#: bump's new generations per layout (worker), to tell a stalled instance from a
#: mirror that disagrees with the agent when a pull fails with ``StaleBlock``.
_DEBUG_GENS = os.environ.get("PDKV_VLLM_DEBUG_GENS", "") not in ("", "0")


@dataclass
class PdkvHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What one worker tells its scheduler: its agent's name and ``host:port``."""

    agent_name: str
    address: str


@dataclass
class _Recv:
    """Decode: pull ``remote_block_ids`` of the prefill request into ``local_block_ids``."""

    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_agents: list[str]
    remote_request_id: str
    expires_at: float
    num_tokens: int
    #: Prefill's generations of ``remote_block_ids`` (None: an older prefill sent none).
    remote_generations: Any = None
    #: Tokens per prefill block (0: an older prefill sent none, i.e. decode's own).
    remote_block_size: int = 0
    #: Why the scheduler could not map the pull (the worker fails it: vLLM recomputes).
    error: str | None = None
    #: The worker's: the pdkv layout the pull went through (for stats_path).
    layout: str = ""


@dataclass
class _Release:
    """Decode: tell prefill to free a request's blocks without pulling them."""

    remote_agents: list[str]
    remote_request_id: str


@dataclass
class PdkvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per engine step."""

    reqs_to_recv: dict[str, _Recv] = field(default_factory=dict)
    reqs_to_release: dict[str, _Release] = field(default_factory=dict)
    #: Prefill: held requests to report as sent (vLLM then frees their blocks), each
    #: with the blocks whose generations the worker must bump first (the blocks no
    #: other handed-out request still holds). Distinct ids within one entry.
    reqs_to_finish: list[tuple[str, list[int]]] = field(default_factory=list)


@dataclass
class PdkvWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per engine step: prefill request id -> the TP ranks
    whose decode peer said it may free the request's blocks."""

    released: dict[str, set[int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "PdkvWorkerMetadata":
        if isinstance(other, PdkvWorkerMetadata):
            for req_id, ranks in other.released.items():
                self.released.setdefault(req_id, set()).update(ranks)
        return self


@dataclass
class PdkvConnectorStats(KVConnectorStats):
    """Pull statistics a decode worker reports to vLLM's stats logger
    ("KV Transfer metrics: ..." every logging interval)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"transfer_s": [], "bytes": [], "failed": 0}

    def record(self, seconds: float, nbytes: int) -> None:
        self.data["transfer_s"].append(float(seconds))
        self.data["bytes"].append(int(nbytes))

    def aggregate(self, other: KVConnectorStats) -> "PdkvConnectorStats":
        if not other.is_empty():
            self.data["transfer_s"] += other.data["transfer_s"]
            self.data["bytes"] += other.data["bytes"]
            self.data["failed"] += other.data["failed"]
        return self

    def is_empty(self) -> bool:
        return not self.data["transfer_s"] and not self.data["failed"]

    def reduce(self) -> dict[str, int | float]:
        t = sorted(self.data["transfer_s"])
        total_mb = sum(self.data["bytes"]) / 2**20
        return {
            "Num successful pulls": len(t),
            "Num failed pulls": self.data["failed"],
            "Avg pull time (ms)": round(1e3 * sum(t) / len(t), 3) if t else 0,
            "P90 pull time (ms)": round(1e3 * t[min(len(t) - 1, int(0.9 * len(t)))], 3) if t else 0,
            "MB pulled": round(total_mb, 1),
            "Throughput (MB/s)": round(total_mb / sum(t), 1) if t and sum(t) > 0 else 0,
        }


def _kv_dtype_name(vllm_config: "VllmConfig") -> str:
    """The KV cache's dtype name ("bfloat16", ...; vLLM's cache_dtype when not "auto")."""
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype != "auto":
        return str(cache_dtype)
    return str(getattr(getattr(vllm_config, "model_config", None), "dtype", "unknown")).removeprefix("torch.")


def _kv_cpus(value: Any) -> list[int] | None:
    """``kv_cpus`` of the extra config: ``None`` (inherit), ``"all"`` or CPU numbers."""
    if value is None:
        return None
    if value == "all":
        return sorted(range(os.cpu_count() or 1))
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"pdkv connector: kv_cpus must be a list of CPU numbers or \"all\", got {value!r}")
    return list(value)  # pdkv.set_thread_cpus checks each


def _extra(vllm_config: "VllmConfig") -> dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


def _probe_cpu_packing(dtype: torch.dtype, block_size: int, kv_heads: int, head_size: int,
                       cache_dtype: str) -> str | None:
    """Writes known K/V through vLLM's own CPU cache kernel into a scratch cache of
    this geometry and checks every element where :func:`cpu_token_layout` says it
    is. Returns None when it matches, else why not (another ISA's packing, e.g. AMX
    for bfloat16, or a kernel this vLLM lacks)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
        cache = torch.zeros(2, kv_heads, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = cache.view(2, kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
        n = block_size + 3  # a whole block and part of the next
        key = torch.randn(n, kv_heads, head_size).to(dtype)
        value = torch.randn(n, kv_heads, head_size).to(dtype)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(n), isa)
    except Exception as e:  # noqa: BLE001 - any failure only means "no per-token layout"
        return f"could not run vLLM's CPU cache kernel to learn its packing ({type(e).__name__}: {e})"
    for t in range(n):
        for h in range(kv_heads):
            k, v = cpu_token(cache, t // block_size, h, t % block_size)
            if not (torch.equal(k, key[t, h]) and torch.equal(v, value[t, h])):
                return (f"vLLM's CPU attention ({isa} kernels, {dtype}) packs its KV cache in a way pdkv does not "
                        f"describe per token")
    return None


class PdkvConnector(KVConnectorBase_V1):
    """vLLM KV connector (``KVConnectorBase_V1``) that moves KV blocks with pdkv.

    vLLM builds one instance with ``role=SCHEDULER`` inside the scheduler and one
    with ``role=WORKER`` per worker; each delegates to its half
    (:class:`_Scheduler`, :class:`_Worker`).
    """

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._sched: _Scheduler | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(vllm_config)
        else:
            self._worker = _Worker(vllm_config, kv_cache_config)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._sched is not None
        self._sched.set_agents(metadata)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        assert self._worker is not None
        return self._worker.handshake_metadata()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdkvConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Pulls complete between engine steps (the request waits in
        ``WAITING_FOR_REMOTE_KVS``), so no forward pass ever waits on a layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Nothing to save: decode pulls straight from prefill's KV cache."""

    def wait_for_save(self) -> None:
        """Nothing to save (see :meth:`save_kv_layer`)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None or self._worker.stats.is_empty():
            return None
        stats, self._worker.stats = self._worker.stats, PdkvConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PdkvConnectorStats(data=data) if data is not None else PdkvConnectorStats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


@dataclass
class _Held:
    """Prefill: a finished request whose blocks wait for decode's pull."""

    block_ids: list[int]
    expires_at: float
    released_by: set[int] = field(default_factory=set)


class _HeldBlocks:
    """Prefill scheduler: the requests handed to decode, the blocks they hold, and
    each block's generation as the worker's pdkv agent has it.

    The scheduler has no agent, so it keeps a mirror: every block starts at
    generation 1 (as every pdkv layout does) and the mirror is bumped exactly when
    :meth:`release` tells the worker to bump the agent. A block is bumped when the
    last handed-out request holding it is released (blocks shared through the
    prefix cache stay valid while another hand-out holds them); the worker bumps
    before it reports the request as sent, i.e. before vLLM may reuse the blocks.
    """

    def __init__(self) -> None:
        self.requests: dict[str, _Held] = {}
        self._gens: dict[int, int] = {}
        self._holders: dict[int, int] = {}

    def generations(self, block_ids: list[int]) -> list[int]:
        return [self._gens.get(b, 1) for b in block_ids]

    def hold(self, req_id: str, block_ids: list[int], expires_at: float) -> list[int]:
        """Records a hand-out (of a request not held yet); returns the generations
        to hand out with the ids."""
        assert req_id not in self.requests, req_id
        self.requests[req_id] = _Held(list(block_ids), expires_at)
        for b in set(block_ids):
            self._holders[b] = self._holders.get(b, 0) + 1
        return self.generations(block_ids)

    def release(self, req_id: str) -> list[int]:
        """Forgets a hand-out; returns the blocks to bump (now held by no hand-out),
        whose mirrored generations it bumps."""
        held = self.requests.pop(req_id)
        bump = []
        for b in sorted(set(held.block_ids)):
            n = self._holders[b] - 1
            if n:
                self._holders[b] = n
                continue
            del self._holders[b]
            g = self._gens.get(b, 1)
            self._gens[b] = g + 1 if g < _GEN_MAX else 1
            bump.append(b)
        return bump

    def expired(self, now: float) -> list[str]:
        return [r for r, h in self.requests.items() if now > h.expires_at]


class _Scheduler:
    """Scheduler half: which tokens decode claims, which blocks pair up, and what
    prefill returns to the proxy."""

    def __init__(self, vllm_config: "VllmConfig") -> None:
        extra = _extra(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.lease_s = float(extra.get("kv_lease_s", 120.0))
        self.agents: list[str] = []
        self._recv: dict[str, _Recv] = {}
        self._release: dict[str, _Release] = {}
        self.held = _HeldBlocks()
        self._finish: list[tuple[str, list[int]]] = []
        policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        if vllm_config.kv_transfer_config.is_kv_consumer and policy != "recompute":
            logger.warning("pdkv connector: kv_load_failure_policy=%r fails a request whose KV pull fails; "
                           "set \"kv_load_failure_policy\": \"recompute\" to recompute it instead", policy)

    def set_agents(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Workers' agent addresses, ordered by TP rank."""
        agents = []
        for rank in sorted(metadata):
            md = metadata[rank]
            if not isinstance(md, PdkvHandshakeMetadata):
                raise TypeError(f"pdkv connector: worker {rank} sent {type(md).__name__}, "
                                "expected PdkvHandshakeMetadata")
            agents.append(md.address)
        self.agents = agents
        logger.info("pdkv connector: worker agents %s", agents)

    @staticmethod
    def _pull_params(params: dict[str, Any] | None) -> bool:
        return bool(params and params.get("do_remote_prefill") and params.get("remote_agents")
                    and params.get("remote_request_id") is not None
                    and isinstance(params.get("remote_block_ids"), list))

    def _loaded_end(self, request: "Request", params: dict[str, Any]) -> int:
        """Prompt tokens whose KV prefill holds (the whole prompt in practice)."""
        n = request.num_prompt_tokens
        remote = params.get("remote_num_tokens")
        return n if remote is None else max(0, min(int(remote), n))

    def _remote_block_size(self, params: dict[str, Any]) -> int | None:
        """Prefill's tokens per block (an older prefill sends none: decode's own);
        None when the value is no positive integer."""
        bs = params.get("remote_block_size", self.block_size)
        return bs if type(bs) is int and bs > 0 else None

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self._pull_params(params):
            return 0, False
        count = self._loaded_end(request, params) - num_computed_tokens
        if count <= 0:
            # vLLM recomputes the last prompt token itself when every token is loaded.
            return 0, False
        remote_bs = self._remote_block_size(params)
        if remote_bs is None:
            logger.warning("pdkv connector: %s: prefill sent remote_block_size=%r; computing the prompt here",
                           request.request_id, params.get("remote_block_size"))
            return 0, False
        if splits_remote_block(num_computed_tokens, remote_bs):
            logger.info("pdkv connector: %s: the %d tokens cached here end inside one of prefill's %d-token "
                        "blocks; computing the other %d here instead of pulling them", request.request_id,
                        num_computed_tokens, remote_bs, count)
            return 0, False
        return count, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not self._pull_params(params):
            return
        params["do_remote_prefill"] = False  # one pull per request, even if rescheduled
        agents = list(params["remote_agents"])
        rid = str(params["remote_request_id"])
        if num_external_tokens <= 0:
            # Everything is cached here already: prefill may free its blocks.
            self._release[request.request_id] = _Release(agents, rid)
            return
        end = self._loaded_end(request, params)
        start = end - num_external_tokens  # local prefix-cache hits are whole blocks
        remote_bs = self._remote_block_size(params) or 0
        recv = _Recv(local_block_ids=[], remote_block_ids=[], remote_agents=agents, remote_request_id=rid,
                     expires_at=float(params.get("remote_expires_at") or 0.0), num_tokens=num_external_tokens,
                     remote_block_size=remote_bs)
        try:
            span = pull_span(start, end, self.block_size, remote_bs)
        except pdkv.InvalidArgument as e:  # get_num_new_matched_tokens declined these; be safe anyway
            recv.error = str(e)
        else:
            (local_all,) = blocks.get_block_ids()[:1]
            recv.local_block_ids = list(local_all[span.local_first:span.local_last])
            recv.remote_block_ids = [int(b) for b in params["remote_block_ids"]][span.remote_first:span.remote_last]
            gens = params.get("remote_block_generations")
            # checked by the worker: a bad value fails the pull
            recv.remote_generations = gens[span.remote_first:span.remote_last] if isinstance(gens, list) else gens
        self._recv[request.request_id] = recv

    def _finish_held(self, req_id: str) -> None:
        """Prefill: the request's blocks may go (bumped first, by the worker)."""
        bump = self.held.release(req_id)
        if _DEBUG_GENS:
            logger.info("pdkv connector: gens: release %s: bump blocks %s to %s", req_id, bump,
                        self.held.generations(bump))
        self._finish.append((req_id, bump))

    def build_connector_meta(self) -> PdkvConnectorMetadata:
        for req_id in self.held.expired(time.time()):
            logger.warning("pdkv connector: decode did not pull %s within its lease; freeing its blocks", req_id)
            self._finish_held(req_id)
        meta = PdkvConnectorMetadata(self._recv, self._release, self._finish)
        self._recv, self._release, self._finish = {}, {}, []
        return meta

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """Prefill: a request is released once decode told every TP rank."""
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, PdkvWorkerMetadata):
            return
        for req_id, ranks in meta.released.items():
            held = self.held.requests.get(req_id)
            if held is None:
                continue  # already released or expired
            held.released_by |= ranks
            if len(held.released_by) >= max(1, len(self.agents)):
                self._finish_held(req_id)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if self._pull_params(params):
            # Decode request finished (aborted) before its blocks were allocated:
            # nothing was pulled, let prefill free its blocks now.
            params["do_remote_prefill"] = False
            self._release[request.request_id] = _Release(list(params["remote_agents"]),
                                                         str(params["remote_request_id"]))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or failed prefill: nothing to hand over
        if not block_ids or not self.agents:
            if not self.agents:
                logger.warning("pdkv connector: no worker agent known; %s is not handed over", request.request_id)
            return False, None
        if request.request_id in self.held.requests:  # vLLM finishes a request once
            logger.error("pdkv connector: %s finished twice; not handed over again", request.request_id)
            return False, None
        expires = time.time() + self.lease_s
        gens = self.held.hold(request.request_id, [int(b) for b in block_ids], expires)
        if _DEBUG_GENS:
            logger.info("pdkv connector: gens: hand out %s: blocks %s at %s", request.request_id,
                        [int(b) for b in block_ids], gens)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": [int(b) for b in block_ids],
            "remote_num_tokens": int(request.num_computed_tokens),
            "remote_block_size": self.block_size,
            "remote_agents": list(self.agents),
            "remote_expires_at": expires,
            "remote_block_generations": gens,
        }


class _Worker:
    """Worker half: owns the pdkv agent, registers vLLM's KV cache, pulls blocks
    (decode) and frees held blocks when decode says so (prefill)."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> None:
        extra = _extra(vllm_config)
        kvt = vllm_config.kv_transfer_config
        self.kv_cache_config = kv_cache_config
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.timeout_s = float(extra.get("transfer_timeout_s", 30.0))
        self.stats_path = extra.get("stats_path")
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - no TP group (e.g. a unit test): rank 0
            self.tp_rank = 0
        secret = extra.get("secret") or os.environ.get("PDKV_SECRET")
        if not secret:
            raise ValueError("pdkv connector: set PDKV_SECRET (or kv_connector_extra_config.secret) to the same "
                             "value on prefill and decode")
        host, _, port = str(extra.get("listen", "127.0.0.1:0")).rpartition(":")
        port_n = int(port) + self.tp_rank if int(port) else 0
        name = f"vllm-{kvt.engine_id}-tp{self.tp_rank}".replace(" ", "_")
        transports = extra.get("transports")
        compress = connector_compression(extra.get("compress"), _kv_dtype_name(vllm_config)) \
            if extra.get("compress") not in (None, "off") else None
        # A pull over shm completes once its release notification is sent (after every
        # byte landed), not one round trip later when prefill acknowledges it: a release
        # prefill never acknowledges only delays its freeing to the lease; it is counted
        # (Agent.notifications_unacknowledged: the stats rows' "releases_unacknowledged")
        # and logged by pdkv.
        kv_cpus = _kv_cpus(extra.get("kv_cpus"))
        if kv_cpus is not None:
            pdkv.set_thread_cpus(kv_cpus)  # before the agent starts its threads
        self.agent = pdkv.Agent(name, secret=secret, listen=f"{host}:{port_n}",
                                transports=list(transports) if transports else None,
                                default_timeout=self.timeout_s,
                                options=([pdkv.TcpOptions(compress=compress)] if compress else [])
                                + [pdkv.ShmOptions(notify_on_send=True)])
        self._regions: list[pdkv.Region] = []
        self._caches: list[torch.Tensor] = []
        self.geometry: pdkv.KVGeometry | None = None
        self.has_tokens = False  # registered _TOKEN_LAYOUT too
        self.phys_per_block = 1
        self.block_bytes = 0
        # decode
        self._lock = threading.Lock()
        self._peers: dict[str, concurrent.futures.Future] = {}
        #: Connected prefill peer -> its layout's geometry (set by the connect thread).
        self._peer_geometry: dict[str, pdkv.KVGeometry] = {}
        self._peer_tokens: set[str] = set()  # peers that export _TOKEN_LAYOUT
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdkv-connect")
        self._parked: dict[str, tuple[_Recv, str, concurrent.futures.Future, float]] = {}
        self._recving: dict[str, tuple[pdkv.Transfer, _Recv, str, float]] = {}
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = PdkvConnectorStats()
        # prefill: bumps run in their own thread (each waits for reads still in flight)
        self._bumper = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdkv-bump")
        self._finishing: list[tuple[str, concurrent.futures.Future]] = []
        self._released: set[str] = set()
        logger.info("pdkv connector: agent %s on %s (transports %s)", name, self.agent.address,
                    ", ".join(self.agent.transports))

    # ---------------------------------------------------------------- registration
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Registers every KV cache storage once and describes it as one exact pdkv layout.

        Every layout vLLM's attention backends allocate is described by its strides
        (:func:`pdkv.integrations.vllm_layout.describe_kv_caches`): GPU
        ``[2, num_blocks, ...]`` and ``[num_blocks, 2, ...]`` as a K and a V part, the
        CPU backend's ``[num_blocks, kv_heads, block_size, 2*head_size]`` as K and V
        parts interleaved per head (equal layouts still move whole blocks), MLA as one
        latent part.
        """
        if not kv_caches:
            raise ValueError("pdkv connector: no KV caches to register")
        spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec if self.kv_cache_config else None
        if self.kv_cache_config is not None and len(self.kv_cache_config.kv_cache_groups) != 1:
            raise NotImplementedError("pdkv connector: models with several KV cache groups are not supported")
        described = describe_kv_caches(
            kv_caches, logical_blocks=self.kv_cache_config.num_blocks if self.kv_cache_config else None,
            num_kv_heads=getattr(spec, "num_kv_heads", None), head_size=getattr(spec, "head_size", None))
        self.phys_per_block = described.phys_per_block
        self.geometry = described.layout.geometry
        # Register each underlying storage once (layers may share one).
        seen: dict[int, tuple[int, torch.Tensor]] = {}
        for t in kv_caches.values():
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), (st.nbytes(), t))
        for addr, (nbytes, t) in sorted(seen.items()):
            self._regions.append(self.agent.register_address(addr, nbytes))
            self._caches.append(t)
        self.agent.add_layout(_LAYOUT, described.layout)
        if described.kind == "cpu":
            self._add_token_layout(kv_caches)
        g = self.geometry
        self.block_bytes = g.block_bytes * g.kv_parts * g.num_layers * self.phys_per_block
        logger.info("pdkv connector: registered %d layers (%s layout: %d kv heads x %d, %d-token kernel blocks), "
                    "%d bytes per logical block in %d region(s)", g.num_layers, described.kind, g.kv_heads,
                    g.head_dim, g.block_tokens, self.block_bytes, len(self._regions))

    def _add_token_layout(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Exports the CPU cache per token (for pulls between block sizes) when
        vLLM's kernel packs it the way :func:`cpu_token_layout` says."""
        t = next(iter(kv_caches.values()))
        cache_dtype = getattr(self.vllm_config.cache_config, "cache_dtype", "auto")
        why = _probe_cpu_packing(t.dtype, self.block_size, t.shape[1], t.shape[3] // 2, cache_dtype)
        if why is not None:
            logger.info("pdkv connector: %s; pulls between different block sizes will be recomputed", why)
            return
        self.agent.add_layout(_TOKEN_LAYOUT, cpu_token_layout(kv_caches))
        self.has_tokens = True

    def handshake_metadata(self) -> PdkvHandshakeMetadata:
        return PdkvHandshakeMetadata(agent_name=self.agent.name, address=self.agent.address)

    def _phys(self, ids: list[int]) -> list[int]:
        return kernel_block_ids(ids, self.phys_per_block)

    # ---------------------------------------------------------------- decode: pulls
    def _agent_for(self, agents: list[str]) -> str:
        """The prefill agent serving this TP rank's KV heads."""
        if len(agents) == 1:
            return agents[0]
        if self.tp_rank >= len(agents):
            raise pdkv.InvalidArgument(f"prefill has {len(agents)} TP ranks, this is rank {self.tp_rank}")
        return agents[self.tp_rank]

    def _connect(self, address: str) -> str:
        """Runs in the connect thread: fetch the peer's metadata and its layout (each
        pull checks it: a peer of another geometry still gets its release)."""
        peer = self.agent.connect(address, timeout=self.timeout_s)
        layouts = self.agent.peer_info(peer)["layouts"]
        if _LAYOUT not in layouts:
            raise pdkv.NotFound(f"peer {peer} at {address} exports no vLLM KV layout")
        rgeo = pdkv.KVLayout(layouts[_LAYOUT]).geometry
        with self._lock:
            self._peer_geometry[peer] = rgeo
            if _TOKEN_LAYOUT in layouts:
                self._peer_tokens.add(peer)
        logger.info("pdkv connector: connected to %s at %s over %s", peer, address, self.agent.peer_transport(peer))
        return peer

    def _peer_future(self, address: str) -> concurrent.futures.Future:
        """The (possibly still running) connection to ``address``; a failed one is retried."""
        with self._lock:
            fut = self._peers.get(address)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._pool.submit(self._connect, address)
                self._peers[address] = fut
            return fut

    def _forget_peer(self, address: str) -> None:
        with self._lock:
            self._peers.pop(address, None)

    def start_load_kv(self, meta: PdkvConnectorMetadata) -> None:
        for req_id, block_ids in meta.reqs_to_finish:
            self._finishing.append((req_id, self._bumper.submit(self._bump, block_ids)))
        for req_id, rel in meta.reqs_to_release.items():
            self._release(rel.remote_agents, rel.remote_request_id)
        now = time.perf_counter()
        for req_id, r in meta.reqs_to_recv.items():
            try:
                if r.error is not None:
                    raise pdkv.InvalidArgument(r.error)
                addr = self._agent_for(r.remote_agents)
                fut = self._peer_future(addr)
            except Exception as e:  # noqa: BLE001 - every failure becomes a recompute
                self._fail(req_id, r, None, e)
                continue
            self._parked[req_id] = (r, addr, fut, now)
        self._post_parked()

    def _post_parked(self) -> None:
        """Posts the pulls whose peer is connected (reads run in pdkv's native threads)."""
        for req_id in list(self._parked):
            r, addr, fut, t_seen = self._parked[req_id]
            if not fut.done():
                continue
            del self._parked[req_id]
            try:
                xfer = self._read(fut.result(), r)
            except Exception as e:  # noqa: BLE001 - every failure becomes a recompute
                self._fail(req_id, r, addr, e)
                continue
            self._recving[req_id] = (xfer, r, addr, t_seen)

    def _checked_span(self, r: _Recv) -> PullSpan:
        """The pull's tokens, counted from the first block of each list, after
        checking that both lists hold exactly those tokens."""
        span = pull_span(0, r.num_tokens, self.block_size, r.remote_block_size or self.block_size)
        if len(r.local_block_ids) != span.local_last or len(r.remote_block_ids) != span.remote_last:
            raise pdkv.InvalidArgument(
                f"{r.num_tokens} tokens need {span.local_last} local blocks of {span.local_block_size} tokens and "
                f"{span.remote_last} prefill blocks of {span.remote_block_size}; got {len(r.local_block_ids)} and "
                f"{len(r.remote_block_ids)}")
        return span

    def _pull_layout(self, peer: str, r: _Recv, span: PullSpan, rgeo: pdkv.KVGeometry) -> str:
        """The layout both sides pull through: whole blocks (``_LAYOUT``) for equal
        block sizes, else the per-token one. Raises when prefill's cache differs in
        anything but block size, or when either side has no per-token layout."""
        assert self.geometry is not None
        check_pullable(self.geometry, rgeo)
        if not r.remote_block_size and rgeo.block_tokens != self.geometry.block_tokens:
            raise pdkv.InvalidArgument(f"prefill sent no remote_block_size (an older prefill) and its KV layout's "
                                       f"blocks hold {rgeo.block_tokens} tokens, decode's "
                                       f"{self.geometry.block_tokens}")
        if not span.plan_tokens:
            return _LAYOUT
        with self._lock:
            peer_tokens = peer in self._peer_tokens
        if not (self.has_tokens and peer_tokens):
            side = "prefill's" if self.has_tokens else "decode's"
            raise pdkv.NotSupported(f"{side} KV cache has no per-token layout (see its log), so blocks of "
                                    f"{span.remote_block_size} tokens cannot become blocks of {span.local_block_size}")
        return _TOKEN_LAYOUT

    def _read(self, peer: str, r: _Recv) -> pdkv.Transfer:
        """Posts the pull, with prefill's generations when it sent them: one read of
        the request's token range, re-blocked by pdkv's planner when the block sizes
        differ."""
        span = self._checked_span(r)
        with self._lock:
            rgeo = self._peer_geometry[peer]
        layout = r.layout = self._pull_layout(peer, r, span, rgeo)
        remote_per_block = kernel_blocks_per_block(span.remote_block_size, rgeo.block_tokens, "prefill")
        gens = self._remote_generations(r, remote_per_block)
        args = (peer, layout, self._phys(r.local_block_ids), layout,
                kernel_block_ids(r.remote_block_ids, remote_per_block))
        kw = dict(notify=_RELEASE + r.remote_request_id.encode(), timeout=self.timeout_s, num_tokens=span.plan_tokens)
        if gens is not None:
            try:
                return self.agent.read(*args, remote_generations=gens, **kw)
            except pdkv.NotSupported as e:
                # cuda_ipc and nixl cannot check generations: fall back to the lease.
                logger.warning("pdkv connector: %s; pulling %s without them (lease check only)", e,
                               r.remote_request_id)
                r.remote_generations = None
        if r.expires_at and time.time() > r.expires_at - _LEASE_MARGIN_S:
            raise pdkv.TransferTimeout(f"prefill's lease on {r.remote_request_id} ran out before the pull")
        return self.agent.read(*args, **kw)

    def _remote_generations(self, r: _Recv, per_block: int) -> list[int] | None:
        """Prefill's generations per kernel block (None: prefill sent none). Prefill
        checks them before sending a byte: a pull of blocks it freed (and may have
        reused) since fails with ``StaleBlock`` instead of reading another request's KV."""
        gens = r.remote_generations
        if gens is None:
            return None
        if not isinstance(gens, list) or len(gens) != len(r.remote_block_ids) or not all(
                type(g) is int and 0 < g <= _GEN_MAX for g in gens):
            raise pdkv.InvalidArgument(f"remote_block_generations must be {len(r.remote_block_ids)} integers in "
                                       f"[1, 2^32-1], got {str(gens)[:200]}")
        return list(gens) if per_block == 1 else [g for g in gens for _ in range(per_block)]

    def _poll_recving(self) -> None:
        for req_id in list(self._recving):
            xfer, r, addr, t_seen = self._recving[req_id]
            if not xfer.done:
                continue
            del self._recving[req_id]
            err = xfer.error
            if err is None and r.remote_generations is None and r.expires_at \
                    and time.time() > r.expires_at - _LEASE_MARGIN_S:
                # Prefill may already have reused these blocks: do not trust them.
                err = pdkv.TransferTimeout("the pull completed after prefill's lease ran out")
            if err is not None:
                self._fail(req_id, r, addr, err, xfer)
                continue
            self._done_recving.add(req_id)
            self.stats.record(xfer.elapsed, xfer.bytes_total)
            self._record(req_id, r, xfer, None, time.perf_counter() - t_seen)

    def _fail(self, req_id: str, r: _Recv, addr: str | None, err: BaseException,
              xfer: pdkv.Transfer | None = None) -> None:
        """Reports the request's blocks as not loaded (vLLM recomputes them) and lets
        prefill free its copy."""
        logger.warning("pdkv connector: pull of %s (prefill request %s, %d blocks) failed: %s: %s; "
                       "reporting its blocks as load errors", req_id, r.remote_request_id, len(r.local_block_ids),
                       type(err).__name__, err)
        self._load_errors.update(r.local_block_ids)
        self._done_recving.add(req_id)
        self.stats.data["failed"] += 1
        self._record(req_id, r, xfer, err)
        if addr is not None and isinstance(err, (pdkv.PeerConnectionError, pdkv.StalePeer, pdkv.NotFound)):
            self._forget_peer(addr)  # reconnect on the next request
        try:
            self._release(r.remote_agents, r.remote_request_id)
        except Exception:  # noqa: BLE001 - best effort: prefill's lease frees the blocks anyway
            pass

    def _release(self, agents: list[str], remote_request_id: str) -> None:
        """Tells prefill (asynchronously) that it may free ``remote_request_id``'s blocks."""
        payload = _RELEASE + remote_request_id.encode()

        def send(f: concurrent.futures.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            try:
                self.agent.notify(f.result(), payload, timeout=self.timeout_s)
            except pdkv.PdkvError as e:
                logger.info("pdkv connector: could not tell prefill to free %s (%s); its lease will",
                            remote_request_id, e)

        self._peer_future(self._agent_for(agents)).add_done_callback(send)

    def _record(self, req_id: str, r: _Recv, xfer: pdkv.Transfer | None, err: BaseException | None,
                seconds: float | None = None) -> None:
        """Appends one JSON line per pull to ``stats_path`` (if configured)."""
        if not self.stats_path:
            return
        row = {"request_id": req_id, "remote_request_id": r.remote_request_id, "blocks": len(r.local_block_ids),
               "remote_blocks": len(r.remote_block_ids), "block_size": self.block_size,
               "remote_block_size": r.remote_block_size or self.block_size, "layout": r.layout or None,
               "tokens": r.num_tokens, "bytes": xfer.bytes_total if xfer is not None else 0,
               "transfer_s": xfer.elapsed if xfer is not None and err is None else None,
               "seen_to_done_s": seconds, "transport": xfer.transport if xfer is not None else None,
               "compression": xfer.compression if xfer is not None else None,
               "wire_bytes": xfer.wire_bytes if xfer is not None else None,
               "error": None if err is None else f"{type(err).__name__}: {err}",
               "releases_unacknowledged": self.agent.notifications_unacknowledged, "time": time.time()}
        with open(self.stats_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    # ---------------------------------------------------------------- prefill: releases
    def _bump(self, block_ids: list[int]) -> None:
        """Runs in the bump thread: invalidates the handed-out generations of
        ``block_ids``; returns once no pull under the old ones still reads them
        (an shm pull is not waited for: one still copying fails with StaleBlock)."""
        if block_ids:
            for layout in (_LAYOUT, _TOKEN_LAYOUT) if self.has_tokens else (_LAYOUT,):
                # Both layouts name the same blocks: a pull through either must go stale.
                new = self.agent.bump_generations(layout, self._phys(block_ids), timeout=None)
                if _DEBUG_GENS:
                    logger.info("pdkv connector: gens: bumped %s kernel blocks %s to %s", layout,
                                self._phys(block_ids), list(new))

    def _poll_released(self) -> set[str]:
        """Collects decode's release notifications (for the scheduler) and returns
        the requests whose blocks are bumped, i.e. that vLLM may free now."""
        for n in self.agent.get_notifications():
            if n.data.startswith(_RELEASE):
                self._released.add(n.data[len(_RELEASE):].decode(errors="replace"))
        done, pending = set(), []
        for req_id, fut in self._finishing:
            if not fut.done():
                pending.append((req_id, fut))
            elif fut.exception() is not None:
                # Never free blocks whose old generation may still be valid: keep them.
                logger.error("pdkv connector: could not invalidate the blocks of %s (%s: %s); they stay held",
                             req_id, type(fut.exception()).__name__, fut.exception())
            else:
                done.add(req_id)
        self._finishing = pending
        return done

    def worker_meta(self) -> PdkvWorkerMetadata | None:
        if not self._released:
            return None
        meta = PdkvWorkerMetadata({req_id: {self.tp_rank} for req_id in self._released})
        self._released = set()
        return meta

    # ---------------------------------------------------------------- per step
    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self._parked:
            self._post_parked()
        if self._recving:
            self._poll_recving()
        sent = self._poll_released()
        recvd, self._done_recving = self._done_recving, set()
        return (sent or None), (recvd or None)

    def take_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._bumper.shutdown(wait=False, cancel_futures=True)
        for xfer, *_ in self._recving.values():
            xfer.cancel()
        self.agent.close()
