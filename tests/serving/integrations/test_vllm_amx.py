"""vLLM's AMX bfloat16 CPU attention and the connector (issue 31).

Two things: (1) a process may execute AMX tile instructions only after it asked
Linux for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``), and
vLLM's AMX attention does not ask: the connector asks at start-up when vLLM will
use those kernels, and stops with a message naming the cause and ``--dtype
float32`` when Linux refuses; (2) vLLM's AMX ``reshape_and_cache`` packs a bfloat16
block differently from its ``vec`` kernels, and the connector's per-token layout
describes that packing, so pulls between block sizes move at bfloat16 there too.

The decision logic runs anywhere. The packing is checked against vLLM's own cache
kernel called with ``isa="amx"``: writing the cache uses no AMX instruction, so it
runs on this AMD EPYC (no ``amx_tile``) too. vLLM's AMX *attention* (reading the
cache with tile instructions) cannot run here: these tests do not show it reads
what the layout says, only that the bytes sit where its cache kernel puts them.
"""

from __future__ import annotations

import importlib.util
import json
import time
import warnings
from types import SimpleNamespace

import pytest

from pdkv.integrations import vllm_amx
from pdkv.integrations.vllm_amx import AmxTileError, ensure_amx_tiles

HAS_VLLM = importlib.util.find_spec("vllm") is not None
if HAS_VLLM:
    with warnings.catch_warnings():  # vLLM's and torch's own import-time deprecations
        warnings.simplefilter("ignore")
        import torch
        from vllm import _custom_ops as ops
        from vllm.v1.request import RequestStatus

        import pdkv
        from pdkv.integrations import vllm_worker
        from pdkv.integrations.vllm_layout import cpu_token, cpu_token_layout
        from pdkv.integrations.vllm_scheduler import PdkvConnectorScheduler
        from pdkv.integrations.vllm_worker import PdkvConnectorWorker

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not importable here: run scripts/ci_vllm.sh")


# ---------------------------------------------------------------- (1) AMX tile permission
def test_only_amx_kernels_on_an_amx_cpu_ask_for_tiles():
    asked = []

    def request():
        asked.append(1)
        return None

    assert ensure_amx_tiles("vec", dtype="bfloat16", block_size=128, has_amx=True, request=request) is False
    assert ensure_amx_tiles("vec16", dtype="bfloat16", block_size=16, has_amx=True, request=request) is False
    assert ensure_amx_tiles("amx", dtype="bfloat16", block_size=128, has_amx=False, request=request) is False
    assert asked == []
    assert ensure_amx_tiles("amx", dtype="bfloat16", block_size=128, has_amx=True, request=request) is True
    assert asked == [1]


def test_a_refused_request_names_the_cause_and_the_flag():
    with pytest.raises(AmxTileError) as e:
        ensure_amx_tiles("amx", dtype="bfloat16", block_size=64, has_amx=True,
                         request=lambda: "arch_prctl(...) failed with ENOSPC (No space left on device)")
    msg = str(e.value)
    for part in ("AMX kernels", "bfloat16 KV cache, 64-token blocks", "SIGILL", "ENOSPC", "--dtype float32"):
        assert part in msg, msg


def test_cpu_flag_is_read_from_cpuinfo(tmp_path):
    with_amx, without = tmp_path / "with", tmp_path / "without"
    with_amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tilex\n")
    assert vllm_amx.cpu_has_amx_tile(str(with_amx)) is True
    assert vllm_amx.cpu_has_amx_tile(str(without)) is False
    assert vllm_amx.cpu_has_amx_tile(str(tmp_path / "missing")) is False


def test_the_real_request_on_this_cpu():
    """The arch_prctl path itself: granted (and then permitted) on a CPU with AMX;
    refused with an errno on one without, where the connector never asks."""
    if vllm_amx.cpu_has_amx_tile():
        assert vllm_amx.request_tile_data() is None
        assert vllm_amx.tile_data_permitted() is True
    else:
        assert vllm_amx.tile_data_permitted() in (False, None)
        why = vllm_amx.request_tile_data()
        assert why is not None and ("failed with E" in why or "not available" in why), why
        assert vllm_amx.tile_data_permitted() in (False, None)
        assert ensure_amx_tiles("amx", dtype="bfloat16", block_size=128) is False  # never asks here


