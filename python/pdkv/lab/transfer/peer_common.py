"""What both sides of a peer-library benchmark share: the :class:`Workload`, the
:class:`PeerFailed` error and the JSON-lines :class:`Channel` between the caller and its
children (see :mod:`pdkv.lab.transfer.peers`)."""

from __future__ import annotations

import json
import select
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdkv.errors import InvalidArgument, PdkvError

__all__ = ["Channel", "PeerFailed", "Workload"]


class PeerFailed(PdkvError):
    """A peer library (NIXL, Mooncake) failed during a benchmark; the message says where."""

    code = "PeerFailed"


@dataclass(frozen=True)
class Workload:
    """One transfer workload, identical for pdkv and every peer library.

    Parameters
    ----------
    block_bytes : int
        Bytes per block, e.g. 32768: one K or V block-half of llama-3-8b
        (16 tokens x 8 kv heads x 128 head dim x bf16).
    num_blocks : int
        Blocks written per iteration; the payload is ``block_bytes * num_blocks`` and both
        pools are exactly that big.
    iters : int
        Timed repetitions of the whole batch (one untimed warm-up runs first).
    seed : int
        Seeds the destination permutation and the source bytes (:meth:`permutation`,
        :meth:`source_pool`).
    lat_iters : int
        Single-block (``block_bytes``) writes, each waited on, for p50/p99 latency.
    """

    block_bytes: int
    num_blocks: int
    iters: int
    seed: int
    lat_iters: int

    def __post_init__(self) -> None:
        if self.block_bytes <= 0 or self.num_blocks <= 0:
            raise InvalidArgument(
                f"Workload needs block_bytes > 0 and num_blocks > 0, got "
                f"block_bytes={self.block_bytes}, num_blocks={self.num_blocks}"
            )
        if self.iters <= 0 or self.lat_iters < 0:
            raise InvalidArgument(
                f"Workload needs iters > 0 and lat_iters >= 0, got iters={self.iters}, "
                f"lat_iters={self.lat_iters}"
            )

    @property
    def payload_bytes(self) -> int:
        """Bytes moved per iteration (= the size of each pool)."""
        return self.block_bytes * self.num_blocks

    def permutation(self) -> np.ndarray:
        """Destination block of each source block: ``[num_blocks]`` int64.

        Source block ``i`` is written to destination block ``perm[i]``. A seeded random
        permutation, so (up to the odd accidental neighbour) no two consecutive source
        blocks land next to each other and no library can coalesce them.
        """
        return np.random.default_rng([self.seed, 0]).permutation(self.num_blocks)

    def source_pool(self) -> np.ndarray:
        """The initiator's pool: ``[num_blocks * block_bytes]`` uint8 of seeded random bytes."""
        raw = np.random.default_rng([self.seed, 1]).bytes(self.payload_bytes)
        return np.frombuffer(raw, dtype=np.uint8).copy()  # writable, owned

    def latency_blocks(self) -> np.ndarray:
        """Source block of each single-block latency write: ``[lat_iters]`` int64."""
        return np.arange(self.lat_iters, dtype=np.int64) % self.num_blocks

    def default_timeout_s(self) -> float:
        """A generous deadline for one whole run (start-up, transfers, verification)."""
        moved = self.payload_bytes * (self.iters + 1) + self.block_bytes * self.lat_iters
        # 60 s of start-up and verification slack, then at least 20 MB/s and 2 ms/write.
        return 60.0 + moved / 20e6 + self.lat_iters * 2e-3



class Channel:
    """JSON lines over a stream socket, every receive with a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = b""

    def send(self, obj: dict[str, Any]) -> None:
        self._sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, deadline: float | None) -> dict[str, Any] | None:
        """The next message; ``None`` at EOF. Raises ``TimeoutError`` past ``deadline``."""
        while b"\n" not in self._buf:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
            else:
                self._sock.settimeout(None)
            try:
                chunk = self._sock.recv(1 << 16)
            except socket.timeout:
                raise TimeoutError from None
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def readable(self, timeout: float) -> bool:
        """Whether a message (or EOF) is waiting, after at most ``timeout`` seconds."""
        if b"\n" in self._buf:
            return True
        return bool(select.select([self._sock], [], [], timeout)[0])

    def close(self) -> None:
        self._sock.close()

