"""The KV hand-off with layer-wise streaming (:class:`pdkv.serving.handoff.LayerStreamer`),
without HTTP: the prefill engine's layer sink streams the prompt into the decode
side's reservation while it computes; decoded tokens equal ``model.generate``; a
stream into blocks the decode side gave up on fails with StaleBlock (nothing lands)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from pdkv.serving.protocol import KVReady  # noqa: E402
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from test_handoff import NUM_BLOCKS, PROMPT, Pair, _params, streamed_prefill  # noqa: E402


@pytest.fixture
def pair():
    from tinylm import tiny_model

    p = Pair(tiny_model("llama_gqa"))
    try:
        yield p
    finally:
        p.close()


def test_streamed_kv_is_decoded_into_the_reference(pair) -> None:
    prompt, ref = list(pair.tm.prompts[PROMPT]), pair.tm.refs[PROMPT]

    async def scenario() -> None:
        listening = asyncio.ensure_future(pair.receiver.run_notifications())
        try:
            t = await pair.receiver.reserve("s1", len(prompt), wait_s=1.0, kv_timeout_s=10.0)
            h, first, req, streamer, _ = await streamed_prefill(pair, "s1", prompt, t.reservation)
            assert streamer.usable and streamer.stream.layers_posted == streamer.stream.num_layers
            posted: list = []
            loop = asyncio.get_running_loop()
            result = await pair.sender.push(req, h, first, with_kv=True, deadline=loop.time() + 10, posted=posted,
                                            streamer=streamer)
            assert result.ok and result.posted and result.bytes == streamer.stream.transfer.bytes_total, result
            assert posted == [streamer.stream.transfer]  # the stream is the push
            assert pair.sender.m_kv_streamed.value(("streamed",)) == 1
            assert pair.sender.m_kv_streamed.value(("monolithic",)) == 0
            pair.sender.finish("s1", h, posted, streamer)
            assert pair.pre.num_free_blocks == NUM_BLOCKS
            arrival = await pair.receiver.wait(t)
            assert arrival.ready == KVReady("s1", first, h.seed)
            events: list = []
            hd = pair.receiver.admit(t, arrival, prompt, SamplingParams.of(_params()), events.append)
            pair.receiver.finish(t)
            assert [first] + pair.decode(hd, events) == ref and not hd.recomputed
        finally:
            listening.cancel()

    asyncio.run(scenario())
    assert pair.dec.num_free_blocks == NUM_BLOCKS


def test_a_stream_into_abandoned_blocks_fails_with_stale_block(pair) -> None:
    prompt = list(pair.tm.prompts[PROMPT])

    async def scenario() -> None:
        t = await pair.receiver.reserve("s2", len(prompt), wait_s=1.0, kv_timeout_s=0.05)
        arrival = await pair.receiver.wait(t)  # times out: the blocks' generations are bumped
        assert arrival.reason == "kv_timeout" and pair.receiver.invalidated == 1
        pair.receiver.finish(t)
        h, first, req, streamer, _ = await streamed_prefill(pair, "s2", prompt, t.reservation)
        posted: list = []
        loop = asyncio.get_running_loop()
        result = await pair.sender.push(req, h, first, with_kv=True, deadline=loop.time() + 10, posted=posted,
                                        streamer=streamer)
        assert not result.ok and result.posted and result.error.startswith("StaleBlock"), result
        pair.sender.finish("s2", h, posted, streamer)
        await asyncio.sleep(0)  # the background release
        assert all(x.done for x in posted)

    asyncio.run(scenario())
    assert pair.pre.num_free_blocks == NUM_BLOCKS
