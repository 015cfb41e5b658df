"""What the halves of the vLLM connector (:mod:`pdkv.integrations.vllm`) pass each
other and report: the scheduler -> worker metadata (pulls to post, releases to send,
held requests to finish), the worker -> scheduler release notices, the worker's
handshake, the pull statistics vLLM logs, and the constants both halves share.

Imports vLLM; ``import pdkv`` does not import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["PdkvConnectorMetadata", "PdkvConnectorStats", "PdkvHandshakeMetadata", "PdkvWorkerMetadata"]

logger = init_logger("vllm.kv_connector.pdkv")  # under "vllm": shown with vLLM's own logs

#: Notification payload prefix: ``b"pdkv-vllm release <prefill request id>"``.
_RELEASE = b"pdkv-vllm release "
#: Without block generations (an older prefill), a pull must complete this many
#: seconds before the lease ends to be trusted.
_LEASE_MARGIN_S = 5.0
_GEN_MAX = 2**32 - 1
_LAYOUT = "vllm-kv"
#: vLLM CPU caches whose packing the connector knows also export where each token's K
#: and V elements sit (:func:`~pdkv.integrations.vllm_layout.cpu_token_layout`), under
#: the name of their packing; pulls between different block sizes go through it
#: (``_LAYOUT`` only tells whole blocks), and the names tell two packings apart.
_TOKEN_LAYOUT = "vllm-kv-tokens"
_TOKEN_LAYOUTS = {"vec": _TOKEN_LAYOUT, "amx": "vllm-kv-tokens-amx"}
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
    #: Prompt tokens decode's own prefix cache held already (not pulled).
    local_hit_tokens: int = 0


@dataclass
class _Release:
    """Decode: tell prefill to free a request's blocks without pulling them."""

    remote_agents: list[str]
    remote_request_id: str
    #: Prompt tokens decode's own prefix cache held when nothing is pulled because of
    #: it (``cached``); a release for another reason (an abort) has ``cached`` False.
    local_hit_tokens: int = 0
    cached: bool = False


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
        self.data = {"transfer_s": [], "bytes": [], "failed": 0, "pulled_tokens": 0, "local_hit_tokens": 0,
                     "pulls_avoided": 0}

    def record(self, seconds: float, nbytes: int, *, tokens: int = 0, local_hit_tokens: int = 0) -> None:
        """A pull of ``tokens`` prompt tokens (``nbytes``) that decode's prefix cache did
        not hold; ``local_hit_tokens`` it held already and did not pull."""
        self.data["transfer_s"].append(float(seconds))
        self.data["bytes"].append(int(nbytes))
        self.data["pulled_tokens"] += int(tokens)
        self.data["local_hit_tokens"] += int(local_hit_tokens)

    def record_avoided(self, local_hit_tokens: int) -> None:
        """A request whose whole prompt decode's prefix cache held: nothing pulled."""
        self.data["pulls_avoided"] += 1
        self.data["local_hit_tokens"] += int(local_hit_tokens)

    def aggregate(self, other: KVConnectorStats) -> "PdkvConnectorStats":
        if not other.is_empty():
            self.data["transfer_s"] += other.data["transfer_s"]
            self.data["bytes"] += other.data["bytes"]
            for key in ("failed", "pulled_tokens", "local_hit_tokens", "pulls_avoided"):
                self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        return self

    def is_empty(self) -> bool:
        return not self.data["transfer_s"] and not self.data["failed"] and not self.data.get("pulls_avoided")

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
            "Prompt tokens pulled": self.data.get("pulled_tokens", 0),
            "Prompt tokens cached on decode (not pulled)": self.data.get("local_hit_tokens", 0),
            "Pulls avoided (whole prompt cached)": self.data.get("pulls_avoided", 0),
        }

def _extra(vllm_config: "VllmConfig") -> dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