def _vllm_config(dtype, block_size: int = 64, head_size: int = 32) -> SimpleNamespace:
    kvt = SimpleNamespace(kv_connector_extra_config={"secret": "s" * 16, "transports": ["tcp"]},
                          engine_id="amx-engine", is_kv_consumer=True, kv_load_failure_policy="recompute")
    return SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=block_size,
                                                                                cache_dtype="auto"),
                           model_config=SimpleNamespace(dtype=dtype, get_head_size=lambda: head_size))


@needs_vllm
def test_worker_asks_at_start_up_and_stops_by_name_when_refused(monkeypatch):
    """The worker asks when vLLM's own ISA choice says ``amx``. On this CPU Linux
    really refuses (no AMX), which stands in for a refusal on an AMX machine."""
    if vllm_amx.cpu_has_amx_tile():
        pytest.skip("this CPU has AMX: Linux grants the request")
    seen = []
    monkeypatch.setattr(vllm_worker, "_cpu_attn_isa", lambda *a: seen.append(a) or "amx")
    monkeypatch.setattr(vllm_amx, "cpu_has_amx_tile", lambda cpuinfo="": True)
    with pytest.raises(AmxTileError, match=r"failed with E(NOTSUP|OPNOTSUPP) .*--dtype float32"):
        PdkvConnectorWorker(_vllm_config(torch.bfloat16), None)
    assert seen == [(torch.bfloat16, 64, 32, "auto")]
    monkeypatch.setattr(vllm_worker, "_cpu_attn_isa", lambda *a: "vec")
    PdkvConnectorWorker(_vllm_config(torch.bfloat16), None).close()


@needs_vllm
def test_worker_uses_vllms_own_isa_choice():
    """Unpatched: vLLM's ``_get_attn_isa`` on this CPU (``amx`` only with amx_tile)."""
    want = "amx" if vllm_amx.cpu_has_amx_tile() else "vec"
    assert vllm_worker._cpu_attn_isa(torch.bfloat16, 64, 32, "auto") == want
    assert vllm_worker._cpu_attn_isa(torch.float32, 64, 32, "auto") == "vec"
    PdkvConnectorWorker(_vllm_config(torch.bfloat16), None).close()


