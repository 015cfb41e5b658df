"""The worker half of the vLLM connector (:mod:`pdkv.integrations.vllm`): it owns the
pdkv agent, registers vLLM's KV cache as pdkv layouts, pulls blocks (decode) and bumps
and frees held blocks when decode says so (prefill) (:class:`PdkvConnectorWorker`).

Imports vLLM and torch; ``import pdkv`` does not import it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

import pdkv
from pdkv.integrations.vllm_layout import (
    check_pullable,
    connector_compression,
    CPU_PACKING_GRANULE,
    cpu_token,
    cpu_token_layout,
    describe_kv_caches,
    kernel_block_ids,
    kernel_blocks_per_block,
    PullSpan,
    pull_span,
)
from pdkv.integrations.vllm_amx import ensure_amx_tiles
from pdkv.integrations.vllm_meta import (
    _DEBUG_GENS,
    _GEN_MAX,
    _LAYOUT,
    _LEASE_MARGIN_S,
    _RELEASE,
    _TOKEN_LAYOUTS,
    PdkvConnectorMetadata,
    PdkvConnectorStats,
    PdkvHandshakeMetadata,
    PdkvWorkerMetadata,
    _extra,
    _Recv,
    logger,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["PdkvConnectorWorker"]


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


def _cpu_attn_isa(dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The kernels vLLM's CPU attention picks for this cache (its own ``_get_attn_isa``)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, cache_dtype)


def _check_amx_tiles(vllm_config: "VllmConfig") -> None:
    """On the CPU platform, asks Linux for AMX tile state when vLLM's attention will
    run its AMX kernels (:func:`pdkv.integrations.vllm_amx.ensure_amx_tiles`); raises
    ``AmxTileError`` naming the cause and the flag when it cannot."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return  # not a real vLLM config (a unit test): no engine will run attention here
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    block_size = vllm_config.cache_config.block_size
    try:
        isa = _cpu_attn_isa(model_config.dtype, block_size, model_config.get_head_size(),
                            getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    except Exception as e:  # noqa: BLE001 - vLLM refuses this cache itself, later and by name
        logger.debug("pdkv connector: no CPU attention ISA for this cache (%s: %s)", type(e).__name__, e)
        return
    if ensure_amx_tiles(isa, dtype=str(model_config.dtype).removeprefix("torch."), block_size=block_size):
        logger.info("pdkv connector: vLLM's CPU attention uses AMX: asked Linux for AMX tile state for this "
                    "process (a pulled prompt skips the prefill that would otherwise have asked)")


def _probe_cpu_packing(dtype: torch.dtype, block_size: int, kv_heads: int, head_size: int,
                       cache_dtype: str) -> tuple[str | None, str | None]:
    """Writes known K/V through vLLM's own CPU cache kernel, with the ISA its attention
    picks for this geometry, into a scratch cache and checks every element where
    :func:`cpu_token` says that ISA's packing puts it. Returns (packing, None) when
    it matches, else (None, why not: a packing pdkv does not describe, or a kernel
    this vLLM lacks)."""
    try:
        from vllm import _custom_ops as ops

        isa = _cpu_attn_isa(dtype, block_size, head_size, cache_dtype)
        cache = torch.zeros(2, kv_heads, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = cache.view(2, kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
        n = block_size + 3  # a whole block and part of the next
        key = torch.randn(n, kv_heads, head_size).to(dtype)
        value = torch.randn(n, kv_heads, head_size).to(dtype)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(n), isa)
    except Exception as e:  # noqa: BLE001 - any failure only means "no per-token layout"
        return None, f"could not run vLLM's CPU cache kernel to learn its packing ({type(e).__name__}: {e})"
    if isa not in CPU_PACKING_GRANULE:
        return None, f"pdkv does not know how vLLM's {isa} CPU attention kernels ({dtype}) pack a block"
    for t in range(n):
        for h in range(kv_heads):
            k, v = cpu_token(cache, t // block_size, h, t % block_size, isa)
            if not (torch.equal(k, key[t, h]) and torch.equal(v, value[t, h])):
                return None, (f"vLLM's CPU attention ({isa} kernels, {dtype}) packs its KV cache in a way pdkv does "
                              f"not describe per token")
    return isa, None


def _layout_between(span: PullSpan, tokens: str | None, peer_tokens: str | None,
                    packing: str | None) -> tuple[str, int]:
    """The layout a pull goes through and how many of its tokens one token of that
    layout carries: whole blocks (``_LAYOUT``, 0) for equal block sizes, else the
    per-token layout of both sides' packing (``tokens``: decode's exported one,
    ``peer_tokens``: prefill's, ``packing``: decode's probed packing).

    Raises NotSupported when the two sides' vLLM kernels pack blocks differently (AMX
    and vec: the same bytes mean other elements), even for equal block sizes, or when
    the block sizes differ and either side exports no per-token layout."""
    if packing and peer_tokens and peer_tokens != packing:
        raise pdkv.NotSupported(f"prefill's vLLM packs its KV blocks for its {peer_tokens} attention kernels, "
                                f"decode's for {packing}: not pulled, decode recomputes")
    if not span.plan_tokens:
        return _LAYOUT, 0
    if not (tokens and peer_tokens):
        side = "prefill's" if tokens else "decode's"
        raise pdkv.NotSupported(f"{side} KV cache has no per-token layout (see its log), so blocks of "
                                f"{span.remote_block_size} tokens cannot become blocks of {span.local_block_size}")
    return _TOKEN_LAYOUTS[tokens], CPU_PACKING_GRANULE[tokens]


class PdkvConnectorWorker:
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
        _check_amx_tiles(vllm_config)  # before anything starts: a refusal stops this worker by name
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
        self.has_tokens = False  # registered a per-token layout too (_TOKEN_LAYOUTS[self.packing])
        self.packing: str | None = None  # how vLLM's CPU kernels pack this cache, when pdkv knows
        self.phys_per_block = 1
        self.block_bytes = 0
        # decode
        self._lock = threading.Lock()
        self._peers: dict[str, concurrent.futures.Future] = {}
        #: Connected prefill peer -> its layout's geometry (set by the connect thread).
        self._peer_geometry: dict[str, pdkv.KVGeometry] = {}
        self._peer_packing: dict[str, str] = {}  # peers that export a per-token layout -> its packing
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
        packing, why = _probe_cpu_packing(t.dtype, self.block_size, t.shape[1], t.shape[3] // 2, cache_dtype)
        if packing is None:
            logger.warning("pdkv connector: %s; pulls between different block sizes will be recomputed", why)
            return
        self.agent.add_layout(_TOKEN_LAYOUTS[packing], cpu_token_layout(kv_caches, packing))
        self.packing = packing
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
            for packing, name in _TOKEN_LAYOUTS.items():
                if name in layouts:
                    self._peer_packing[peer] = packing
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
            if rel.cached:
                self.stats.record_avoided(rel.local_hit_tokens)
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

    def _pull_layout(self, peer: str, r: _Recv, span: PullSpan, rgeo: pdkv.KVGeometry) -> tuple[str, int]:
        """The layout both sides pull through, and the tokens one of its tokens
        carries (:func:`_layout_between`). Raises when prefill's cache differs in
        anything but block size, or as :func:`_layout_between` does."""
        assert self.geometry is not None
        check_pullable(self.geometry, rgeo)
        if not r.remote_block_size and rgeo.block_tokens != self.geometry.block_tokens:
            raise pdkv.InvalidArgument(f"prefill sent no remote_block_size (an older prefill) and its KV layout's "
                                       f"blocks hold {rgeo.block_tokens} tokens, decode's "
                                       f"{self.geometry.block_tokens}")
        with self._lock:
            peer_packing = self._peer_packing.get(peer)
        return _layout_between(span, self.packing if self.has_tokens else None, peer_packing, self.packing)

    def _read(self, peer: str, r: _Recv) -> pdkv.Transfer:
        """Posts the pull, with prefill's generations when it sent them: one read of
        the request's token range, re-blocked by pdkv's planner when the block sizes
        differ."""
        span = self._checked_span(r)
        with self._lock:
            rgeo = self._peer_geometry[peer]
        layout, granule = self._pull_layout(peer, r, span, rgeo)
        r.layout = layout
        remote_per_block = kernel_blocks_per_block(span.remote_block_size, rgeo.block_tokens, "prefill")
        gens = self._remote_generations(r, remote_per_block)
        local = pdkv.Blocks(layout, self._phys(r.local_block_ids))
        remote_ids = kernel_block_ids(r.remote_block_ids, remote_per_block)
        # A per-token layout's token may carry several (AMX: 16-token groups); the
        # places past the prompt in the last one are decode's to write before it reads.
        num_tokens = -(-span.plan_tokens // granule) if granule else 0
        kw = dict(plan=pdkv.PlanOptions(num_tokens=num_tokens), notify=_RELEASE + r.remote_request_id.encode(),
                  timeout=self.timeout_s)
        if gens is not None:
            try:
                return self.agent.read(peer, local, pdkv.Blocks(layout, remote_ids, generations=gens), **kw)
            except pdkv.NotSupported as e:
                # cuda_ipc and nixl cannot check generations: fall back to the lease.
                logger.warning("pdkv connector: %s; pulling %s without them (lease check only)", e,
                               r.remote_request_id)
                r.remote_generations = None
        if r.expires_at and time.time() > r.expires_at - _LEASE_MARGIN_S:
            raise pdkv.TransferTimeout(f"prefill's lease on {r.remote_request_id} ran out before the pull")
        return self.agent.read(peer, local, pdkv.Blocks(layout, remote_ids), **kw)

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
            self.stats.record(xfer.elapsed, xfer.bytes_total, tokens=r.num_tokens, local_hit_tokens=r.local_hit_tokens)
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
               "tokens": r.num_tokens, "local_hit_tokens": r.local_hit_tokens,
               "bytes": xfer.bytes_total if xfer is not None else 0,
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
            for layout in (_LAYOUT, _TOKEN_LAYOUTS[self.packing]) if self.packing else (_LAYOUT,):
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
