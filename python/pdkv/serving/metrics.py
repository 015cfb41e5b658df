"""Counters, gauges and histograms exposed in the Prometheus text format (version 0.0.4).

A small, dependency-free subset of what ``prometheus_client`` offers: enough for the
proxy's and the workers' ``/metrics``. Label values are given per observation as a
tuple matching the metric's ``labelnames``.

Thread safety: every method may be called from any thread (one lock per metric).

Example
-------
>>> reg = Registry()
>>> ttft = reg.histogram("pdkv_ttft_seconds", "Time to first token.", buckets=(0.1, 1.0))
>>> done = reg.counter("pdkv_requests_total", "Finished requests.", ("status",))
>>> ttft.observe(0.05); done.inc(("ok",))
>>> print(reg.render())
# HELP pdkv_ttft_seconds Time to first token.
# TYPE pdkv_ttft_seconds histogram
pdkv_ttft_seconds_bucket{le="0.1"} 1
pdkv_ttft_seconds_bucket{le="1"} 1
pdkv_ttft_seconds_bucket{le="+Inf"} 1
pdkv_ttft_seconds_sum 0.05
pdkv_ttft_seconds_count 1
# HELP pdkv_requests_total Finished requests.
# TYPE pdkv_requests_total counter
pdkv_requests_total{status="ok"} 1
<BLANKLINE>
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from typing import Callable, Iterable, Sequence

from pdkv.errors import AlreadyExists, InvalidArgument

__all__ = ["CONTENT_TYPE", "Counter", "Gauge", "Histogram", "LATENCY_BUCKETS", "Registry"]

#: Content type of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Default latency buckets in seconds (1 ms to 2 min).
LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                                      0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0, 120.0)

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

LabelValues = tuple[str, ...]


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        if not _NAME.match(name):
            raise InvalidArgument(f"invalid metric name {name!r}")
        for ln in labelnames:
            if not _LABEL.match(ln) or ln == "le":
                raise InvalidArgument(f"invalid label name {ln!r} for metric {name!r}")
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: Sequence[str] | None) -> LabelValues:
        key = tuple(str(v) for v in (labels or ()))
        if len(key) != len(self.labelnames):
            raise InvalidArgument(f"metric {self.name!r} takes labels {self.labelnames}, got {key}")
        return key

    def _header(self) -> list[str]:
        help_text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {help_text}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class _ValueMetric(_Metric):
    """A value per label set, kept here or read at render time from a callback."""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self._values: dict[LabelValues, float] = {} if labelnames else {(): 0.0}
        self._fn: Callable[[], Iterable[tuple[Sequence[str], float]]] | None = None

    def set_function(self, fn: Callable[[], Iterable[tuple[Sequence[str], float]]]) -> None:
        """Reads the series from ``fn()`` (pairs of label values and value) at every render."""
        self._fn = fn

    def _add(self, labels: Sequence[str] | None, amount: float) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, labels: Sequence[str] | None = None) -> float:
        """The current value of a series (0 if never set)."""
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        if self._fn is not None:
            items = sorted((self._key(k), float(v)) for k, v in self._fn())
        else:
            with self._lock:
                items = sorted(self._values.items())
        return self._header() + [f"{self.name}{_labels(self.labelnames, k)} {_fmt(v)}" for k, v in items]


class Counter(_ValueMetric):
    """A value that only goes up (``inc``), or is read at render time from a callback
    that returns a monotonic value (``set_function``); rendered as ``name{labels} value``."""

    kind = "counter"

    def inc(self, labels: Sequence[str] | None = None, amount: float = 1.0) -> None:
        """Adds ``amount`` (>= 0) to the series ``labels``."""
        if amount < 0:
            raise InvalidArgument(f"counter {self.name!r} cannot decrease (inc by {amount})")
        self._add(labels, amount)


class Gauge(_ValueMetric):
    """A value that goes up and down (``set``/``inc``/``dec``), or is read at render time
    from a callback (``set_function``)."""

    kind = "gauge"

    def set(self, value: float, labels: Sequence[str] | None = None) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, labels: Sequence[str] | None = None, amount: float = 1.0) -> None:
        self._add(labels, amount)

    def dec(self, labels: Sequence[str] | None = None, amount: float = 1.0) -> None:
        self._add(labels, -amount)

    def clear(self) -> None:
        """Forgets every labelled series."""
        with self._lock:
            self._values = {} if self.labelnames else {(): 0.0}


class Histogram(_Metric):
    """Observations counted in cumulative buckets, plus their sum and count.

    Parameters
    ----------
    buckets : sequence of float
        Upper bounds, increasing; ``+Inf`` is added.
    """

    kind = "histogram"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(name, help_text, labelnames)
        b = [float(x) for x in buckets]
        if not b or any(x >= y for x, y in zip(b, b[1:])) or any(math.isnan(x) for x in b):
            raise InvalidArgument(f"histogram {name!r} needs increasing buckets, got {list(buckets)}")
        if math.isinf(b[-1]):
            b.pop()
        self.buckets = tuple(b)
        self._series: dict[LabelValues, list[float]] = {}  # counts per bucket + [+Inf, sum]

    def observe(self, value: float, labels: Sequence[str] | None = None) -> None:
        """Records one observation (NaN is ignored)."""
        v = float(value)
        if math.isnan(v):
            return
        key = self._key(labels)
        i = bisect.bisect_left(self.buckets, v)
        with self._lock:
            s = self._series.get(key)
            if s is None:
                s = self._series[key] = [0.0] * (len(self.buckets) + 2)
            s[i] += 1
            s[-1] += v

    def count(self, labels: Sequence[str] | None = None) -> int:
        """Observations recorded in a series."""
        with self._lock:
            s = self._series.get(self._key(labels))
            return 0 if s is None else int(sum(s[:-1]))

    def sum(self, labels: Sequence[str] | None = None) -> float:
        """Sum of a series' observations."""
        with self._lock:
            s = self._series.get(self._key(labels))
            return 0.0 if s is None else s[-1]

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._series.items())
        if not items and not self.labelnames:
            items = [((), [0.0] * (len(self.buckets) + 2))]
        out = self._header()
        for key, s in items:
            acc = 0.0
            for ub, c in zip(self.buckets + (math.inf,), s[:-1]):
                acc += c
                le = 'le="' + _fmt(ub) + '"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {_fmt(acc)}")
            lab = _labels(self.labelnames, key)
            out.append(f"{self.name}_sum{lab} {_fmt(s[-1])}")
            out.append(f"{self.name}_count{lab} {_fmt(acc)}")
        return out


class Registry:
    """An ordered set of metrics rendered together."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def _add(self, metric: _Metric) -> _Metric:
        with self._lock:
            if metric.name in self._metrics:
                raise AlreadyExists(f"metric {metric.name!r} is registered already")
            self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        """Creates and registers a :class:`Counter`."""
        return self._add(Counter(name, help_text, labelnames))  # type: ignore[return-value]

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
        """Creates and registers a :class:`Gauge`."""
        return self._add(Gauge(name, help_text, labelnames))  # type: ignore[return-value]

    def histogram(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        """Creates and registers a :class:`Histogram`."""
        return self._add(Histogram(name, help_text, labelnames, buckets))  # type: ignore[return-value]

    def render(self) -> str:
        """Every metric in the text exposition format (ends with a newline)."""
        with self._lock:
            metrics = list(self._metrics.values())
        lines: list[str] = []
        for m in metrics:
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
