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
   own (``Agent.read`` with prefill's block generations: one copy on the same host via
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
hand-out still holds (:class:`~pdkv.integrations.vllm_scheduler._HeldBlocks`; a
block shared through the prefix cache stays valid while another hand-out holds it).
The lease is only prefill's garbage-collection timer. Decode checks ``remote_expires_at`` against its own
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

The connector is split as vLLM splits it: :class:`PdkvConnector` (here) delegates to
its scheduler half (:mod:`pdkv.integrations.vllm_scheduler`) or its worker half
(:mod:`pdkv.integrations.vllm_worker`); what the halves pass each other is in
:mod:`pdkv.integrations.vllm_meta`, the layout arithmetic in
:mod:`pdkv.integrations.vllm_layout`.

This module imports vLLM and torch; ``import pdkv`` does not import it.
"""

from __future__ import annotations

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
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pdkv.integrations.vllm_meta import PdkvConnectorMetadata, PdkvConnectorStats
from pdkv.integrations.vllm_scheduler import PdkvConnectorScheduler
from pdkv.integrations.vllm_worker import PdkvConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PdkvConnector"]


class PdkvConnector(KVConnectorBase_V1):
    """vLLM KV connector (``KVConnectorBase_V1``) that moves KV blocks with pdkv.

    vLLM builds one instance with ``role=SCHEDULER`` inside the scheduler and one
    with ``role=WORKER`` per worker; each delegates to its half
    (:class:`~pdkv.integrations.vllm_scheduler.PdkvConnectorScheduler`,
    :class:`~pdkv.integrations.vllm_worker.PdkvConnectorWorker`).
    """

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._sched: PdkvConnectorScheduler | None = None
        self._worker: PdkvConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = PdkvConnectorScheduler(vllm_config)
        else:
            self._worker = PdkvConnectorWorker(vllm_config, kv_cache_config)

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