# ---------------------------------------------------------------- (2) the AMX packing
def _amx_write(cache, key, value, slots) -> None:
    """vLLM's own AMX cache kernel (``cpu_attn_reshape_and_cache`` with isa="amx")."""
    nb, heads, bs, d2 = cache.shape
    key_cache, value_cache = cache.view(nb, heads, 2 * bs, d2 // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "amx")


@needs_vllm
@pytest.mark.parametrize("block_size, heads, head_size", [(32, 1, 32), (64, 2, 32), (128, 2, 64), (96, 3, 128)])
def test_amx_kernel_puts_every_element_where_the_layout_says(block_size, heads, head_size):
    g = torch.Generator().manual_seed(block_size + head_size)
    nb = 4
    cache = torch.zeros(nb, heads, block_size, 2 * head_size, dtype=torch.bfloat16)
    n = nb * block_size - 5
    slots = torch.randperm(nb * block_size, generator=g)[:n]
    key = torch.randn(n, heads, head_size, generator=g).bfloat16()
    value = torch.randn(n, heads, head_size, generator=g).bfloat16()
    _amx_write(cache, key, value, slots)
    for i in range(n):
        b, t = divmod(int(slots[i]), block_size)
        for h in range(heads):
            k, v = cpu_token(cache, b, h, t, "amx")
            assert torch.equal(k, key[i, h]) and torch.equal(v, value[i, h]), (i, h)
    # ... and the vec description would not fit it (the packings differ).
    b, t = divmod(int(slots[0]), block_size)
    assert not torch.equal(cpu_token(cache, b, 0, t, "vec")[0], key[0, 0])


@needs_vllm
def test_probe_names_the_packing_vllm_picks(monkeypatch):
    assert vllm_worker._probe_cpu_packing(torch.float32, 64, 2, 32, "auto") == ("vec", None)
    monkeypatch.setattr(vllm_worker, "_cpu_attn_isa", lambda *a: "amx")
    assert vllm_worker._probe_cpu_packing(torch.bfloat16, 64, 2, 32, "auto") == ("amx", None)
    monkeypatch.setattr(vllm_worker, "_cpu_attn_isa", lambda *a: "vec16")
    packing, why = vllm_worker._probe_cpu_packing(torch.bfloat16, 64, 2, 32, "auto")
    assert packing is None and "does not know how vLLM's vec16" in why, why


@needs_vllm
def test_amx_layout_refuses_what_it_cannot_describe():
    with pytest.raises(pdkv.InvalidArgument, match="2-byte elements"):
        cpu_token_layout({"l": torch.zeros(2, 1, 32, 64)}, "amx")
    with pytest.raises(pdkv.InvalidArgument, match="unknown vLLM CPU packing"):
        cpu_token_layout({"l": torch.zeros(2, 1, 32, 64, dtype=torch.bfloat16)}, "neon")


# ---------------------------------------------------------------- connector pulls, AMX-packed
BLOCKS, LAYERS, HEADS, HDIM = 8, 2, 2, 32


class Side:
    """One instance's connector halves over a bfloat16 CPU cache that vLLM's AMX
    cache kernel writes (``packing``: which kernels the probe is told vLLM picks)."""

    def __init__(self, role: str, tokens: int, packing: str, monkeypatch, **extra) -> None:
        kvt = SimpleNamespace(kv_connector_extra_config={"secret": "s" * 16, "transports": ["tcp"], **extra},
                              engine_id=f"{role}-engine", is_kv_consumer=role == "decode",
                              kv_load_failure_policy="recompute")
        cfg = SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=tokens))
        self.tokens, self.packing = tokens, packing
        self.sched = PdkvConnectorScheduler(cfg)
        self.worker = PdkvConnectorWorker(cfg, None)
        self.caches = {f"layer{i}": torch.zeros(BLOCKS, HEADS, tokens, 2 * HDIM, dtype=torch.bfloat16)
                       for i in range(LAYERS)}
        with monkeypatch.context() as m:
            m.setattr(vllm_worker, "_cpu_attn_isa", lambda *a: packing)
            self.worker.register_kv_caches(self.caches)
        self.sched.set_agents({0: self.worker.handshake_metadata()})

    def write(self, block_ids: list[int], num_tokens: int, seed: int) -> None:
        """A request's prompt K/V through vLLM's cache kernel of this side's packing."""
        g = torch.Generator().manual_seed(seed)
        slots = torch.tensor([block_ids[i // self.tokens] * self.tokens + i % self.tokens for i in range(num_tokens)])
        for c in self.caches.values():
            key = torch.randn(num_tokens, HEADS, HDIM, generator=g).bfloat16()
            value = torch.randn(num_tokens, HEADS, HDIM, generator=g).bfloat16()
            kc, vc = c.view(BLOCKS, HEADS, 2 * self.tokens, HDIM).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, self.packing)

    def tokens_of(self, block_ids: list[int], num_tokens: int) -> list:
        return [cpu_token(c, block_ids[i // self.tokens], h, i % self.tokens, self.packing)
                for c in self.caches.values() for h in range(HEADS) for i in range(num_tokens)]

    def step(self):
        self.worker.start_load_kv(self.sched.build_connector_meta())
        sent, recvd = self.worker.get_finished()
        self.sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=self.worker.worker_meta(),
                                                           finished_sending=sent, finished_recving=recvd))
        return sent or set(), recvd or set()

    def until(self, pick, what: str, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pick(self.step())
            if got:
                return got
            time.sleep(0.01)
        raise AssertionError(f"no {what} within {timeout} s")


def _finish(prefill: Side, req_id: str, block_ids: list[int], num_tokens: int) -> dict:
    req = SimpleNamespace(request_id=req_id, kv_transfer_params={"do_remote_decode": True},
                          status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=num_tokens)
    delay, params = prefill.sched.request_finished(req, block_ids)
    assert delay is True
    return params


def _pull(decode: Side, req_id: str, params: dict, local: list[int]) -> set[int]:
    n = params["remote_num_tokens"]
    req = SimpleNamespace(request_id=req_id, kv_transfer_params=dict(params), num_prompt_tokens=n + 1)
    count, _ = decode.sched.get_num_new_matched_tokens(req, 0)
    decode.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(local),)), count)
    decode.until(lambda r: req_id in r[1], f"pull of {req_id}")
    return decode.worker.take_load_errors()


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@needs_vllm
@pytest.mark.parametrize("prefill_tokens, decode_tokens", [(64, 32), (32, 64), (32, 96)])
@pytest.mark.parametrize("num_tokens", [3, 17, 2 * 64 + 21])
def test_amx_pull_between_block_sizes_lands_every_token(monkeypatch, tmp_path, prefill_tokens, decode_tokens,
                                                        num_tokens):
    """Prefill's AMX-packed blocks of one size become decode's AMX-packed blocks of
    another, every token's K and V where vLLM's AMX kernel would have put them, the
    rest of decode's cache untouched."""
    stats = tmp_path / "pulls.jsonl"
    prefill = Side("prefill", prefill_tokens, "amx", monkeypatch, kv_lease_s=60)
    decode = Side("decode", decode_tokens, "amx", monkeypatch, transfer_timeout_s=10, stats_path=str(stats))
    try:
        assert prefill.worker.packing == decode.worker.packing == "amx"
        remote = [7, 2, 5, 1, 6][:-(-num_tokens // prefill_tokens)]
        local = [3, 6, 0, 4, 1, 5][:-(-num_tokens // decode_tokens)]
        prefill.write(remote, num_tokens, seed=num_tokens)
        untouched = [b for b in range(BLOCKS) if b not in local]
        before = {b: [c[b].clone() for c in decode.caches.values()] for b in untouched}
        assert _pull(decode, "d", _finish(prefill, "a", remote, num_tokens), local) == set()
        assert _same(decode.tokens_of(local, num_tokens), prefill.tokens_of(remote, num_tokens))
        assert all(torch.equal(c[b], before[b][i]) for b in untouched for i, c in enumerate(decode.caches.values()))
        (row,) = [json.loads(line) for line in stats.read_text().splitlines()]
        assert row["error"] is None and row["layout"] == "vllm-kv-tokens-amx", row
        # Whole 16-token groups: ceil(n/16)*16 tokens of K and V, 2 bytes each.
        assert row["bytes"] == -(-num_tokens // 16) * 16 * LAYERS * HEADS * 2 * HDIM * 2, row
    finally:
        decode.worker.close()
        prefill.worker.close()


@needs_vllm
@pytest.mark.parametrize("decode_tokens", [64, 32])
def test_caches_packed_for_other_kernels_are_recomputed_not_copied(monkeypatch, tmp_path, decode_tokens):
    """An AMX prefill and a vec decode: even with equal block sizes the same bytes
    mean other elements, so decode refuses the pull (vLLM recomputes) instead of
    copying whole blocks."""
    stats = tmp_path / "pulls.jsonl"
    prefill = Side("prefill", 64, "amx", monkeypatch, kv_lease_s=60)
    decode = Side("decode", decode_tokens, "vec", monkeypatch, transfer_timeout_s=10, stats_path=str(stats))
    try:
        prefill.write([7, 2], 100, seed=1)
        local = [3, 6, 0, 4][:-(-100 // decode_tokens)]
        before = [c.clone() for c in decode.caches.values()]
        assert _pull(decode, "d", _finish(prefill, "a", [7, 2], 100), local) == set(local)
        assert all(torch.equal(c, b) for c, b in zip(decode.caches.values(), before))
        (row,) = [json.loads(line) for line in stats.read_text().splitlines()]
        assert row["error"].startswith("NotSupported") and "amx attention kernels, decode's for vec" in row["error"]
    finally:
        decode.worker.close()
        prefill.worker.close()
