"""The vLLM connector's block generations, without a vLLM engine: the connector's
scheduler and worker halves of a prefill and a decode instance, driven by hand the
way vLLM drives them, with real pdkv agents over real KV tensors.

Prefill hands out its blocks with generations; when a hand-out ends (decode's
release reached every rank, or the lease ran out) the scheduler tells the worker to
bump the blocks no other hand-out still holds, and the worker reports the request as
sent (vLLM frees the blocks) only after the bump. A pull that comes later (after
the blocks were reused) fails with ``StaleBlock`` and becomes a load error (vLLM
recomputes) instead of reading another request's KV.

Needs a Python that imports vLLM (``scripts/ci_vllm.sh``), like the rest of this
directory; it starts no vLLM instance and takes a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import time
import warnings
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is not None:
    with warnings.catch_warnings():  # vLLM's and torch's own import-time deprecations
        warnings.simplefilter("ignore")
        import torch
        from vllm.v1.request import RequestStatus

        import pdkv
        from pdkv.integrations.vllm_scheduler import PdkvConnectorScheduler
        from pdkv.integrations.vllm_worker import PdkvConnectorWorker
        from pdkv.integrations.vllm_layout import cpu_token

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not importable here: run scripts/ci_vllm.sh")

BLOCKS, HEADS, TOKENS, DIM = 8, 2, 4, 8


def _config(role: str, tokens: int = TOKENS, **extra) -> SimpleNamespace:
    kvt = SimpleNamespace(kv_connector_extra_config={"secret": "s" * 16, "transports": ["tcp"], **extra},
                          engine_id=f"{role}-engine", is_kv_consumer=role == "decode",
                          kv_load_failure_policy="recompute")
    return SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=tokens))


class Instance:
    """One side: the connector's scheduler half and one worker over a 2-layer KV cache
    of vLLM's CPU layout, ``tokens`` per block."""

    def __init__(self, role: str, seed: int, tokens: int = TOKENS, heads: int = HEADS, dim: int = DIM,
                 **extra) -> None:
        cfg = _config(role, tokens, **extra)
        self.tokens = tokens
        self.sched = PdkvConnectorScheduler(cfg)
        self.worker = PdkvConnectorWorker(cfg, None)
        g = torch.Generator().manual_seed(seed)
        self.caches = {f"layer{i}": torch.rand(BLOCKS, heads, tokens, 2 * dim, generator=g) for i in range(2)}
        self.worker.register_kv_caches(self.caches)
        self.sched.set_agents({0: self.worker.handshake_metadata()})

    def block(self, b: int) -> list:
        return [t[b].clone() for t in self.caches.values()]

    def fill(self, b: int, value: float) -> None:
        for t in self.caches.values():
            t[b].fill_(value)

    def step(self) -> tuple[set[str], set[str]]:
        """One engine step: scheduler -> worker metadata, worker results -> scheduler."""
        self.worker.start_load_kv(self.sched.build_connector_meta())
        sent, recvd = self.worker.get_finished()
        self.sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=self.worker.worker_meta(),
                                                           finished_sending=sent, finished_recving=recvd))
        return sent or set(), recvd or set()

    def until(self, pick, what: str, timeout: float = 20.0) -> set[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pick(self.step())
            if got:
                return got
            time.sleep(0.01)
        raise AssertionError(f"no {what} within {timeout} s")

    def close(self) -> None:
        self.worker.close()


@pytest.fixture
def pd():
    prefill = Instance("prefill", 1, kv_lease_s=60)
    decode = Instance("decode", 2, transfer_timeout_s=10)
    yield prefill, decode
    decode.close()
    prefill.close()


def _finish(prefill: Instance, req_id: str, block_ids: list[int], num_tokens: int | None = None) -> dict:
    """Prefill finished ``req_id`` (max_tokens=1) after ``num_tokens`` prompt tokens
    (default: its blocks full): the kv_transfer_params it returns."""
    n = len(block_ids) * prefill.tokens if num_tokens is None else num_tokens
    req = SimpleNamespace(request_id=req_id, kv_transfer_params={"do_remote_decode": True},
                          status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=n)
    delay, params = prefill.sched.request_finished(req, block_ids)
    assert delay is True
    return params


def _pull(decode: Instance, req_id: str, params: dict, local: list[int], cached: int = 0) -> set[int]:
    """Decode schedules ``req_id`` with ``params`` into ``local`` blocks (the request's
    whole block list; its first ``cached`` tokens are local prefix-cache hits) and
    pulls; returns the blocks reported as load errors."""
    n = params["remote_num_tokens"]
    req = SimpleNamespace(request_id=req_id, kv_transfer_params=dict(params), num_prompt_tokens=n + 1)
    count, is_async = decode.sched.get_num_new_matched_tokens(req, cached)
    assert (count, is_async) == (n - cached, True)
    decode.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(local),)), count)
    decode.until(lambda r: req_id in r[1], f"pull of {req_id}")
    return decode.worker.take_load_errors()


