"""What a transfer is given and what it returns.

Given: the blocks on each side (:class:`Blocks`) and typed options, bound from the
C++ structs (pdkv/agent.h, kv_layout.h, stream.h) by cpp/bindings/py_blocks.cc and
py_options.cc: keyword constructors that validate at once (InvalidArgument naming the
field), typed attributes, equality, repr and pickling.

* :class:`Blocks` ``(layout, ids, *, generations=None)`` — one side of a block
  transfer; the remote side's ``generations`` are checked at every post.
* :class:`PlanOptions` — what to move of layouts of different shape (tokens, heads,
  head offsets) and which layers.
* :class:`XferOptions` — how it travels (``transport``, ``compress``).
* :class:`StreamOptions` — how a layer-wise stream batches its layers.

Returned: :class:`Transfer` (posted), :class:`PreparedTransfer` (validated and laid
out once, posted many times) and :class:`StreamingWrite` (layer-wise).

The native classes are looked up on first use (module ``__getattr__``), so
``import pdkv`` still loads no native code.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import TYPE_CHECKING, Any, Generator, Protocol

from . import _native, _validate
from .errors import InvalidArgument, PdkvError, error_class
from .xfer_state import XferState, from_native as _state

if TYPE_CHECKING:  # the classes as the stubs (python/pdkv/_pdkv.pyi) describe them
    from ._pdkv import Blocks, PlanOptions, StreamOptions, XferOptions

__all__ = ["Blocks", "PlanOptions", "XferOptions", "StreamOptions", "Transfer", "PreparedTransfer",
           "StreamingWrite"]

_NATIVE_CLASSES = ("Blocks", "PlanOptions", "XferOptions", "StreamOptions")


def __getattr__(name: str) -> Any:
    if name in _NATIVE_CLASSES:
        return getattr(_native.module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- checking a call's arguments
# One default instance of each options class, made on first use: the native calls take
# them by const reference and nothing here changes them.
_DEFAULTS: dict[str, Any] = {}


def _typed(value: Any, cls_name: str, what: str) -> Any:
    cls = getattr(_native.module(), cls_name)
    if value is None:
        d = _DEFAULTS.get(cls_name)
        if d is None:
            d = _DEFAULTS[cls_name] = cls()
        return d
    if not isinstance(value, cls):
        raise InvalidArgument(f"{what} must be a pdkv.{cls_name} or None, got {type(value).__name__} "
                              f"{value!r:.60}")
    return value


def sides(local: Any, remote: Any) -> tuple[Blocks, Blocks]:
    """``(local, remote)`` of a block transfer: both :class:`Blocks`; ``remote`` None is
    the same layout name and ids at the peer."""
    cls = _native.module().Blocks
    if not isinstance(local, cls):
        raise InvalidArgument(f"local must be a pdkv.Blocks (pdkv.Blocks(layout, ids)), got "
                              f"{type(local).__name__} {local!r:.60}")
    if remote is None:
        return local, local
    if not isinstance(remote, cls):
        raise InvalidArgument(f"remote must be a pdkv.Blocks (pdkv.Blocks(layout, ids)) or None, got "
                              f"{type(remote).__name__} {remote!r:.60}")
    return local, remote


def plan_options(value: Any) -> PlanOptions:
    """``plan=``: a :class:`PlanOptions`, or None for the defaults (move everything)."""
    return _typed(value, "PlanOptions", "plan")


def xfer_options(value: Any) -> XferOptions:
    """``options=``: an :class:`XferOptions`, or None for the defaults."""
    return _typed(value, "XferOptions", "options")


def stream_options(value: Any) -> StreamOptions:
    """``stream=``: a :class:`StreamOptions`, or None for the defaults."""
    return _typed(value, "StreamOptions", "stream")


# ---------------------------------------------------------------- posted transfers
_NATIVE_DONE: list = []
_NATIVE_PENDING: list = []


def _native_states():
    if not _NATIVE_DONE:
        m = _native.module().XferState
        _NATIVE_DONE.append(m.DONE)
        _NATIVE_PENDING.append(m.PENDING)
    return _NATIVE_DONE[0], _NATIVE_PENDING[0]


# The options classes are the native ones (cpp/bindings/py_options.cc): typed
# attributes named and documented once, in each transport's C++ header; keyword-only


class Transfer:
    """A posted transfer. Completes asynchronously in native threads.

    A ``wait`` timeout does not cancel it: keep the memory alive until
    :attr:`done` (deregistration waits for it anyway).
    """

    __slots__ = ("_n",)

    def __init__(self, native: Any) -> None:
        self._n = native

    id = property(lambda self: self._n.id)
    peer = property(lambda self: self._n.peer, doc="Peer name.")
    transport = property(lambda self: self._n.transport, doc="Transport carrying it ('tcp', ...).")
    bytes_total = property(lambda self: self._n.bytes_total)
    bytes_done = property(lambda self: self._n.bytes_done, doc="Bytes confirmed landed so far.")
    elapsed = property(lambda self: self._n.elapsed_s, doc="Seconds from post to completion (0 while pending).")
    compression = property(lambda self: self._n.compression,
                           doc="Codec that compressed this write, or this read's responses, on the wire "
                               "('zstd', 'lz4', 'fp8'; '' = none).")
    wire_bytes = property(lambda self: self._n.wire_bytes,
                          doc="Payload bytes on the wire for it: sent (write) or received (read); the "
                              "compressed size when compressed; tcp only.")

    @property
    def state(self) -> XferState:
        return _state(self._n.state)

    @property
    def done(self) -> bool:
        """True once terminal (done, failed or cancelled)."""
        return self.state is not XferState.PENDING

    @property
    def error(self) -> PdkvError | None:
        """The failure as an exception (None while pending or when done)."""
        info = self._n.error_info()
        if info is None:
            return None
        return error_class(info[0])(info[1])

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until terminal or ``timeout`` seconds pass.

        Returns
        -------
        bool
            True when the transfer completed, False if still pending at the timeout.

        Raises
        ------
        PdkvError
            The transfer's error if it failed (:class:`~pdkv.errors.Cancelled` if cancelled).
        """
        done, pending = _native_states()
        timeout = _validate.wait_timeout(timeout)
        state = self._n.wait(-1.0 if timeout is None else timeout)  # the XferState members themselves
        if state is done:
            return True
        if state is pending:
            return False
        raise self.error  # type: ignore[misc]

    def cancel(self) -> None:
        """Drops the parts not yet on the wire; the state becomes CANCELLED unless all
        bytes were already sent (then it completes normally)."""
        self._n.cancel()

    async def wait_async(self, timeout: float | None = None) -> bool:
        """``await``-able :meth:`wait`: same result, same errors, and no thread.

        The running event loop is woken through one eventfd when the transfer ends
        (:class:`_LoopCompletions`). Cancelling the awaiting task stops the wait only,
        never the transfer (use :meth:`cancel` for that).
        """
        timeout = _validate.wait_timeout(timeout)
        if not self.done and timeout != 0:
            loop = asyncio.get_running_loop()
            completions = _LoopCompletions.of(loop)
            ticket, finished = completions.watch(loop, self._n)
            try:
                if timeout is None:
                    await finished
                else:
                    await asyncio.wait((finished,), timeout=timeout)
            finally:  # done, timed out or cancelled: nothing of this wait stays behind
                completions.forget(loop, ticket)
        return self.wait(0)

    def __await__(self) -> Generator[Any, None, bool]:
        """``await transfer`` is ``await transfer.wait_async()`` (no timeout)."""
        return self.wait_async().__await__()

    def __repr__(self) -> str:
        return (f"Transfer(id={self.id}, peer={self.peer!r}, {self.state.value}, "
                f"{self.bytes_done}/{self.bytes_total} bytes)")


