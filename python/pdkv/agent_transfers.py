"""The transfer half of :class:`pdkv.Agent`: preparing and posting transfers
(``prepare``, ``write``, ``read``, ``open_stream``, ``notify``) and receiving
notifications. A mixin: the agent owns the state it uses (``_n``, the native agent;
``_max_notif_bytes``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

from . import _native, _validate
from . import transfer as _xfer
from .errors import InvalidArgument, NotFound, OutOfRange
from .transfer import PreparedTransfer, StreamingWrite, Transfer

if TYPE_CHECKING:
    from ._pdkv import Blocks, PlanOptions, StreamOptions, XferOptions

__all__ = ["Notification"]


@dataclass(frozen=True)
class Notification:
    """A notification from ``peer``, queued after every byte of its transfer landed."""

    peer: str
    data: bytes


class AgentTransfers:
    """Transfers and notifications of an :class:`~pdkv.Agent` (see there)."""

    _n: Any
    _max_notif_bytes: int

    # ------------------------------------------------------------------ transfers
    def _op(self, op: str):
        m = _native.module().OpKind
        if not isinstance(op, str):
            raise InvalidArgument(f"op must be 'write' or 'read', got {type(op).__name__} {op!r}")
        if op == "write":
            return m.WRITE
        if op == "read":
            return m.READ
        raise InvalidArgument(f"op must be 'write' or 'read', got {op!r}")

    def prepare(self, op: str, peer: str, local: Blocks, remote: Blocks | None = None, *,
                plan: PlanOptions | None = None, options: XferOptions | None = None) -> PreparedTransfer:
        """Validates and lays out a block transfer once; ``.post()`` it many times.

        Parameters
        ----------
        op : {"write", "read"}
            ``"write"`` pushes local blocks into the peer's; ``"read"`` pulls the peer's
            blocks into local ones.
        peer : str
            A name returned by :meth:`add_peer` / :meth:`connect`.
        local : Blocks
            Blocks of one of this agent's layouts: ``pdkv.Blocks("kv", [0, 1, 2])``.
        remote : Blocks, optional
            Blocks of one of the peer's layouts, position i of ``local.ids`` mapped to
            position i of ``remote.ids`` (None: the same layout name and ids). The
            destination side (remote for a write, local for a read) must not name a
            block twice. ``remote.generations``, the generations the peer handed out
            with the ids (see :meth:`generations`), make every post have the peer check
            them before any byte lands (write) or is sent (read): a block freed or
            reused since (the peer called :meth:`bump_generations`) fails the transfer
            with :class:`StaleBlock` from ``wait()``, with nothing transferred and no
            notification delivered. tcp and shm only (NotSupported elsewhere). The
            local side carries no generations (InvalidArgument).
        plan : PlanOptions, optional
            For layouts of different shape (block size, NHD/HND, TP head split) and for
            a range of layers: ``num_tokens``, ``num_heads``, ``local_head_offset``,
            ``remote_head_offset``, ``first_layer``, ``num_layers``. 0 means "all",
            which is accepted only when both block lists hold the same number of tokens
            and both layouts the same number of kv heads: a plan never moves part of
            the data unless asked to. A layer range beyond the layouts' layers raises
            :class:`OutOfRange`. None: everything.
        options : XferOptions, optional
            ``transport`` forces one (it must reach the peer). ``compress`` (``"off"``,
            ``"lossless"``, ``"fp8"``, ``"auto"``) is how this transfer's payload travels
            on a tcp wire, overriding the agent's ``TcpOptions.compress.mode`` for this
            transfer only (its codec, dtype and FP8 grouping apply as they are);
            ``"fp8"`` (or ``"auto"`` with policy ``"lossy-allowed"``) allows lossy KV for
            this transfer. Reads ask the peer for compressed responses (a peer that
            cannot answer them sends plain). Other transports move the bytes exactly.
            See docs/compression.md.

        Raises
        ------
        InvalidArgument, OutOfRange, NotFound
            Caller errors only (arguments, block ids beyond the peer's metadata,
            mismatched geometries, unknown peer or layout). Faults of the peer itself
            surface from the transfer's ``wait()`` (docs/faults.md).
        """
        opk = self._op(op)
        peer = _validate.text(peer, "peer")
        local, remote = _xfer.sides(local, remote)
        native = self._n.prepare_blocks(peer, opk, local, remote, _xfer.plan_options(plan),
                                        _xfer.xfer_options(options))
        return PreparedTransfer(self, native)

    def prepare_extents(self, op: str, peer: str, extents: Sequence[tuple[int, int, int, int, int]], *,
                        options: XferOptions | None = None) -> PreparedTransfer:
        """Raw form: ``(local_region_id, local_offset, remote_region_id, remote_offset,
        nbytes)`` tuples of non-negative integers (remote ids from :meth:`peer_info`).
        ``options`` as :meth:`prepare`."""
        opk = self._op(op)
        peer = _validate.text(peer, "peer")
        rows = _validate.extents(extents)
        return PreparedTransfer(self, self._n.prepare_extents(peer, opk, rows, _xfer.xfer_options(options)))

    def write(self, peer: str, local: Blocks, remote: Blocks | None = None, *, plan: PlanOptions | None = None,
              options: XferOptions | None = None, notify: bytes | str | None = None,
              timeout: float | None = None) -> Transfer:
        """Pushes local blocks into the peer's blocks; returns at once. See :meth:`prepare`
        (the blocks, ``plan``, ``options``) and :meth:`PreparedTransfer.post` (``notify``,
        ``timeout``)."""
        self._check_post_args(notify, timeout)  # caller errors first, before any peer work
        return self.prepare("write", peer, local, remote, plan=plan, options=options).post(notify=notify,
                                                                                             timeout=timeout)

    def _check_post_args(self, notify: Any, timeout: Any) -> None:
        _validate.notification(notify, self._max_notif_bytes)
        _validate.timeout(timeout)

    def read(self, peer: str, local: Blocks, remote: Blocks | None = None, *, plan: PlanOptions | None = None,
             options: XferOptions | None = None, notify: bytes | str | None = None,
             timeout: float | None = None) -> Transfer:
        """Pulls the peer's blocks into local blocks; ``notify`` reaches the peer once
        every byte has landed here. See :meth:`prepare`; with ``options.compress`` the
        peer encodes its responses and this agent decodes them."""
        self._check_post_args(notify, timeout)
        return self.prepare("read", peer, local, remote, plan=plan, options=options).post(notify=notify,
                                                                                            timeout=timeout)

    def open_stream(self, peer: str, local: Blocks, remote: Blocks | None = None, *,
                    plan: PlanOptions | None = None, options: XferOptions | None = None,
                    stream: StreamOptions | None = None, notify: bytes | str | None = None,
                    timeout: float | None = None) -> StreamingWrite:
        """Opens a layer-wise streaming write of local blocks into the peer's blocks.

        The same write as :meth:`write`, but its layers are sent as the caller posts
        them (:meth:`StreamingWrite.post_layers`), so computing later layers overlaps
        sending earlier ones; the notification reaches the peer after the last layer
        landed. See docs/streaming.md.

        Parameters
        ----------
        peer, local, remote, options
            As :meth:`prepare`.
        plan : PlanOptions, optional
            As :meth:`prepare`, applied to every layer; ``first_layer`` and
            ``num_layers`` are the layers the stream carries (``num_layers`` 0: through
            the last layer).
        stream : StreamOptions, optional
            How layers are batched: ``min_batch_bytes`` (posted layers holding fewer
            bytes wait for more, or for close), ``max_inflight_batches`` (most transfers
            of this stream in flight; layers posted meanwhile leave together when one
            completes) and ``progress_prefix`` (when given, every batch also delivers
            the notification ``progress_prefix + b"<first>-<end>"``, its layer range,
            once it landed, for a receiver that starts on early layers).
        notify : bytes or str, optional
            Delivered once every layer landed (``close(notify=...)`` may replace it).
        timeout : float, optional
            Seconds (finite, > 0) for the whole stream, from now to the notification's
            delivery (None: the agent's ``default_timeout``).

        Raises
        ------
        InvalidArgument, OutOfRange, NotFound
            As :meth:`prepare`, checked now on the first layer, before anything is sent.
        """
        notif = _validate.notification(notify, self._max_notif_bytes)
        tmo = _validate.timeout(timeout)
        peer = _validate.text(peer, "peer")
        local, remote = _xfer.sides(local, remote)
        native = _native.module().open_stream(self._n, peer, local, remote, _xfer.plan_options(plan),
                                              _xfer.xfer_options(options), notif, -1.0 if tmo is None else tmo,
                                              _xfer.stream_options(stream))
        return StreamingWrite(native, self._max_notif_bytes)

    def notify(self, peer: str, data: bytes | str, *, timeout: float | None = None) -> Transfer:
        """Sends a notification alone (ordered after earlier transfers on the same connection)."""
        data = _validate.notification(data, self._max_notif_bytes, "data")
        if not data:
            raise InvalidArgument("notification data is empty")
        tmo = _validate.timeout(timeout)
        peer = _validate.text(peer, "peer")
        return Transfer(self._n.send_notification(peer, data, -1.0 if tmo is None else tmo))

    # ------------------------------------------------------------------ notifications
    def get_notifications(self, max_count: int = 0) -> list[Notification]:
        """Takes queued notifications without blocking (``max_count=0``: all)."""
        return [Notification(p, d) for p, d in self._n.take_notifications(_validate.count(max_count, "max_count"))]

    def wait_notifications(self, timeout: float | None = None, max_count: int = 0) -> list[Notification]:
        """Blocks (without spinning) until at least one notification is queued or
        ``timeout`` passes; returns them (possibly empty on timeout)."""
        timeout = _validate.wait_timeout(timeout)
        return [Notification(p, d) for p, d in self._n.wait_notifications(-1.0 if timeout is None else timeout,
                                                                         _validate.count(max_count, "max_count"))]

    @property
    def notifications_unacknowledged(self) -> int:
        """Notifications this agent sent whose transfers completed when they were sent
        (``ShmOptions(notify_on_send=True)``) and that the peer then never acknowledged
        (its connection closed, or the transfer's deadline passed, first): the peer may
        not have received them. Monotonic; each is also logged (docs/api.md,
        "Notifications")."""
        return self._n.notifications_unacknowledged

    @property
    def notification_fd(self) -> int:
        """An eventfd readable exactly while notifications are queued (for select/epoll)."""
        return self._n.notification_fd

    async def notifications(self) -> AsyncIterator[Notification]:
        """Async iterator over incoming notifications (uses :attr:`notification_fd`)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(self.notification_fd, ready.set)
        try:
            while True:
                batch = self.get_notifications()
                for n in batch:
                    yield n
                if not batch:
                    # The fd is level-triggered: a notification that lands after the
                    # take above makes the reader fire on the next loop iteration.
                    ready.clear()
                    await ready.wait()
        finally:
            loop.remove_reader(self.notification_fd)