def test_params_carry_the_generations_the_agent_has(pd):
    prefill, _ = pd
    params = _finish(prefill, "a", [1, 2, 5])
    assert params["remote_block_ids"] == [1, 2, 5]
    assert params["remote_block_generations"] == [1, 1, 1] == prefill.worker.agent.generations("vllm-kv", [1, 2, 5])


def test_late_pull_of_reused_blocks_fails_stale_and_reads_nothing(pd, tmp_path):
    """Prefill's lease runs out, its blocks are freed and written by another
    request; decode's late pull (its clock says the lease still runs) must not
    read them."""
    prefill, decode = pd
    stale = _finish(prefill, "a", [1, 2])
    prefill.sched.held.requests["a"].expires_at = time.time() - 1  # the lease ran out
    prefill.until(lambda r: "a" in r[0], "release of a")  # reported sent: vLLM frees 1, 2
    assert prefill.worker.agent.generations("vllm-kv", [1, 2]) == [2, 2]
    prefill.fill(1, 7.0)  # another request reuses the blocks...
    prefill.fill(2, 7.0)
    fresh = _finish(prefill, "b", [2, 1])  # ... and is handed out itself
    assert fresh["remote_block_generations"] == [2, 2]

    before = decode.block(3) + decode.block(4)
    stale["remote_expires_at"] = time.time() + 3600  # decode's clock lags: no early-expiry check saves it
    assert _pull(decode, "d1", stale, [3, 4]) == {3, 4}  # load errors: vLLM recomputes the prompt
    assert all((x == y).all() for x, y in zip(decode.block(3) + decode.block(4), before)), "stale pull landed"
    assert decode.worker.stats.data["failed"] == 1

    # The fresh hand-out of the same blocks pulls fine (mirror == agent), and its
    # release (decode's notification) bumps them again.
    assert _pull(decode, "d2", fresh, [5, 6]) == set()
    assert all((t[5] == 7.0).all() and (t[6] == 7.0).all() for t in decode.caches.values())
    prefill.until(lambda r: "b" in r[0], "release of b")
    assert prefill.worker.agent.generations("vllm-kv", [1, 2]) == [3, 3] == prefill.sched.held.generations([1, 2])


def test_stale_pull_is_recorded_as_stale_block(tmp_path):
    stats = tmp_path / "pulls.jsonl"
    prefill = Instance("prefill", 1, kv_lease_s=60)
    decode = Instance("decode", 2, stats_path=str(stats))
    try:
        params = _finish(prefill, "a", [4])
        prefill.sched.held.requests["a"].expires_at = 0.0
        prefill.until(lambda r: "a" in r[0], "release of a")
        assert _pull(decode, "d", params, [1]) == {1}
        (row,) = [json.loads(line) for line in stats.read_text().splitlines()]
        assert row["error"].startswith("StaleBlock"), row
    finally:
        decode.close()
        prefill.close()


