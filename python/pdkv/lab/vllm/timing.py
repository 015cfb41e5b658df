"""Connectors that time every KV pull the same way, whichever connector moves it:
the benchmark's instrument for comparing pdkv with vLLM's NixlConnector.

``TimedPdkvConnector`` and ``TimedNixlConnector`` behave exactly like
:class:`~pdkv.integrations.vllm.PdkvConnector` and vLLM's ``NixlConnector``; on the
decode side they also append one JSON line per request to
``kv_connector_extra_config["timing_path"]``:

``request_id``
    vLLM's request id on decode.
``blocks``, ``bytes``
    Blocks pulled and their KV bytes (all layers, K and V).
``seconds``
    From the step whose connector metadata first names the request (the worker
    learns it must pull) to the step that reports it received: the time the
    request waits for its KV, as the engine sees it, handshake included.
``failed``
    Whether the connector reported the pull as failed.

Select with ``"kv_connector": "TimedNixlConnector"`` (or ``TimedPdkvConnector``) and
``"kv_connector_module_path": "pdkv.lab.vllm.timing"``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from pdkv.integrations.vllm import PdkvConnector

__all__ = ["TimedNixlConnector", "TimedPdkvConnector"]


def _flat(ids: Any) -> list[int]:
    if ids and isinstance(ids[0], (list, tuple)):
        return [b for g in ids for b in g]
    return list(ids or ())


class _Timed:
    """Mixin: wraps ``register_kv_caches``, ``start_load_kv``,
    ``get_transfer_results`` and ``get_block_ids_with_load_errors`` of the connector
    it precedes in the MRO. vLLM calls the last two one after the other every step,
    so a row is written once the step's load errors are known."""

    _timing_label = "?"

    def _timing_init(self) -> None:
        if getattr(self, "_timing_ready", False):
            return
        extra = self._vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._timing_path = extra.get("timing_path")
        self._timing_seen: dict[str, tuple[float, list[int]]] = {}
        self._timing_rows: list[tuple[dict[str, Any], list[int]]] = []
        self._block_bytes = 0
        self._timing_ready = True

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._timing_init()
        seen, total = set(), 0
        for t in kv_caches.values():
            key = (t.data_ptr(), tuple(t.shape))
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        self._block_bytes = total // max(1, self._kv_cache_config.num_blocks)
        super().register_kv_caches(kv_caches)  # type: ignore[misc]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._timing_init()
        now = time.perf_counter()
        for req_id, m in getattr(self._connector_metadata, "reqs_to_recv", {}).items():
            if req_id not in self._timing_seen:
                self._timing_seen[req_id] = (now, _flat(getattr(m, "local_block_ids", ())))
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        self._timing_init()
        res = super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        now = time.perf_counter()
        failed = set(res.failed_recving or ())
        for req_id in res.finished_recving or ():
            t0, blocks = self._timing_seen.pop(req_id, (None, []))
            self._timing_rows.append(({"connector": self._timing_label, "request_id": req_id,
                                       "blocks": len(blocks), "bytes": len(blocks) * self._block_bytes,
                                       "seconds": None if t0 is None else now - t0, "failed": req_id in failed,
                                       "time": time.time()}, blocks))
        return res

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()  # type: ignore[misc]
        rows, self._timing_rows = getattr(self, "_timing_rows", []), []
        if rows and self._timing_path:
            with open(self._timing_path, "a") as f:
                for row, blocks in rows:
                    row["failed"] = row["failed"] or bool(errors.intersection(blocks))
                    f.write(json.dumps(row) + "\n")
        return errors


class TimedPdkvConnector(_Timed, PdkvConnector):
    """:class:`~pdkv.integrations.vllm.PdkvConnector` with per-request pull timing."""

    _timing_label = "pdkv"


class TimedNixlConnector(_Timed, NixlConnector):
    """vLLM's ``NixlConnector`` with per-request pull timing."""

    _timing_label = "nixl"