class _LoopCompletions:
    """Resolves the futures of transfers awaited on one event loop.

    A native ``CompletionQueue`` gives each watched transfer a ticket and makes its
    eventfd readable when transfers end (the C++ thread that completes a transfer
    pushes the ticket: no GIL, no Python thread). The loop reads the fd
    (``add_reader``) only while some transfer is awaited.
    """

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopCompletions]" = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        # No reference to the loop here (it keys the WeakKeyDictionary above), and none
        # through a future once every wait has ended (Transfer.wait_async forgets them).
        self._queue = _native.module().CompletionQueue()
        self._waiting: dict[int, asyncio.Future] = {}

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_LoopCompletions":
        lc = cls._by_loop.get(loop)
        if lc is None:
            lc = cls._by_loop[loop] = cls()
        return lc

    def watch(self, loop: asyncio.AbstractEventLoop, native_transfer: Any) -> tuple[int, asyncio.Future]:
        """(ticket, future of ``loop`` resolved with None once the transfer is terminal);
        :meth:`forget` the ticket when the wait ends, however it ends."""
        if not self._waiting:
            loop.add_reader(self._queue.fd, self._resolve_finished)
        ticket = self._queue.watch(native_transfer)
        self._waiting[ticket] = fut = loop.create_future()
        return ticket, fut

    def forget(self, loop: asyncio.AbstractEventLoop, ticket: int) -> None:
        # A ticket that comes later (the wait timed out or was cancelled) is skipped.
        self._waiting.pop(ticket, None)
        if not self._waiting:
            loop.remove_reader(self._queue.fd)

    def _resolve_finished(self) -> None:
        for ticket in self._queue.take():
            fut = self._waiting.get(ticket)
            if fut is not None and not fut.done():
                fut.set_result(None)


