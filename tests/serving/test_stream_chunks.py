"""Chunked prefill streams per chunk (:class:`pdkv.serving.handoff.LayerStreamer`): each
chunk's layers go out as that chunk's K/V are written, over the blocks the chunk
completed; the decode side's notification comes only after every chunk's every layer
landed (bit-exact KV at the moment it is delivered); decoded tokens equal
``model.generate``; a decode peer gone mid-stream fails the hand-off cleanly (the
decode side then recomputes, as for any failed transfer)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import pdkv  # noqa: E402
from pdkv.serving.engine import Engine, EngineConfig  # noqa: E402
from pdkv.serving.kv_pool import PagedKVPool  # noqa: E402
from pdkv.serving.protocol import KVReady, PrefillRequest  # noqa: E402
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from test_handoff import NUM_BLOCKS, PROMPT, SECRET, Pair, _params, streamed_prefill  # noqa: E402

BLOCK_TOKENS = 4  # Pair's


class ChunkedPair(Pair):
    """Pair whose prefill engine computes at most ``chunk`` prompt tokens per step."""

    def __init__(self, tm, chunk: int) -> None:
        self.chunk = chunk
        super().__init__(tm)

    def _engine(self, agent: pdkv.Agent, order: list[int]) -> Engine:
        if agent is not self.pre_agent:
            return super()._engine(agent, order)
        param = next(self.tm.model.parameters())
        geometry = pdkv.KVGeometry.from_hf_config(self.tm.model.config, num_blocks=NUM_BLOCKS,
                                                  block_tokens=BLOCK_TOKENS, dtype=param.dtype)
        pool = PagedKVPool.shared(agent, geometry, block_order=order)
        return Engine(self.tm.model, EngineConfig(num_blocks=NUM_BLOCKS, block_tokens=BLOCK_TOKENS, mode="chunked",
                                                  max_batch_tokens=self.chunk, max_num_seqs=2, num_threads=1),
                      pool=pool)


def expected_streams(prompt_len: int, chunk: int) -> list[tuple[int, int]]:
    """Block ranges [first, end) of the streams: each chunk's completed blocks."""
    out, shipped = [], 0
    for start in range(0, prompt_len, chunk):
        end_tok = min(start + chunk, prompt_len)
        end = -(-end_tok // BLOCK_TOKENS) if end_tok == prompt_len else end_tok // BLOCK_TOKENS
        if end > shipped:
            out.append((shipped, end))
            shipped = end
    return out


def blocks_equal(pair: Pair, src: list[int], dst: list[int]) -> bool:
    a = pair.pre.pool.storage[:, :, list(src)]
    b = pair.dec.pool.storage[:, :, list(dst)]
    return bool(torch.equal(a, b))


@pytest.mark.parametrize("chunk", [3, 6, 8, 64], ids=lambda c: f"chunk{c}")
def test_each_chunk_streams_its_blocks_and_the_notification_comes_last(chunk: int) -> None:
    from tinylm import tiny_model

    pair = ChunkedPair(tiny_model("llama_gqa"), chunk)
    prompt, ref = list(pair.tm.prompts[PROMPT]), pair.tm.refs[PROMPT]
    at_delivery: list[bool] = []
    closed_after: list[bool] = []

    async def scenario() -> None:
        listening = asyncio.ensure_future(pair.receiver.run_notifications())
        try:
            t = await pair.receiver.reserve("c1", len(prompt), wait_s=1.0, kv_timeout_s=10.0)
            deliver = pair.receiver.deliver

            def checked_deliver(data: bytes, peer: str = "") -> bool:
                # The moment the decode side learns the KV is ready: every block must be there.
                at_delivery.append(blocks_equal(pair, h.block_ids, list(t.blocks)))
                return deliver(data, peer)

            pair.receiver.deliver = checked_deliver
            h, first, req, streamer, steps = await streamed_prefill(pair, "c1", prompt, t.reservation)
            assert steps == -(-len(prompt) // chunk)
            ranges = expected_streams(len(prompt), chunk)
            assert len(streamer.streams) == len(ranges)
            for s, (a, b) in zip(streamer.streams, ranges):
                assert s.layer_bytes * s.num_layers == s.transfer.bytes_total
                assert s.transfer.bytes_total == (b - a) * streamer.streams[-1].transfer.bytes_total // (
                    ranges[-1][1] - ranges[-1][0]), (a, b)
            assert all(s.closed for s in streamer.streams[:-1]) and not streamer.streams[-1].closed
            assert streamer.usable
            close = streamer.close

            def checked_close(notify: bytes):
                closed_after.append(all(x.done for x in streamer.earlier))
                return close(notify)

            streamer.close = checked_close
            posted: list = []
            loop = asyncio.get_running_loop()
            result = await pair.sender.push(req, h, first, with_kv=True, deadline=loop.time() + 10, posted=posted,
                                            streamer=streamer)
            assert result.ok and result.posted, result
            assert posted == streamer.transfers
            assert result.bytes == sum(x.bytes_total for x in posted)
            assert pair.sender.m_kv_streamed.value(("streamed",)) == 1
            assert pair.sender.m_kv_streamed.value(("monolithic",)) == 0
            arrival = await pair.receiver.wait(t)
            assert arrival.ready == KVReady("c1", first, h.seed)
            src = list(h.block_ids)
            pair.sender.finish("c1", h, posted, streamer)
            assert pair.pre.num_free_blocks == NUM_BLOCKS
            events: list = []
            hd = pair.receiver.admit(t, arrival, prompt, SamplingParams.of(_params()), events.append)
            pair.receiver.finish(t)
            assert [first] + pair.decode(hd, events) == ref and not hd.recomputed
            assert len(src) == len(t.blocks)
        finally:
            listening.cancel()

    try:
        asyncio.run(scenario())
        assert at_delivery == [True] and closed_after == [True]
        assert pair.dec.num_free_blocks == NUM_BLOCKS
    finally:
        pair.close()


def test_a_restarted_prefill_falls_back_to_one_write() -> None:
    """A step that does not continue where the last one ended (the engine recomputing a
    preempted prefill) stops streaming; the KV is then written at once, still exact."""
    from tinylm import tiny_model

    pair = ChunkedPair(tiny_model("llama_gqa"), 6)
    prompt, ref = list(pair.tm.prompts[PROMPT]), pair.tm.refs[PROMPT]

    async def scenario() -> None:
        listening = asyncio.ensure_future(pair.receiver.run_notifications())
        try:
            t = await pair.receiver.reserve("c2", len(prompt), wait_s=1.0, kv_timeout_s=10.0)
            h, first, req, streamer, _ = await streamed_prefill(pair, "c2", prompt, t.reservation)
            streamer(0, 0, 6, tuple(h.block_ids))  # "started over"
            assert isinstance(streamer.error, pdkv.InvalidArgument) and "started over" in str(streamer.error)
            assert not streamer.usable
            posted: list = []
            loop = asyncio.get_running_loop()
            result = await pair.sender.push(req, h, first, with_kv=True, deadline=loop.time() + 10, posted=posted,
                                            streamer=streamer)
            assert result.ok and result.posted, result
            assert pair.sender.m_kv_streamed.value(("monolithic",)) == 1
            assert all(x.done for x in posted)
            arrival = await pair.receiver.wait(t)
            assert blocks_equal(pair, list(h.block_ids), list(t.blocks))
            pair.sender.finish("c2", h, posted, streamer)
            events: list = []
            hd = pair.receiver.admit(t, arrival, prompt, SamplingParams.of(_params()), events.append)
            pair.receiver.finish(t)
            assert [first] + pair.decode(hd, events) == ref and not hd.recomputed
        finally:
            listening.cancel()

    try:
        asyncio.run(scenario())
    finally:
        pair.close()


def test_a_decode_peer_gone_mid_stream_fails_the_handoff_cleanly() -> None:
    """The decode side's agent closes after the first chunk streamed: later chunks cannot
    be sent, the push reports the failure (no exception), nothing stays in flight and
    every prefill block is released -- the decode worker recomputes, as for any failed
    transfer (test_handoff.py)."""
    from tinylm import tiny_model

    pair = ChunkedPair(tiny_model("llama_gqa"), 8)
    prompt = list(pair.tm.prompts[PROMPT])
    peer_agent = pdkv.Agent("chunk-decode-doomed", secret=SECRET)
    geometry = pdkv.KVGeometry.from_hf_config(pair.tm.model.config, num_blocks=NUM_BLOCKS,
                                              block_tokens=BLOCK_TOKENS, dtype=next(pair.tm.model.parameters()).dtype)
    PagedKVPool.shared(peer_agent, geometry)
    peer_address = peer_agent.address

    async def scenario() -> None:
        from pdkv.serving.protocol import Reservation

        res = Reservation(agent=peer_address, name="chunk-decode-doomed", block_tokens=BLOCK_TOKENS,
                          blocks=tuple(range(6)), generations=tuple(peer_agent.generations("kv", list(range(6)))))
        req = PrefillRequest("c3", tuple(prompt), _params(), res, 10.0)
        loop = asyncio.get_running_loop()
        streamer = await pair.sender.layer_streamer(req, loop.time() + 10)
        assert streamer is not None
        steps: list[int] = []

        def sink(layer: int, start: int, end: int, blocks: tuple) -> None:
            if start > 0 and not steps:
                steps.append(start)
                peer_agent.close()  # the decode worker dies between chunks
            streamer(layer, start, end, blocks)

        events: list = []
        h = pair.pre.add_request("c3", prompt, SamplingParams.of(_params()), on_event=events.append, prefill_only=True,
                                 layer_sink=sink)
        pair.pre.run_until_idle()
        [ev] = events
        assert steps == [8] and streamer.streams and not streamer.usable  # the first chunk had streamed
        posted: list = []
        result = await pair.sender.push(req, h, ev.token_id, with_kv=True, deadline=loop.time() + 5,
                                        posted=posted, streamer=streamer)
        assert not result.ok, result
        assert result.error.split(":")[0] in ("PeerConnectionError", "TransferTimeout", "StalePeer"), result
        pair.sender.finish("c3", h, posted, streamer)
        for x in posted:
            with contextlib.suppress(pdkv.PdkvError):
                x.wait(10.0)
        await asyncio.sleep(0.05)  # the background release
        assert all(x.done for x in posted) and all(x.done for x in streamer.transfers)
        assert pair.sender.links()[peer_address]["ok"] is False

    try:
        asyncio.run(scenario())
        assert pair.pre.num_free_blocks == NUM_BLOCKS
    finally:
        pair.close()
