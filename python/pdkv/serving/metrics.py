"""Counters, gauges and histograms of the proxy's and the workers' ``/metrics``, on
``prometheus_client`` (its registry and standard text exposition).

A thin facade keeps the serving code's calling convention: label values are given per
observation as a tuple matching the metric's ``labelnames``, and a metric may read its
series at scrape time from a callback (:meth:`Counter.set_function`,
:meth:`Gauge.set_function`). Each :class:`Registry` is its own
``prometheus_client.CollectorRegistry`` (several servers may share a process).
``*_created`` series are not exported.

Thread safety: every method may be called from any thread (prometheus_client's locks).

Example
-------
>>> reg = Registry()
>>> ttft = reg.histogram("pdkv_ttft_seconds", "Time to first token.", buckets=(0.1, 1.0))
>>> done = reg.counter("pdkv_requests_total", "Finished requests.", ("status",))
>>> ttft.observe(0.05); done.inc(("ok",))
>>> print(reg.render())
# HELP pdkv_ttft_seconds Time to first token.
# TYPE pdkv_ttft_seconds histogram
pdkv_ttft_seconds_bucket{le="0.1"} 1.0
pdkv_ttft_seconds_bucket{le="1.0"} 1.0
pdkv_ttft_seconds_bucket{le="+Inf"} 1.0
pdkv_ttft_seconds_count 1.0
pdkv_ttft_seconds_sum 0.05
# HELP pdkv_requests_total Finished requests.
# TYPE pdkv_requests_total counter
pdkv_requests_total{status="ok"} 1.0
<BLANKLINE>
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any, Callable, Iterable, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdkv.errors import AlreadyExists, InvalidArgument

__all__ = ["CONTENT_TYPE", "Counter", "Gauge", "Histogram", "LATENCY_BUCKETS", "Registry"]

#: Content type of the exposition (prometheus_client's).
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

#: Default latency buckets in seconds (1 ms to 2 min).
LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                                      0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0, 120.0)

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

prometheus_client.disable_created_metrics()

LabelValues = tuple[str, ...]


class _Metric:
    kind = ""

    def __init__(self, registry: "Registry", name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        if not _NAME.match(name):
            raise InvalidArgument(f"invalid metric name {name!r}")
        for ln in labelnames:
            if not _LABEL.match(ln) or ln == "le" or ln.startswith("__"):
                raise InvalidArgument(f"invalid label name {ln!r} for metric {name!r}")
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._registry = registry
        self._fn: Callable[[], Iterable[tuple[Sequence[str], float]]] | None = None
        self._prom: Any = None

    def _key(self, labels: Sequence[str] | None) -> LabelValues:
        key = tuple(str(v) for v in (labels or ()))
        if len(key) != len(self.labelnames):
            raise InvalidArgument(f"metric {self.name!r} takes labels {self.labelnames}, got {key}")
        return key

    def _child(self, labels: Sequence[str] | None) -> Any:
        key = self._key(labels)
        return self._prom.labels(*key) if self.labelnames else self._prom

    def _sample(self, suffix: str, labels: Sequence[str] | None) -> float:
        want = dict(zip(self.labelnames, self._key(labels)))
        for fam in self._collect():
            for s in fam.samples:
                if s.name == self.name + suffix and {k: v for k, v in s.labels.items() if k != "le"} == want \
                        and "le" not in s.labels:
                    return float(s.value)
        return 0.0

    def _collect(self) -> Iterable[Any]:
        return self._prom.collect() if self._prom is not None else self.collect()

    # prometheus_client's collector protocol, used while the series come from a callback
    def collect(self) -> Iterable[Any]:
        assert self._fn is not None
        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        fam = cls(self.name, self.help, labels=self.labelnames)
        for key, v in self._fn():
            fam.add_metric(list(self._key(key)), float(v))
        return [fam]

    def describe(self) -> list[Any]:
        return []

    def set_function(self, fn: Callable[[], Iterable[tuple[Sequence[str], float]]]) -> None:
        """Reads the series from ``fn()`` (pairs of label values and value) at every scrape."""
        with self._registry._lock:
            if self._fn is None:
                self._registry.prom.unregister(self._prom)
                self._prom = None
                self._registry.prom.register(self)
            self._fn = fn


class Counter(_Metric):
    """A value that only goes up (``inc``), or is read at scrape time from a callback
    that returns a monotonic value (``set_function``). The name ends with ``_total``."""

    kind = "counter"

    def __init__(self, registry: "Registry", name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(registry, name, help_text, labelnames)
        self._prom = prometheus_client.Counter(name, help_text, self.labelnames, registry=registry.prom)

    def inc(self, labels: Sequence[str] | None = None, amount: float = 1.0) -> None:
        """Adds ``amount`` (>= 0) to the series ``labels``."""
        if amount < 0:
            raise InvalidArgument(f"counter {self.name!r} cannot decrease (inc by {amount})")
        self._child(labels).inc(amount)

    def value(self, labels: Sequence[str] | None = None) -> float:
        """The current value of a series (0 if never set)."""
        return self._sample("", labels)


class Gauge(_Metric):
    """A value that goes up and down (``set``/``inc``/``dec``), or is read at scrape time
    from a callback (``set_function``)."""

    kind = "gauge"

    def __init__(self, registry: "Registry", name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(registry, name, help_text, labelnames)
        self._prom = prometheus_client.Gauge(name, help_text, self.labelnames, registry=registry.prom)

    def set(self, value: float, labels: Sequence[str] | None = None) -> None:
        self._child(labels).set(float(value))

    def inc(self, labels: Sequence[str] | None = None, amount: float = 1.0) -> None:
        self._child(labels).inc(amount)

    def dec(self, labels: Sequence[str] | None = None, amount: float = 1.0) -> None:
        self._child(labels).dec(amount)

    def value(self, labels: Sequence[str] | None = None) -> float:
        """The current value of a series (0 if never set)."""
        return self._sample("", labels)

    def clear(self) -> None:
        """Forgets every labelled series."""
        if self.labelnames and self._prom is not None:
            self._prom.clear()
        elif self._prom is not None:
            self._prom.set(0)


class Histogram(_Metric):
    """Observations counted in cumulative buckets, plus their sum and count.

    Parameters
    ----------
    buckets : sequence of float
        Upper bounds, increasing; ``+Inf`` is added.
    """

    kind = "histogram"

    def __init__(self, registry: "Registry", name: str, help_text: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(registry, name, help_text, labelnames)
        b = [float(x) for x in buckets]
        if not b or any(x >= y for x, y in zip(b, b[1:])) or any(math.isnan(x) for x in b):
            raise InvalidArgument(f"histogram {name!r} needs increasing buckets, got {list(buckets)}")
        if math.isinf(b[-1]):
            b.pop()
        self.buckets = tuple(b)
        self._prom = prometheus_client.Histogram(name, help_text, self.labelnames, registry=registry.prom,
                                                 buckets=self.buckets)

    def observe(self, value: float, labels: Sequence[str] | None = None) -> None:
        """Records one observation (NaN is ignored)."""
        v = float(value)
        if math.isnan(v):
            return
        self._child(labels).observe(v)

    def count(self, labels: Sequence[str] | None = None) -> int:
        """Observations recorded in a series."""
        return int(self._sample("_count", labels))

    def sum(self, labels: Sequence[str] | None = None) -> float:
        """Sum of a series' observations."""
        return self._sample("_sum", labels)

    def set_function(self, fn: Callable[[], Iterable[tuple[Sequence[str], float]]]) -> None:
        raise InvalidArgument("a histogram cannot read its series from a callback")


class Registry:
    """The metrics of one server, rendered together (a ``prometheus_client``
    ``CollectorRegistry``)."""

    def __init__(self) -> None:
        self.prom = CollectorRegistry(auto_describe=False)
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def _claim(self, name: str) -> None:
        with self._lock:
            if name in self._names:
                raise AlreadyExists(f"metric {name!r} is registered already")
            self._names.add(name)

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        """Creates and registers a :class:`Counter` (``name`` must end with ``_total``)."""
        if not name.endswith("_total"):
            raise InvalidArgument(f"a counter's name ends with _total, got {name!r}")
        self._claim(name)
        return Counter(self, name, help_text, labelnames)

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
        """Creates and registers a :class:`Gauge`."""
        self._claim(name)
        return Gauge(self, name, help_text, labelnames)

    def histogram(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        """Creates and registers a :class:`Histogram`."""
        self._claim(name)
        return Histogram(self, name, help_text, labelnames, buckets)

    def render(self) -> str:
        """Every metric in prometheus_client's text exposition (ends with a newline)."""
        return generate_latest(self.prom).decode()