class _Poster(Protocol):
    """The agent a prepared transfer posts on (what it uses of it)."""

    _n: Any  # the native agent
    _max_notif_bytes: int


class PreparedTransfer:
    """A transfer validated and laid out once (``Agent.prepare_*``); post it many times."""

    __slots__ = ("_agent", "_n")

    def __init__(self, agent: _Poster, native: Any) -> None:
        self._agent = agent
        self._n = native

    peer = property(lambda self: self._n.peer)
    transport = property(lambda self: self._n.transport)
    nbytes = property(lambda self: self._n.bytes)
    num_extents = property(lambda self: self._n.num_extents, doc="Extents after coalescing.")
    checked = property(lambda self: self._n.checked,
                       doc="Whether every post checks the peer's block generations (the remote "
                           ":class:`Blocks`' ``generations``).")

    def post(self, *, notify: bytes | str | None = None, timeout: float | None = None) -> Transfer:
        """Starts the transfer; returns at once.

        Parameters
        ----------
        notify : bytes or str, optional
            Delivered to the peer after every byte of this transfer has landed (at most
            the agent's ``max_notif_bytes``).
        timeout : float, optional
            Seconds (finite, > 0) until the transfer fails with TransferTimeout (None:
            the agent's ``default_timeout``).

        Faults of the peer (dead, unreachable, frozen, restarted) never raise here: the
        returned transfer fails and :meth:`Transfer.wait` raises them (docs/faults.md).
        """
        data = _validate.notification(notify, self._agent._max_notif_bytes)
        tmo = _validate.timeout(timeout)
        return Transfer(self._agent._n.post(self._n, data, -1.0 if tmo is None else tmo))

    def __repr__(self) -> str:
        return (f"PreparedTransfer(peer={self.peer!r}, transport={self.transport!r}, "
                f"{self.nbytes} bytes in {self.num_extents} extents)")


