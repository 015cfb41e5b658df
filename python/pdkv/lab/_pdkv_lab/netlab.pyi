"""
the delay line of `pdkv netlab` (kernels without sch_netem)
"""
from __future__ import annotations
import collections.abc
import typing
__all__: list[str] = ['DelayLine']
class DelayLine:
    """
    netlab's userspace delay line (python -m pdkv.lab.netlab.delay runs it)
    """
    def __init__(self, links: collections.abc.Sequence[str], one_way_delay_s: typing.SupportsFloat | typing.SupportsIndex, queue_limit_bytes: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def counters(self) -> list:
        ...
    def run(self, stop_fd: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def taps(self) -> list[str]:
        ...
