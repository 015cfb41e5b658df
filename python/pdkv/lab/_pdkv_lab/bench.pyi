"""
ceilings for `pdkv bench transfer`
"""
from __future__ import annotations
import collections.abc
import typing
__all__: list[str] = ['Sink', 'memcpy_extents', 'pingpong', 'stream']
class Sink:
    def __init__(self, host: str, port: typing.SupportsInt | typing.SupportsIndex = 0, buf_bytes: typing.SupportsInt | typing.SupportsIndex = 67108864) -> None:
        ...
    def stop(self) -> None:
        ...
    @property
    def port(self) -> int:
        ...
def memcpy_extents(extents: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex]], iters: typing.SupportsInt | typing.SupportsIndex = 1) -> float:
    ...
def pingpong(host: str, port: typing.SupportsInt | typing.SupportsIndex, bytes: typing.SupportsInt | typing.SupportsIndex, iters: typing.SupportsInt | typing.SupportsIndex, warmup: typing.SupportsInt | typing.SupportsIndex = 20, congestion: str = '') -> list[float]:
    ...
def stream(host: str, port: typing.SupportsInt | typing.SupportsIndex, conns: typing.SupportsInt | typing.SupportsIndex, total: typing.SupportsInt | typing.SupportsIndex, msg_bytes: typing.SupportsInt | typing.SupportsIndex, tuned: bool, rcvlowat: typing.SupportsInt | typing.SupportsIndex = 1048576, congestion: str = '') -> float:
    ...
