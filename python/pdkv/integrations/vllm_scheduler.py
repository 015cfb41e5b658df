"""The scheduler half of the vLLM connector (:mod:`pdkv.integrations.vllm`): which
prompt tokens decode claims and which blocks pair up for its pull, and, on prefill,
which requests' blocks are handed to decode (with their generations) and when they
may go (:class:`PdkvConnectorScheduler`, :class:`_HeldBlocks`). It has no pdkv agent.

Imports vLLM; ``import pdkv`` does not import it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

import pdkv
from pdkv.integrations.vllm_layout import pull_span, splits_remote_block
from pdkv.integrations.vllm_meta import (
    _DEBUG_GENS,
    _GEN_MAX,
    PdkvConnectorMetadata,
    PdkvHandshakeMetadata,
    PdkvWorkerMetadata,
    _extra,
    _Recv,
    _Release,
    logger,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PdkvConnectorScheduler"]


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


class PdkvConnectorScheduler:
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
        self._local_hit: dict[str, int] = {}  # request id -> decode's prefix-cache hit (tokens), until alloc
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
        self._local_hit[request.request_id] = num_computed_tokens
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
        end = self._loaded_end(request, params)
        local_hit = self._local_hit.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            # Nothing to pull (all cached here, or decode computes the rest): prefill may free its blocks.
            self._release[request.request_id] = _Release(agents, rid, local_hit_tokens=local_hit,
                                                         cached=local_hit >= end)
            return
        start = end - num_external_tokens  # local prefix-cache hits are whole blocks
        remote_bs = self._remote_block_size(params) or 0
        recv = _Recv(local_block_ids=[], remote_block_ids=[], remote_agents=agents, remote_request_id=rid,
                     expires_at=float(params.get("remote_expires_at") or 0.0), num_tokens=num_external_tokens,
                     remote_block_size=remote_bs, local_hit_tokens=start)
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
            self._local_hit.pop(request.request_id, None)
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