def test_a_block_shared_by_two_hand_outs_stays_valid_until_both_end(pd):
    """Prefix caching: two finished requests hold the same first block. Releasing
    one must not invalidate the other's pull of it."""
    prefill, decode = pd
    first = _finish(prefill, "a", [1, 2])
    second = _finish(prefill, "b", [1, 3])
    assert _pull(decode, "d1", first, [4, 5]) == set()
    prefill.until(lambda r: "a" in r[0], "release of a")
    assert prefill.worker.agent.generations("vllm-kv", [1, 2, 3]) == [1, 2, 1]
    assert _pull(decode, "d2", second, [6, 7]) == set()
    prefill.until(lambda r: "b" in r[0], "release of b")
    assert prefill.worker.agent.generations("vllm-kv", [1, 2, 3]) == [2, 2, 2] == \
        prefill.sched.held.generations([1, 2, 3])


def test_bad_generations_fail_the_pull(pd):
    prefill, decode = pd
    params = _finish(prefill, "a", [1, 2])
    for bad in ([1], [1, 0], [1, 2**32], ["1", 1], "x"):
        p = dict(params, remote_block_generations=bad)
        assert _pull(decode, f"d-{bad!s}", p, [3, 4]) == {3, 4}, bad


def test_older_prefill_without_generations_keeps_the_lease_check(pd):
    prefill, decode = pd
    params = _finish(prefill, "a", [1, 2])
    del params["remote_block_generations"]
    assert _pull(decode, "d1", dict(params, remote_expires_at=time.time() - 1), [3, 4]) == {3, 4}
    assert _pull(decode, "d2", params, [3, 4]) == set()


def test_transport_without_generations_falls_back_to_the_lease(pd, monkeypatch):
    """cuda_ipc and nixl refuse generations (NotSupported at prepare): the
    pull goes without them and decode checks prefill's lease itself, as before."""
    prefill, decode = pd
    real = decode.worker.agent.read

    def read(peer, local, remote=None, **kw):
        if remote is not None and remote.generations is not None:
            raise pdkv.NotSupported("transport 'x' cannot check block generations")
        return real(peer, local, remote, **kw)

    monkeypatch.setattr(decode.worker.agent, "read", read)
    params = _finish(prefill, "a", [1, 2])
    assert _pull(decode, "d1", dict(params, remote_expires_at=time.time() - 1), [3, 4]) == {3, 4}
    assert _pull(decode, "d2", params, [3, 4]) == set()


# ---------------------------------------------------------------- different block sizes
#: Block sizes and head size vLLM's CPU kernels take (multiples of 32): the connector
#: checks its per-token layout against the kernel at registration.
BIG, SMALL, HDIM = 64, 32, 32


def _hetero(prefill_tokens: int, decode_tokens: int, prefill_heads: int = HEADS, **decode_extra):
    return (Instance("prefill", 1, tokens=prefill_tokens, heads=prefill_heads, dim=HDIM, kv_lease_s=60),
            Instance("decode", 2, tokens=decode_tokens, dim=HDIM, **decode_extra))