class StreamingWrite:
    """A layer-wise streaming write (:meth:`Agent.open_stream`), opened before the KV exists.

    Post layers as they become ready (:meth:`post_layers`); each ready range is planned
    and posted as an ordinary write (same routing, bounds checks, block generations and
    transports as :meth:`Agent.write`), adjacent layers that became ready while earlier
    ones were in flight leaving together. :meth:`close` declares the stream complete;
    the notification is sent once every layer has landed. The stream's state is a
    :class:`Transfer` (:attr:`transfer`): ``wait()``, ``await``, ``cancel()``, byte
    counts and errors work as for any transfer, with one deadline for the whole stream.
    Nothing here is on the data path: posting, batching and completion run in C++.

    Dropping the object before :meth:`close` cancels the stream. See docs/streaming.md.

    Examples
    --------
    >>> s = prefill.open_stream(peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", remote_ids),  # doctest: +SKIP
    ...                         notify=b"req-1")
    >>> for layer in range(num_layers):                                              # doctest: +SKIP
    ...     compute(layer); s.post_layers(layer)
    >>> s.close().wait(10.0)                                                          # doctest: +SKIP
    True
    """

    __slots__ = ("_n", "_t", "_max_notif_bytes")

    def __init__(self, native: Any, max_notif_bytes: int) -> None:
        self._n = native
        self._t = Transfer(native.transfer)
        self._max_notif_bytes = max_notif_bytes

    first_layer = property(lambda self: self._n.first_layer, doc="First layer of the stream.")
    num_layers = property(lambda self: self._n.num_layers, doc="Layers in the stream.")
    layer_bytes = property(lambda self: self._n.layer_bytes, doc="Bytes each layer moves.")
    layers_posted = property(lambda self: self._n.layers_posted, doc="Layers posted so far.")
    layers_landed = property(lambda self: self._n.layers_landed, doc="Layers whose bytes landed at the peer.")
    batches_posted = property(lambda self: self._n.batches_posted, doc="Transfers the layers were sent in.")
    wire_seconds = property(lambda self: self._n.wire_s,
                            doc="Seconds the stream had bytes on the wire: the union of its landed batches' "
                                "and its notification's transfers, post to completion each (<= the stream's "
                                "``elapsed``; grows as batches land).")
    tail_seconds = property(lambda self: self._n.tail_s,
                            doc="Seconds from the producer's last call (the later of the last layer's post "
                                "and :meth:`close`) to the stream's completion (the notification delivered): "
                                "what the stream adds once its producer is done; 0 until done.")
    closed = property(lambda self: self._n.closed, doc="Whether :meth:`close` was called.")

    @property
    def transfer(self) -> Transfer:
        """The stream as a :class:`Transfer` (``bytes_total`` = every layer's bytes)."""
        return self._t

    @property
    def state(self) -> XferState:
        return self._t.state

    @property
    def done(self) -> bool:
        """True once terminal (done, failed or cancelled)."""
        return self._t.done

    @property
    def error(self) -> PdkvError | None:
        """The failure as an exception (None while pending or when done)."""
        return self._t.error

    def post_layers(self, first: int, count: int = 1) -> None:
        """Marks layers ``[first, first + count)`` computed and sends them; returns at once.

        Raises
        ------
        OutOfRange
            Layers outside the stream's.
        InvalidArgument
            ``count`` 0, a layer posted twice, or the stream is closed.
        PdkvError
            The stream's own error once it failed (a batch failed, it timed out or was
            cancelled): later posts fail fast.
        """
        self._n.post_layers(_validate.count(first, "first"), _validate.count(count, "count"))

    def close(self, *, notify: bytes | str | None = None) -> Transfer:
        """Declares every layer posted; the notification goes out once all have landed.

        Parameters
        ----------
        notify : bytes or str, optional
            Replaces the notification given to :meth:`Agent.open_stream` (for a message
            known only at the end, e.g. the first sampled token).

        Returns
        -------
        Transfer
            :attr:`transfer`, to wait for.

        Raises
        ------
        InvalidArgument
            Layers never posted (named), or already closed. The stream stays open.
        PdkvError
            The stream's error once it failed.
        """
        data = None if notify is None else _validate.notification(notify, self._max_notif_bytes)
        self._n.close(data)
        return self._t

    def cancel(self) -> None:
        """Drops unsent layers, cancels batches in flight; no notification is sent."""
        self._n.cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """:meth:`Transfer.wait` of :attr:`transfer`."""
        return self._t.wait(timeout)

    async def wait_async(self, timeout: float | None = None) -> bool:
        """:meth:`Transfer.wait_async` of :attr:`transfer`."""
        return await self._t.wait_async(timeout)

    def __await__(self) -> Generator[Any, None, bool]:
        return self._t.wait_async().__await__()

    def __enter__(self) -> "StreamingWrite":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        """Leaving the block by an exception before :meth:`close` cancels the stream."""
        if exc_type is not None and not self.closed:
            self.cancel()

    def __repr__(self) -> str:
        return (f"StreamingWrite(peer={self._t.peer!r}, layers {self.first_layer}+{self.num_layers}, "
                f"posted={self.layers_posted}, landed={self.layers_landed}, {self.state.value})")
