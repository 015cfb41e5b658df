"""How the proxy finds its workers and the model they serve: registrations in etcd
(:class:`~pdkv.serving.discovery.PoolWatch`) enter and leave the pools, each new
worker's ``/pd/info`` is fetched, workers that cannot serve with the others (another
model, an incompatible KV geometry, the wrong role) are kept out, and the tokenizer is
loaded from the model directory the workers report."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable, Coroutine

import aiohttp

from pdkv.errors import InvalidArgument

from ..discovery import Registry as DiscoveryRegistry
from .discovery import PoolWatch
from .openai_api import ModelInfo, TextCodec
from .protocol import WorkerInfo
from .proxy_client import WorkerClient
from .proxy_config import ProxyConfig, ProxyMode, parse_worker_urls
from .proxy_pool import PoolWorker, WorkerPool

__all__ = ["WorkerDiscovery"]

log = logging.getLogger("pdkv.serving")


class WorkerDiscovery:
    """Keeps the pools and the model's description up to date.

    Parameters
    ----------
    config : ProxyConfig
    prefill, decode : WorkerPool
    client : WorkerClient
    spawn : callable
        Runs a coroutine as a task the backend cancels on close.
    """

    def __init__(self, config: ProxyConfig, prefill: WorkerPool, decode: WorkerPool, client: WorkerClient,
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self._client = client
        self._spawn = spawn
        self._info: ModelInfo | None = None
        self._codec: TextCodec | None = None
        self._codec_loaded = False
        self._ready = asyncio.Event()
        self.pool_watch: PoolWatch | None = None

    def _workers(self) -> list[PoolWorker]:
        return self.prefill.workers + self.decode.workers

    def start(self) -> None:
        """Watches the registry (if the config names one)."""
        if self.config.registry is not None:
            self.pool_watch = PoolWatch(DiscoveryRegistry(self.config.registry, credential=self._client.credential),
                                        self.apply_registration)

    async def close(self) -> None:
        if self.pool_watch is not None:
            watch, self.pool_watch = self.pool_watch, None
            await watch.close()

    def rejected_records(self) -> list[Any]:
        """The registry records the watch ignored, by (kind, reason) (see :class:`PoolWatch`)."""
        return self.pool_watch.rejected_records() if self.pool_watch is not None else []

    @property
    def ready(self) -> bool:
        """The model is known and the tokenizer loaded (or given up)."""
        return self._ready.is_set()

    async def wait_ready(self, timeout: float) -> bool:
        """Waits until the model is known (a decode worker answered)."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def model_info(self) -> ModelInfo | None:
        return self._info if self._ready.is_set() else None

    def model_name(self) -> str | None:
        """The model's name once a decode worker described it (before the tokenizer is loaded)."""
        return self._info.name if self._info else None

    def codec(self) -> TextCodec | None:
        return self._codec

    def _pool_for(self, role: str) -> WorkerPool | None:
        if self.config.mode is ProxyMode.COLOCATED:
            return self.decode if role == "colocated" else None
        return {"prefill": self.prefill, "decode": self.decode}.get(role)

    def apply_registration(self, worker_id: str, record: dict[str, Any] | None) -> None:
        """A change under ``/pdkv/workers/`` (see :class:`~pdkv.serving.discovery.PoolWatch`):
        a serving worker enters rotation; a removed or draining one leaves it."""
        serving = record is not None and record.get("state") == "serving" and isinstance(record.get("url"), str)
        if not serving:
            for pool in (self.prefill, self.decode):
                for w in pool.remove(worker_id):
                    why = "deregistered or expired" if record is None else f"is {record.get('state')}"
                    log.info("%s worker %s (%s) %s: out of rotation", w.role, w.url, worker_id, why)
            self.update_model()
            return
        assert record is not None
        pool = self._pool_for(str(record.get("role")))
        if pool is None:
            log.debug("registered worker %s (%s) does not serve this proxy's %s mode", worker_id,
                      record.get("role"), self.config.mode.value)
            return
        try:
            url = parse_worker_urls([record["url"]])[0]
        except (InvalidArgument, IndexError):
            log.warning("registered worker %s has an invalid URL %r: ignored", worker_id, record.get("url"))
            return
        if pool.add(url, worker_id):
            log.info("%s worker %s (%s) registered: into rotation", pool.role, url, worker_id)

    async def run(self) -> None:
        """Fetches the info of every worker that has none yet (until cancelled)."""
        while True:
            missing = [w for w in self._workers() if w.info is None]
            if missing:
                await asyncio.gather(*(self._fetch_info(w) for w in missing))
                self.update_model()
            await asyncio.sleep(0.2 if any(w.info is None for w in self._workers()) else 2.0)

    async def _fetch_info(self, w: PoolWorker) -> None:
        try:
            async with self._client.get(w.url + "/pd/info", timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                if r.status != 200:
                    w.error = f"/pd/info answered HTTP {r.status}"
                    if r.status in (401, 403):
                        w.refused(r.status, "/pd/info")
                    return
                info = WorkerInfo.from_json(await r.json())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, InvalidArgument) as e:
            w.error = f"{type(e).__name__}: {e}"
            return
        w.info = info
        w.error = ""
        if w.misconfigured and not w.misconfigured.startswith("is a "):
            w.misconfigured = ""  # it accepts our signature now
        log.info("%s worker %s: model %s, pid %d", info.role, w.url, info.model, info.pid)

    def update_model(self) -> None:
        """Takes the workers that cannot serve with the first decode worker out of use
        and describes the model the usable ones serve (loading its tokenizer once)."""
        known = [w for w in self._workers() if w.info is not None]
        if not known:
            return
        ref = next((w.info for w in self.decode.workers if w.info is not None), None)
        if ref is None:
            return
        want_decode = ("colocated", "decode") if self.config.mode is ProxyMode.COLOCATED else ("decode",)
        for w in known:
            assert w.info is not None
            problem = ""
            want = want_decode if w.role == "decode" else ("prefill",)
            if w.info.role not in want:
                problem = f"is a {w.info.role} worker, expected {' or '.join(want)}"
                w.misconfigured = f"is a {w.info.role} worker, but is in the proxy's {w.role} pool"
            elif w.misconfigured.startswith("is a "):
                w.misconfigured = ""
            elif w.info.model != ref.model:
                problem = f"serves model {w.info.model!r}, the others {ref.model!r}"
            elif self.config.mode is not ProxyMode.COLOCATED and not w.info.kv_compatible(ref):
                problem = f"has a KV geometry ({w.info.kv}) that cannot exchange blocks with {ref.kv}"
            if problem and w.compatible:
                log.error("worker %s %s: not used", w.url, problem)
            w.compatible = not problem
            w.error = problem or w.error
        usable = [w.info for w in known if w.compatible and w.info is not None]
        dec = [i for i in (w.info for w in self.decode.workers if w.compatible) if i is not None]
        pre = [i for i in (w.info for w in self.prefill.workers if w.compatible) if i is not None]
        if not dec:
            return
        dcap = min(i.capacity_tokens for i in dec)
        pcap = min((i.capacity_tokens for i in pre), default=dcap)
        self._info = ModelInfo(ref.model, ref.vocab_size, min(i.max_model_len for i in usable),
                               min(dcap, pcap), dcap, aliases=ref.aliases)
        if not self._codec_loaded:
            self._codec_loaded = True
            self._spawn(self._load_codec(ref))

    async def _load_codec(self, ref: WorkerInfo) -> None:
        path = self.config.tokenizer or ref.model_dir
        if path and os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                                for f in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model")):
            try:
                self._codec = await asyncio.get_running_loop().run_in_executor(None, TextCodec.load, path)
            except Exception as e:  # noqa: BLE001 - serve token ids without a tokenizer
                log.warning("cannot load a tokenizer from %s (%s: %s); serving token-id prompts only", path,
                            type(e).__name__, e)
        else:
            log.warning("no tokenizer found (%s); serving token-id prompts only; pass --tokenizer DIR",
                        path or "the workers report no model directory")
        self._ready.set()
