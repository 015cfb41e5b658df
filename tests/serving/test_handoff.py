"""The KV hand-off without HTTP (:mod:`pdkv.serving.handoff`): a prefill engine with a
:class:`KVSender` and a decode engine with a :class:`KVReceiver`, each with its own pdkv
agent, in one process and one event loop; the engines are stepped by the test. The
decoded tokens are compared with ``model.generate``; block accounting, generations,
late writes and link health are checked as values."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import pdkv  # noqa: E402
from pdkv.errors import ResourceExhausted  # noqa: E402
from pdkv.serving.engine import Engine, EngineConfig  # noqa: E402
from pdkv.serving.handoff import KVReceiver, KVSender  # noqa: E402
from pdkv.serving.kv_pool import PagedKVPool  # noqa: E402
from pdkv.serving.protocol import GenParams, KVFailed, KVReady, PrefillRequest, Reservation  # noqa: E402
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from tinylm import MAX_NEW, shuffled, tiny_model  # noqa: E402

SECRET = "handoff-test-secret"
NUM_BLOCKS = 32
PROMPT = 3  # index into the tiny model's prompts (23 tokens: 6 blocks of 4)


class Pair:
    """A prefill and a decode side: agent, pool, engine and hand-off object each."""

    def __init__(self, tm) -> None:
        self.tm = tm
        self.executor = ThreadPoolExecutor(4)
        self.pre_agent = pdkv.Agent("handoff-prefill", secret=SECRET)
        self.dec_agent = pdkv.Agent("handoff-decode", secret=SECRET)
        self.pre = self._engine(self.pre_agent, shuffled(NUM_BLOCKS, 1))
        self.dec = self._engine(self.dec_agent, shuffled(NUM_BLOCKS, 2))
        self.sender = KVSender(self.pre_agent, self.pre, executor=self.executor)
        self.receiver = KVReceiver(self.dec_agent, self.dec, executor=self.executor, address=self.dec_agent.address)

    def _engine(self, agent: pdkv.Agent, order: list[int]) -> Engine:
        param = next(self.tm.model.parameters())
        geometry = pdkv.KVGeometry.from_hf_config(self.tm.model.config, num_blocks=NUM_BLOCKS, block_tokens=4,
                                                  dtype=param.dtype)
        pool = PagedKVPool.shared(agent, geometry, block_order=order)
        return Engine(self.tm.model, EngineConfig(num_blocks=NUM_BLOCKS, block_tokens=4, mode="chunked",
                                                  max_batch_tokens=64, max_num_seqs=4, num_threads=1), pool=pool)

    def prefill(self, rid: str, prompt: list[int], params: GenParams, res: Reservation):
        """Runs the prompt prefill-only; returns (handle, first token, PrefillRequest)."""
        events = []
        h = self.pre.add_request(rid, prompt, SamplingParams.of(params), on_event=events.append, prefill_only=True)
        self.pre.run_until_idle()
        [ev] = events
        return h, ev.token_id, PrefillRequest(rid, tuple(prompt), params, res, 10.0)

    def decode(self, handle, events: list) -> list[int]:
        self.dec.run_until_idle()
        assert handle.finished
        return [e.token_id for e in events if e.token_id is not None]

    def close(self) -> None:
        self.pre_agent.close()
        self.dec_agent.close()
        self.executor.shutdown()


@pytest.fixture
def pair():
    p = Pair(tiny_model("llama_gqa"))
    try:
        yield p
    finally:
        p.close()


def _params() -> GenParams:
    return GenParams(max_tokens=MAX_NEW, temperature=0.0, seed=1)


async def streamed_prefill(pair: Pair, rid: str, prompt: list[int], res):
    """Prefills ``prompt`` with the sender's layer streamer as the engine's sink, one
    engine step at a time; returns (handle, first token, request, streamer, steps)."""
    req = PrefillRequest(rid, tuple(prompt), _params(), res, 10.0)
    loop = asyncio.get_running_loop()
    streamer = await pair.sender.layer_streamer(req, loop.time() + 10)
    assert streamer is not None
    events: list = []
    h = pair.pre.add_request(rid, prompt, SamplingParams.of(_params()), on_event=events.append, prefill_only=True,
                             layer_sink=streamer)
    steps = 0
    while not h.finished:
        pair.pre.step()
        steps += 1
    [ev] = events
    return h, ev.token_id, req, streamer, steps


async def _until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


def test_pushed_kv_is_decoded_into_the_reference(pair) -> None:
    prompt, ref = list(pair.tm.prompts[PROMPT]), pair.tm.refs[PROMPT]

    async def scenario() -> None:
        listening = asyncio.ensure_future(pair.receiver.run_notifications())
        try:
            t = await pair.receiver.reserve("r1", len(prompt), wait_s=1.0, kv_timeout_s=10.0)
            assert t.reservation.blocks == tuple(t.blocks) and len(t.blocks) == 6
            assert t.reservation.agent == pair.dec_agent.address and t.reservation.name == "handoff-decode"
            assert pair.receiver.awaiting == 1
            h, first, req = pair.prefill("r1", prompt, _params(), t.reservation)
            posted: list = []
            loop = asyncio.get_running_loop()
            result = await pair.sender.push(req, h, first, with_kv=True, deadline=loop.time() + 10, posted=posted)
            assert result.ok and result.posted and result.bytes > 0, result
            assert len(posted) == 1 and posted[0].done
            pair.sender.finish("r1", h, posted)
            assert pair.pre.num_free_blocks == NUM_BLOCKS  # released once the write was over
            arrival = await pair.receiver.wait(t)
            assert arrival.ready == KVReady("r1", first, h.seed) and arrival.reason == "" and arrival.error == ""
            events: list = []
            hd = pair.receiver.admit(t, arrival, prompt, SamplingParams.of(_params()), events.append)
            pair.receiver.finish(t)
            assert [first] + pair.decode(hd, events) == ref
            assert not hd.recomputed
            assert pair.receiver.awaiting == 0 and pair.receiver.invalidated == 0
            assert pair.sender.links() == {pair.dec_agent.address: {"auth_failures": 0, "transport_errors": 0,
                                                                    "last_error": "", "ok": True}}
        finally:
            listening.cancel()

    asyncio.run(scenario())
    assert pair.dec.num_free_blocks == NUM_BLOCKS


def test_a_terminal_failure_recomputes_without_invalidating(pair) -> None:
    prompt, ref = list(pair.tm.prompts[PROMPT]), pair.tm.refs[PROMPT]

    async def scenario() -> None:
        t = await pair.receiver.reserve("r2", len(prompt), wait_s=1.0, kv_timeout_s=10.0)
        gens = t.reservation.generations
        assert pair.receiver.kv_failed(KVFailed("r2", ref[0], "prefill worker gone", terminal=True)) == "recomputing"
        assert pair.receiver.kv_failed(KVFailed("r2")) == "settled"
        assert pair.receiver.kv_failed(KVFailed("nobody")) == "unknown"
        arrival = await pair.receiver.wait(t)
        assert arrival.ready is None and arrival.reason == "kv_failed" and arrival.error == "prefill worker gone"
        assert pair.receiver.invalidated == 0
        assert tuple(pair.dec_agent.generations("kv", t.blocks)) == gens  # no write could land: no bump
        events: list = []
        hd = pair.receiver.admit(t, arrival, prompt, SamplingParams.of(_params()), events.append)
        pair.receiver.finish(t)
        assert [ref[0]] + pair.decode(hd, events) == ref  # the prefill side's first token, then recomputed
        assert hd.recomputed

    asyncio.run(scenario())
    assert pair.dec.num_free_blocks == NUM_BLOCKS


def test_a_timeout_bumps_generations_so_a_late_write_cannot_land(pair) -> None:
    prompt, ref = list(pair.tm.prompts[PROMPT]), pair.tm.refs[PROMPT]

    async def scenario() -> None:
        t = await pair.receiver.reserve("r3", len(prompt), wait_s=1.0, kv_timeout_s=0.05)
        arrival = await pair.receiver.wait(t)
        assert arrival.ready is None and arrival.reason == "kv_timeout" and arrival.error.startswith("no KV within")
        assert pair.receiver.invalidated == 1
        assert all(new != old for new, old in zip(pair.dec_agent.generations("kv", t.blocks),
                                                   t.reservation.generations))
        events: list = []
        hd = pair.receiver.admit(t, arrival, prompt, SamplingParams.of(_params()), events.append)
        pair.receiver.finish(t)
        assert pair.decode(hd, events) == ref  # recomputed from scratch
        # The prefill side pushes late, into the old generations: refused before landing.
        h, first, req = pair.prefill("r3", prompt, _params(), t.reservation)
        posted: list = []
        loop = asyncio.get_running_loop()
        result = await pair.sender.push(req, h, first, with_kv=True, deadline=loop.time() + 10, posted=posted)
        assert not result.ok and result.posted and result.error.startswith("StaleBlock"), result
        pair.sender.finish("r3", h, posted)
        assert pair.sender.links()[pair.dec_agent.address]["ok"] is False
        assert pair.receiver.deliver(KVReady("r3", first, h.seed).encode()) is False  # nobody waits any more

    asyncio.run(scenario())
    assert pair.dec.num_free_blocks == NUM_BLOCKS and pair.pre.num_free_blocks == NUM_BLOCKS


def test_an_abandoned_reservation_is_released_after_the_bump(pair) -> None:
    async def scenario() -> None:
        t = await pair.receiver.reserve("r4", 9, wait_s=1.0, kv_timeout_s=10.0)
        assert pair.dec.num_free_blocks == NUM_BLOCKS - 3
        pair.receiver.finish(t)  # the client went away before any KV
        await _until(lambda: pair.dec.num_free_blocks == NUM_BLOCKS)
        assert pair.receiver.invalidated == 1 and pair.receiver.awaiting == 0
        # With every block reserved, the next reservation waits, then gives up.
        full = await pair.receiver.reserve("r5", NUM_BLOCKS * 4, wait_s=0.0, kv_timeout_s=1.0)
        with pytest.raises(ResourceExhausted):
            await pair.receiver.reserve("r6", 1, wait_s=0.05, kv_timeout_s=1.0)
        pair.receiver.kv_failed(KVFailed("r5", terminal=True))
        await pair.receiver.wait(full)
        pair.receiver.finish(full)  # not admitted, terminal: released at once
        assert pair.dec.num_free_blocks == NUM_BLOCKS

    asyncio.run(scenario())


def test_link_health_names_unreachable_and_unauthenticated_peers(pair) -> None:
    async def scenario() -> None:
        assert await pair.sender.check_peer(pair.dec_agent.address, 5.0) == ("ok", "")
        with pdkv.Agent("handoff-wrong-secret", secret="not-" + SECRET) as stranger:
            stranger_address = stranger.address
            kind, error = await pair.sender.check_peer(stranger_address, 5.0)
        assert kind == "auth" and error.startswith("AuthFailed"), error
        res = Reservation((0,), "127.0.0.1:1", "nobody", 4, (0,))
        h, first, req = pair.prefill("r7", [5, 6, 7], _params(), res)
        loop = asyncio.get_running_loop()
        result = await pair.sender.push(req, h, first, with_kv=True, deadline=loop.time() + 3, posted=[])
        pair.sender.finish("r7", h, [])
        assert not result.ok and not result.posted, result
        links = pair.sender.links()
        assert links["127.0.0.1:1"]["transport_errors"] == 1 and links["127.0.0.1:1"]["ok"] is False
        assert links[stranger_address]["auth_failures"] == 1
        assert links[pair.dec_agent.address]["ok"] is True

    asyncio.run(scenario())
    assert pair.pre.num_free_blocks == NUM_BLOCKS


def test_the_handoff_needs_no_aiohttp() -> None:
    code = ("import sys; sys.modules['aiohttp'] = None; import pdkv.serving.handoff as h; "
            "assert 'aiohttp' not in [m for m in sys.modules if sys.modules[m] is not None]; print(h.KVSender)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
