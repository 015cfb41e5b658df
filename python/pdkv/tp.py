"""Tensor-parallel mapping: which peer ranks and head ranges feed each rank.

Prefill and decode may run with different tensor parallelism. Each rank's KV pool
holds only its share of the model's KV heads, so moving one request's KV means one
transfer per (prefill rank, decode rank) pair that shares heads, each moving a head
range that starts at a different offset in each pool. :class:`TPMapping` works those
out, so the caller never computes an offset by hand:

>>> from pdkv.tp import TPMapping
>>> m = TPMapping(prefill_tp=2, decode_tp=4, kv_heads=8)
>>> [str(t) for t in m.transfers(side="decode", rank=1, mode="pull")]
['read from prefill rank 0: local heads [0, 2) <- remote heads [2, 4) (global 2..3)']
>>> m.transfers(side="decode", rank=1, mode="pull")[0].plan()
PlanOptions(num_tokens=0, num_heads=2, local_head_offset=0, remote_head_offset=2, first_layer=0, num_layers=0)

Head ownership follows the engines (vLLM, SGLang): with ``tp <= kv_heads`` rank
``r`` holds heads ``[r * kv_heads / tp, (r + 1) * kv_heads / tp)`` (``kv_heads``
must divide evenly); with ``tp > kv_heads`` (GQA) every head is replicated on
``tp / kv_heads`` consecutive ranks and rank ``r`` holds head ``r // (tp / kv_heads)``
(``tp`` must be a multiple of ``kv_heads``).

A decode rank takes each of its heads from exactly one prefill rank that holds it.
When several prefill ranks hold a replica, the choice is deterministic and spreads
the load: the (head, decode holder) pairs are numbered ``head * decode_replicas +
j`` (``j``: which of the head's decode holders) and dealt round-robin over the
head's prefill replicas. Push and pull use the same choice, so a push never writes
a head twice into one decode rank.

Offsets are always from the point of view of the rank that asked: ``local_heads``
index its own pool, ``remote_heads`` the peer's. In a push the prefill rank is local;
in a pull the decode rank is. :meth:`TPTransfer.plan` hands them to
:meth:`pdkv.Agent.write` / :meth:`~pdkv.Agent.read` as the :class:`~pdkv.PlanOptions`
head fields.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import transfer as _xfer
from .errors import InvalidArgument

if TYPE_CHECKING:
    from ._pdkv import Blocks, PlanOptions, XferOptions

__all__ = ["HeadRange", "TPMapping", "TPTransfer", "heads_of_rank"]

SIDES = ("prefill", "decode")
MODES = ("push", "pull")


@dataclass(frozen=True)
class HeadRange:
    """``count`` consecutive heads starting at ``start`` (in some pool's numbering)."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __str__(self) -> str:
        return f"[{self.start}, {self.stop})"


@dataclass(frozen=True)
class TPTransfer:
    """One transfer between this rank and one peer rank.

    Attributes
    ----------
    op : {"write", "read"}
        What the initiating rank calls: a push is a ``write`` by the prefill rank, a
        pull a ``read`` by the decode rank.
    initiator : bool
        Whether *this* rank issues it. A decode rank in push mode (or a prefill rank
        in pull mode) gets the list of transfers its peers will issue, for
        bookkeeping (e.g. how many notifications to expect); :meth:`plan` refuses them.
    peer_side, peer_rank : str, int
        The other rank.
    local_heads, remote_heads : HeadRange
        The heads moved, as offsets into this rank's pool and the peer's pool.
    global_heads : HeadRange
        The same heads in the model's numbering.
    """

    op: str
    initiator: bool
    peer_side: str
    peer_rank: int
    local_heads: HeadRange
    remote_heads: HeadRange
    global_heads: HeadRange
    local_whole: bool  # local_heads cover this rank's whole pool
    remote_whole: bool  # remote_heads cover the peer's whole pool

    @property
    def num_heads(self) -> int:
        return self.local_heads.count

    def plan(self, base: PlanOptions | None = None) -> PlanOptions:
        """The :class:`~pdkv.PlanOptions` of this rank's transfer: a copy of ``base``
        (tokens, layers; None: the defaults) with this transfer's ``num_heads``,
        ``local_head_offset`` and ``remote_head_offset``.

        When the range is both pools' whole head set, all three are 0 ("all heads"),
        so equal geometries keep the planner's block-per-block path.
        """
        if not self.initiator:
            raise InvalidArgument(f"this rank does not issue the {self.op} with {self.peer_side} rank "
                                  f"{self.peer_rank}: that rank does (ask the mapping from its side)")
        plan = copy.copy(_xfer.plan_options(base))
        whole = self.local_whole and self.remote_whole
        plan.num_heads = 0 if whole else self.num_heads
        plan.local_head_offset = 0 if whole else self.local_heads.start
        plan.remote_head_offset = 0 if whole else self.remote_heads.start
        return plan

    def prepare(self, agent: Any, peer: str, local: Blocks, remote: Blocks | None = None, *,
                plan: PlanOptions | None = None, options: XferOptions | None = None) -> Any:
        """``agent.prepare(self.op, peer, local, remote, plan=self.plan(plan),
        options=options)``; ``peer`` is the agent's name for :attr:`peer_rank`."""
        return agent.prepare(self.op, peer, local, remote, plan=self.plan(plan), options=options)

    def submit(self, agent: Any, peer: str, local: Blocks, remote: Blocks | None = None, *,
               plan: PlanOptions | None = None, options: XferOptions | None = None,
               notify: bytes | str | None = None, timeout: float | None = None) -> Any:
        """Starts it: ``agent.write(...)`` or ``agent.read(...)`` with :meth:`plan`
        (``plan``: the tokens and layers to move besides the heads)."""
        call = agent.write if self.op == "write" else agent.read
        return call(peer, local, remote, plan=self.plan(plan), options=options, notify=notify, timeout=timeout)

    def __str__(self) -> str:
        arrow = "->" if self.peer_side == "decode" else "<-"  # the way the bytes flow
        how = ("to" if self.op == "write" else "from") if self.initiator else "by"
        return (f"{self.op} {how} {self.peer_side} rank {self.peer_rank}: local heads {self.local_heads} {arrow} "
                f"remote heads {self.remote_heads} (global {self.global_heads.start}..{self.global_heads.stop - 1})")


def _integer(value: Any) -> int | None:
    """``value`` as an int if it is an integer (numpy integers too, bools not), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _positive(value: Any, name: str) -> int:
    v = _integer(value)
    if v is None or v <= 0:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
    return v


def _check_split(tp: int, kv_heads: int, name: str) -> None:
    if tp <= kv_heads and kv_heads % tp:
        raise InvalidArgument(f"{kv_heads} kv heads do not split evenly over {name}={tp}")
    if tp > kv_heads and tp % kv_heads:
        raise InvalidArgument(f"{name}={tp} exceeds the {kv_heads} kv heads and is not a multiple of them "
                              "(each head must be replicated on the same number of ranks)")


def heads_of_rank(tp: int, kv_heads: int, rank: int) -> HeadRange:
    """The global heads rank ``rank`` of a ``tp``-way group holds (see the module doc)."""
    if tp <= kv_heads:
        per = kv_heads // tp
        return HeadRange(rank * per, per)
    return HeadRange(rank // (tp // kv_heads), 1)


class TPMapping:
    """Which heads move between the ranks of a prefill and a decode TP group.

    Parameters
    ----------
    prefill_tp, decode_tp : int
        Tensor-parallel sizes of the two sides.
    kv_heads : int
        The model's total number of KV heads (before any split).

    Raises
    ------
    InvalidArgument
        Non-positive sizes, or a TP size the heads do not split over (see the module doc).
    """

    def __init__(self, prefill_tp: int, decode_tp: int, kv_heads: int) -> None:
        self.prefill_tp = _positive(prefill_tp, "prefill_tp")
        self.decode_tp = _positive(decode_tp, "decode_tp")
        self.kv_heads = _positive(kv_heads, "kv_heads")
        _check_split(self.prefill_tp, self.kv_heads, "prefill_tp")
        _check_split(self.decode_tp, self.kv_heads, "decode_tp")

    def __repr__(self) -> str:
        return f"TPMapping(prefill_tp={self.prefill_tp}, decode_tp={self.decode_tp}, kv_heads={self.kv_heads})"

    def tp(self, side: str) -> int:
        return self.prefill_tp if _side(side) == "prefill" else self.decode_tp

    def heads(self, side: str, rank: int) -> HeadRange:
        """Global heads held by ``rank`` of ``side``."""
        return heads_of_rank(self.tp(side), self.kv_heads, self._rank(side, rank))

    def holders(self, side: str, head: int) -> range:
        """The ranks of ``side`` that hold global ``head`` (several when replicated)."""
        tp = self.tp(side)
        if _integer(head) is None or not 0 <= head < self.kv_heads:
            raise InvalidArgument(f"head {head} out of range [0, {self.kv_heads})")
        if tp <= self.kv_heads:
            r = head // (self.kv_heads // tp)
            return range(r, r + 1)
        rep = tp // self.kv_heads
        return range(head * rep, (head + 1) * rep)

    def source(self, decode_rank: int, head: int) -> int:
        """The prefill rank that feeds global ``head`` to ``decode_rank`` (which must hold it)."""
        decode_rank = self._rank("decode", decode_rank)
        dec = self.holders("decode", head)
        if decode_rank not in dec:
            raise InvalidArgument(f"decode rank {decode_rank} does not hold head {head}")
        pre = self.holders("prefill", head)
        k = head * len(dec) + (decode_rank - dec.start)
        return pre.start + k % len(pre)

    def transfers(self, *, side: str, rank: int, mode: str) -> list[TPTransfer]:
        """The transfers between ``rank`` of ``side`` and its peers, for ``mode``.

        ``side="prefill", mode="push"``: the writes this prefill rank issues.
        ``side="decode", mode="pull"``: the reads this decode rank issues.
        The other two combinations list the transfers the peers issue towards this
        rank (``initiator=False``). Ordered by peer rank, then head.
        """
        side = _side(side)
        if mode not in MODES:
            raise InvalidArgument(f"mode must be 'push' or 'pull', got {mode!r}")
        rank = self._rank(side, rank)
        op = "write" if mode == "push" else "read"
        initiator = (side == "prefill") == (mode == "push")
        peer_side = "decode" if side == "prefill" else "prefill"
        pairs = self._pairs_of(side, rank)  # (peer rank, global head)
        out = []
        for peer, run in _runs(sorted(pairs)):
            mine, theirs = self.heads(side, rank), self.heads(peer_side, peer)
            local = HeadRange(run.start - mine.start, run.count)
            remote = HeadRange(run.start - theirs.start, run.count)
            out.append(TPTransfer(op, initiator, peer_side, peer, local, remote, run,
                                  run.count == mine.count, run.count == theirs.count))
        return out

    def _pairs_of(self, side: str, rank: int) -> list[tuple[int, int]]:
        """(peer rank, head) for every head this rank sends (prefill) or receives (decode)."""
        if side == "decode":
            return [(self.source(rank, h), h) for h in self.heads("decode", rank)]
        return [(d, h) for h in self.heads("prefill", rank) for d in self.holders("decode", h)
                if self.source(d, h) == rank]

    def _rank(self, side: str, rank: Any) -> int:
        tp = self.tp(side)
        r = _integer(rank)
        if r is None or not 0 <= r < tp:
            raise InvalidArgument(f"{side} rank {rank!r} out of range [0, {tp})")
        return r


def _side(side: Any) -> str:
    if side not in SIDES:
        raise InvalidArgument(f"side must be 'prefill' or 'decode', got {side!r}")
    return side


def _runs(pairs: list[tuple[int, int]]):
    """Sorted (peer, head) pairs -> (peer, HeadRange) runs of consecutive heads."""
    i = 0
    while i < len(pairs):
        peer, first = pairs[i]
        j = i + 1
        while j < len(pairs) and pairs[j] == (peer, first + (j - i)):
            j += 1
        yield peer, HeadRange(first, j - i)
        i = j
