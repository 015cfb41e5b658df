"""Layer-wise streaming of a prefill request's KV to its decode worker
(:class:`LayerStreamer`, the engine's layer sink; docs/streaming.md). Used by
:class:`pdkv.serving.handoff.KVSender`."""

from __future__ import annotations

import threading
import time
from typing import Sequence

import pdkv
from pdkv.errors import InvalidArgument, PdkvError

from .kv_pull import push_span
from .protocol import PrefillRequest

__all__ = ["LayerStreamer"]


class LayerStreamer:
    """Streams one prefill request's KV to its decode worker layer by layer: the
    engine's :data:`~pdkv.serving.engine.LayerSink` for that request.

    Each step that computes part of the prompt (the whole prompt, or one chunk of a
    chunked prefill) opens a stream over the blocks that step completes -- those not
    shipped before whose every token is computed once it ends, plus, in the step that
    ends the prompt, the last partial block -- and posts each layer as soon as the
    engine wrote it. Every block is streamed exactly once, by the step that completed
    it, so chunks never write the same remote block. A chunk that completes no block
    streams nothing (its tokens go with the chunk that completes their block). A chunk's
    stream is closed (without a notification) after its last layer; the last chunk's
    stream stays open for :meth:`close`, which KVSender calls only after every earlier
    chunk's stream landed, so the decode side's notification comes after every chunk's
    every layer. With block sizes that differ between the two sides the plan counts
    tokens from the first block, so the whole prompt streams in the step that ends it.

    Blocks the decode worker holds already (``Reservation.cached_blocks``) are never
    streamed, and the first step may start past token 0 (the prefill worker's own
    prefix cache held the tokens before it); blocks between the two go with that step.

    Errors never reach the forward: the streamer records them (and cancels its streams)
    and :meth:`KVSender.push` falls back to one ordinary write. A prefill that starts
    over (the engine preempted and recomputes it) is such an error.

    Parameters
    ----------
    agent : pdkv.Agent
    peer : str
        The decode worker's agent, already connected.
    req : PrefillRequest
    deadline : float
        ``time.monotonic()`` by which the KV must have landed.
    plan : pdkv.PlanOptions or None
        The write's plan (``num_tokens`` when the block sizes differ); None: block for block.
    block_tokens : int
        Tokens per block of the prefill engine's pool.
    """

    def __init__(self, agent: pdkv.Agent, peer: str, req: PrefillRequest, *, deadline: float,
                 plan: pdkv.PlanOptions | None, block_tokens: int) -> None:
        self.agent = agent
        self.peer = peer
        self.req = req
        self.deadline = deadline
        self.plan = plan
        self.block_tokens = block_tokens
        self.per_chunk = plan is None  # block for block: a chunk's blocks map one to one
        self.streams: list[pdkv.StreamingWrite] = []  # in chunk order; all but the last closed
        self.opened_at: list[float] = []  # time.monotonic() right before each stream's open
        self.error: PdkvError | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self._step: tuple[int, int] | None = None  # (token_start, token_end) of the step being streamed
        self._step_stream: pdkv.StreamingWrite | None = None  # its stream, None when it completed no block
        self._next_token: int | None = None  # where the next step must start (None: the first may start anywhere)
        self._shipped: tuple[int, ...] = ()  # local blocks given to a stream (or held by decode) so far
        self._last_seen = False  # the step ending the prompt began
        self.span = push_span(req, block_tokens)  # what decode lacks: (local block, remote block, tokens)

    @property
    def stream(self) -> pdkv.StreamingWrite | None:
        """The stream :meth:`close` finishes (the last chunk's), once opened."""
        return self.streams[-1] if self._last_seen and self.streams else None

    def __call__(self, layer: int, token_start: int, token_end: int, block_ids: tuple) -> None:
        last = token_end >= len(self.req.prompt)
        if not (last or self.per_chunk):
            return  # the plan covers the whole prompt: stream it in the step that ends it
        with self._lock:
            if self._cancelled or self.error is not None:
                return
            try:
                if (token_start, token_end) != self._step:
                    self._begin_step(token_start, token_end, tuple(block_ids), last)
                s = self._step_stream
                if s is not None:
                    s.post_layers(layer)
                    if not last and s.layers_posted == s.num_layers:
                        s.close()  # its bytes land meanwhile; KVSender waits for them
            except PdkvError as e:
                self.error = e
                self._cancel_locked()

    def _begin_step(self, token_start: int, token_end: int, block_ids: tuple, last: bool) -> None:
        """Opens the stream of a step's completed blocks (lock held)."""
        if self._next_token is not None and (token_start != self._next_token or self._last_seen
                                             or block_ids[:len(self._shipped)] != self._shipped):
            raise InvalidArgument(f"prefill of {self.req.rid} started over at token {token_start} "
                                  f"(expected {self._next_token}): its blocks changed under the stream")
        self._step, self._next_token, self._last_seen = (token_start, token_end), token_end, last
        self._step_stream = None
        if not self.per_chunk:
            local_first, remote_first, _ = self.span
            dst = self.req.dst
            if remote_first < len(dst.blocks):
                self._step_stream = self._open(block_ids[local_first:], dst.blocks[remote_first:],
                                               dst.generations[remote_first:])
        else:
            bt = self.block_tokens
            end = -(-token_end // bt) if last else token_end // bt
            first = max(len(self._shipped), self.span[0])  # decode holds the blocks before span[0]
            if end > first:
                dst = self.req.dst
                self._step_stream = self._open(block_ids[first:end], dst.blocks[first:end],
                                               dst.generations[first:end])
                self._shipped = block_ids[:end]
        if self._step_stream is not None:
            self.streams.append(self._step_stream)

    def _open(self, local: Sequence[int], remote: Sequence[int], generations: Sequence[int]) -> pdkv.StreamingWrite:
        self.opened_at.append(time.monotonic())
        return self.agent.open_stream(self.peer, pdkv.Blocks("kv", local),
                                      pdkv.Blocks("kv", remote, generations=list(generations) or None), plan=self.plan,
                                      timeout=max(self.deadline - time.monotonic(), 0.001))

    @property
    def usable(self) -> bool:
        """Every step of the prompt streamed every layer without an error: :meth:`close`
        may finish it (after :attr:`earlier` landed)."""
        with self._lock:
            s = self.stream
            return (self.error is None and not self._cancelled and s is not None
                    and all(x.layers_posted == x.num_layers for x in self.streams))

    @property
    def earlier(self) -> list[pdkv.Transfer]:
        """The earlier chunks' (closed) streams, to wait for before :meth:`close`."""
        return [x.transfer for x in self.streams[:-1]]

    @property
    def transfers(self) -> list[pdkv.Transfer]:
        """Every stream opened, as transfers, in chunk order."""
        return [x.transfer for x in self.streams]

    def timings(self) -> tuple[float, float, float]:
        """``(span, tail, wire)`` seconds of the streams once the last one is done:
        span from the first stream's open to the last one's completion (it overlaps the
        prefill), tail from the prefill's end (the later of the post of the prompt's last
        layer and the close with the first token) to that completion, and
        the time their batches were on the wire (summed over a chunked prefill's streams,
        at most the span)."""
        last = self.streams[-1]  # usable: every open succeeded, one opened_at per stream
        span = self.opened_at[-1] + last.transfer.elapsed - self.opened_at[0]
        wire = min(sum(x.wire_seconds for x in self.streams), span)
        return span, min(last.tail_seconds, span), wire

    def close(self, notify: bytes) -> pdkv.Transfer:
        """Closes the last chunk's stream with the hand-off's notification; returns its
        transfer. Call it only once :attr:`earlier` are done."""
        assert self.stream is not None
        return self.stream.close(notify=notify)

    def cancel(self) -> list[pdkv.Transfer]:
        """Stops streaming (nothing more is posted; unfinished streams are cancelled);
        returns the transfers of every stream opened, to wait for before the blocks are
        released."""
        with self._lock:
            self._cancelled = True
            self._cancel_locked()
            return self.transfers

    def _cancel_locked(self) -> None:
        for s in self.streams:
            if not s.done:
                s.cancel()  # a closed stream in flight too: its notification (if any) is never sent