def _request_tokens(inst: Instance, block_ids: list[int], start: int, end: int) -> list:
    """(K, V) of every layer, head and token in [start, end) of a request whose block
    list is ``block_ids``, read where vLLM's CPU kernel keeps them."""
    t = inst.tokens
    return [cpu_token(c, block_ids[i // t], h, i % t) for c in inst.caches.values()
            for h in range(c.shape[1]) for i in range(start, end)]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("prefill_tokens, decode_tokens", [(BIG, SMALL), (SMALL, BIG)])
@pytest.mark.parametrize("num_tokens", [3, 2 * BIG + 21])  # shorter than a block; blocks and a partial one
def test_pull_between_block_sizes_lands_every_token(prefill_tokens, decode_tokens, num_tokens):
    prefill, decode = _hetero(prefill_tokens, decode_tokens)
    try:
        assert prefill.worker.has_tokens and decode.worker.has_tokens  # the kernel packs fp32 as described
        remote = [7, 2, 5, 1, 0, 6][:-(-num_tokens // prefill_tokens)]
        local = [3, 6, 0, 4, 1, 5][:-(-num_tokens // decode_tokens)]
        params = _finish(prefill, "a", remote, num_tokens)
        assert params["remote_block_size"] == prefill_tokens
        assert _pull(decode, "d", params, local) == set()
        assert _same(_request_tokens(decode, local, 0, num_tokens), _request_tokens(prefill, remote, 0, num_tokens))
        prefill.until(lambda r: "a" in r[0], "release of a")  # the read's notification freed prefill's blocks
    finally:
        decode.close()
        prefill.close()


def test_prefix_hit_on_a_prefill_block_boundary_pulls_the_rest():
    """Decode (32-token blocks) caches the first 64 tokens: it pulls prefill's
    (64-token) blocks 1.. into its blocks 2.. and leaves its cached ones alone."""
    prefill, decode = _hetero(BIG, SMALL)
    try:
        remote, local, n = [7, 2, 5], [3, 6, 0, 4, 1], 2 * BIG + 21
        cached = _request_tokens(decode, local, 0, BIG)
        assert _pull(decode, "d", _finish(prefill, "a", remote, n), local, cached=BIG) == set()
        assert _same(_request_tokens(decode, local, BIG, n), _request_tokens(prefill, remote, BIG, n))
        assert _same(_request_tokens(decode, local, 0, BIG), cached)
        # the connector's stats count what moved and what decode's cache saved
        assert decode.worker.stats.data["pulled_tokens"] == n - BIG
        assert decode.worker.stats.data["local_hit_tokens"] == BIG
        assert decode.worker.stats.reduce()["Prompt tokens cached on decode (not pulled)"] == BIG
    finally:
        decode.close()
        prefill.close()


def test_whole_prompt_cached_on_decode_pulls_nothing_and_is_counted(pd):
    """Decode's prefix cache holds every prompt token prefill computed: no pull, prefill
    frees its blocks, and the stats count the avoided pull and the tokens it saved."""
    prefill, decode = pd
    params = _finish(prefill, "a", [1, 2], 2 * TOKENS)
    req = SimpleNamespace(request_id="d", kv_transfer_params=dict(params), num_prompt_tokens=2 * TOKENS + 1)
    assert decode.sched.get_num_new_matched_tokens(req, 2 * TOKENS) == (0, False)
    decode.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([3, 4, 5],)), 0)
    decode.step()  # sends the release
    prefill.until(lambda r: "a" in r[0], "release of a")
    data = decode.worker.stats.data
    assert (data["pulls_avoided"], data["local_hit_tokens"], data["pulled_tokens"], data["bytes"]) == \
        (1, 2 * TOKENS, 0, [])
    merged = type(decode.worker.stats)()
    assert merged.aggregate(decode.worker.stats).data["pulls_avoided"] == 1


def test_prefix_hit_inside_a_prefill_block_is_computed_not_pulled():
    """Decode caches 32 tokens, which end inside prefill's first 64-token block: it
    claims nothing (computes the rest itself) and lets prefill free its blocks."""
    prefill, decode = _hetero(BIG, SMALL)
    try:
        params = _finish(prefill, "a", [7, 2, 5], 2 * BIG + 21)
        req = SimpleNamespace(request_id="d", kv_transfer_params=dict(params), num_prompt_tokens=2 * BIG + 22)
        assert decode.sched.get_num_new_matched_tokens(req, SMALL) == (0, False)
        decode.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([3, 6, 0, 4, 1],)), 0)
        decode.step()  # sends the release
        prefill.until(lambda r: "a" in r[0], "release of a")
        assert decode.worker.stats.is_empty()  # no pull, no failure
    finally:
        decode.close()
        prefill.close()


def test_other_kv_heads_are_recomputed_with_the_reason(tmp_path):
    stats = tmp_path / "pulls.jsonl"
    prefill, decode = _hetero(BIG, SMALL, prefill_heads=1, stats_path=str(stats))
    try:
        assert _pull(decode, "d", _finish(prefill, "a", [7, 2], 2 * BIG), [3, 6, 0, 4]) == {3, 6, 0, 4}
        (row,) = [json.loads(line) for line in stats.read_text().splitlines()]
        assert row["error"].startswith("InvalidArgument") and "KV heads 1 vs 2" in row["error"], row
        prefill.until(lambda r: "a" in r[0], "release of a")  # decode still frees prefill's copy
    finally:
        decode.close()
        prefill.close()


def test_older_prefill_without_its_block_size_is_not_misread():
    """A prefill that sends no remote_block_size is taken to use decode's: when its
    layout says otherwise the pull fails (vLLM recomputes) instead of reading the
    wrong tokens."""
    prefill, decode = _hetero(BIG, SMALL)
    try:
        params = _finish(prefill, "a", [7, 2], 2 * BIG)
        del params["remote_block_size"]
        # decode's reading: 128 tokens in its 32-token blocks, i.e. 4 prefill blocks (only 2 sent)
        assert _pull(decode, "d", params, [3, 6, 0, 4]) == {3, 6, 0, 4}
        params = _finish(prefill, "b", [1, 3, 4, 5], 2 * BIG)
        del params["remote_block_size"]
        assert _pull(decode, "e", params, [3, 6, 0, 4]) == {3, 6, 0, 4}  # counts fit, layouts do not
    finally:
        decode.close()
        prefill.close()


def test_without_a_per_token_layout_block_sizes_are_recomputed(tmp_path):
    """A cache whose packing the probe did not recognise (bfloat16 on AMX, say)
    exports no per-token layout: pulls between block sizes fail (vLLM recomputes)."""
    stats = tmp_path / "pulls.jsonl"
    prefill, decode = _hetero(BIG, SMALL, stats_path=str(stats))
    try:
        decode.worker.has_tokens = False
        assert _pull(decode, "d", _finish(prefill, "a", [7, 2], 2 * BIG), [3, 6, 0, 4]) == {3, 6, 0, 4}
        (row,) = [json.loads(line) for line in stats.read_text().splitlines()]
        assert row["error"].startswith("NotSupported") and "per-token layout" in row["error"], row
    finally:
        decode.close()
        prefill.close()


def test_late_pull_between_block_sizes_goes_stale_through_the_token_layout(tmp_path):
    """Pulls between block sizes go through the per-token layout: prefill bumps its
    generations too, so a pull after the hand-out ended reads nothing there either."""
    stats = tmp_path / "pulls.jsonl"
    prefill, decode = _hetero(BIG, SMALL, stats_path=str(stats))
    try:
        late = _finish(prefill, "a", [7, 2], BIG + 13)
        assert _pull(decode, "d1", dict(late), [3, 6, 0]) == set()
        prefill.until(lambda r: "a" in r[0], "release of a")
        assert prefill.worker.agent.generations("vllm-kv-tokens", [7, 2]) == [2, 2] == \
            prefill.worker.agent.generations("vllm-kv", [7, 2])
        before = _request_tokens(decode, [1, 5, 4], 0, BIG + 13)
        assert _pull(decode, "d2", late, [1, 5, 4]) == {1, 5, 4}
        assert _same(_request_tokens(decode, [1, 5, 4], 0, BIG + 13), before)
        first, second = [json.loads(line) for line in stats.read_text().splitlines()]
        assert first["layout"] == "vllm-kv-tokens" and first["error"] is None, first
        assert second["error"].startswith("StaleBlock"), second
    finally:
        decode.close()
        prefill.close()
