"""Length distributions and arrival processes of synthetic request traces.

A :class:`~pdkv.lab.serve.trace.TraceSpec` combines one arrival process
(:class:`Poisson`, bursty :class:`Gamma`, :class:`Periodic`) with two length
distributions (:class:`Fixed`, :class:`Uniform`, clipped :class:`LogNormal`,
:class:`Mixture`). Each has a compact string form (``parse_*``) for the command line
and a JSON form (``*_from_dict``) for result files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, Mapping, Tuple

import numpy as np

__all__ = [
    "ArrivalProcess",
    "Fixed",
    "Gamma",
    "LengthDist",
    "LogNormal",
    "Mixture",
    "Periodic",
    "Poisson",
    "Uniform",
    "arrival_from_dict",
    "length_dist_from_dict",
    "parse_arrival",
    "parse_length_dist",
]


def _norm_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


# --------------------------------------------------------------------------------------
# Length distributions
# --------------------------------------------------------------------------------------


class LengthDist:
    """A distribution of token counts (integers >= 1).

    Subclasses are frozen dataclasses; ``spec()`` returns the string that
    :func:`parse_length_dist` reads back, ``to_dict()`` the JSON form that
    :func:`length_dist_from_dict` reads back.
    """

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` lengths.

        Parameters
        ----------
        rng : numpy.random.Generator
            Source of randomness; consumed sequentially.
        n : int
            Number of values.

        Returns
        -------
        numpy.ndarray
            ``[n]`` int64, every value >= 1.
        """
        raise NotImplementedError

    def mean(self) -> float:
        """Exact expected value of :meth:`sample` (before integer rounding for continuous laws)."""
        raise NotImplementedError

    def spec(self) -> str:
        """The compact string form, e.g. ``"lognormal:128:0.5:16:512"``."""
        raise NotImplementedError

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form."""
        raise NotImplementedError


@dataclass(frozen=True)
class Fixed(LengthDist):
    """Always ``value`` tokens.

    Parameters
    ----------
    value : int
        Token count, >= 1.
    """

    value: int

    def __post_init__(self) -> None:
        if int(self.value) != self.value or self.value < 1:
            raise ValueError(f"Fixed length must be an integer >= 1, got {self.value!r}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        return np.full(n, self.value, dtype=np.int64)

    def mean(self) -> float:  # noqa: D102
        return float(self.value)

    def spec(self) -> str:  # noqa: D102
        return f"fixed:{self.value}"

    def to_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {"kind": "fixed", "value": self.value}


@dataclass(frozen=True)
class Uniform(LengthDist):
    """Integers uniform on ``[low, high]`` (both inclusive).

    Parameters
    ----------
    low, high : int
        Bounds, ``1 <= low <= high``.
    """

    low: int
    high: int

    def __post_init__(self) -> None:
        if not (1 <= self.low <= self.high):
            raise ValueError(f"Uniform needs 1 <= low <= high, got [{self.low}, {self.high}]")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)

    def mean(self) -> float:  # noqa: D102
        return (self.low + self.high) / 2.0

    def spec(self) -> str:  # noqa: D102
        return f"uniform:{self.low}:{self.high}"

    def to_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {"kind": "uniform", "low": self.low, "high": self.high}


@dataclass(frozen=True)
class LogNormal(LengthDist):
    """Log-normal lengths, rounded to integers and clipped to ``[min, max]``.

    ``log(X) ~ Normal(log(median), sigma**2)``; values outside the bounds are set to
    the bound (clipping, not resampling: the probability mass beyond ``max`` lands
    exactly on ``max``).

    Parameters
    ----------
    median : float
        Median of the unclipped law (tokens), > 0.
    sigma : float
        Standard deviation of ``log(X)``, >= 0. 0.25 is narrow, 1.0 is heavy-tailed.
    min, max : int
        Clipping bounds, ``1 <= min <= max``.
    """

    median: float
    sigma: float
    min: int
    max: int

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or not (1 <= self.min <= self.max):
            raise ValueError(f"bad LogNormal parameters: {self}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        x = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(x), self.min, self.max).astype(np.int64)

    def mean(self) -> float:  # noqa: D102
        a, b, mu, s = float(self.min), float(self.max), math.log(self.median), self.sigma
        if s == 0.0:
            return min(max(self.median, a), b)
        za, zb = (math.log(a) - mu) / s, (math.log(b) - mu) / s
        inner = math.exp(mu + s * s / 2) * (_norm_cdf(zb - s) - _norm_cdf(za - s))
        return a * _norm_cdf(za) + b * (1.0 - _norm_cdf(zb)) + inner

    def spec(self) -> str:  # noqa: D102
        return f"lognormal:{self.median:g}:{self.sigma:g}:{self.min}:{self.max}"

    def to_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {"kind": "lognormal", "median": self.median, "sigma": self.sigma, "min": self.min, "max": self.max}


@dataclass(frozen=True)
class Mixture(LengthDist):
    """Each length comes from component *i* with probability ``weights[i]``.

    Parameters
    ----------
    components : tuple of (float, LengthDist)
        ``(weight, dist)`` pairs; weights are > 0 and are normalised to sum to 1.

    Examples
    --------
    80% short, 20% long prompts:

    >>> round(Mixture(((0.8, Fixed(128)), (0.2, Fixed(1024)))).mean(), 1)
    307.2
    """

    components: Tuple[Tuple[float, LengthDist], ...]

    def __post_init__(self) -> None:
        if not self.components or any(w <= 0 for w, _ in self.components):
            raise ValueError("Mixture needs at least one component, every weight > 0")

    @property
    def weights(self) -> np.ndarray:
        """``[k]`` float64 normalised weights."""
        w = np.array([w for w, _ in self.components], dtype=np.float64)
        return w / w.sum()

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        which = rng.choice(len(self.components), size=n, p=self.weights)
        out = np.empty(n, dtype=np.int64)
        for i, (_, dist) in enumerate(self.components):
            values = dist.sample(rng, n)  # always n draws, so the stream position is fixed
            out[which == i] = values[which == i]
        return out

    def mean(self) -> float:  # noqa: D102
        return float(sum(w * d.mean() for w, (_, d) in zip(self.weights, self.components)))

    def spec(self) -> str:  # noqa: D102
        return "+".join(f"{w:g}*{d.spec()}" for w, d in self.components)

    def to_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {"kind": "mixture", "components": [{"weight": w, "dist": d.to_dict()} for w, d in self.components]}


def length_dist_from_dict(d: Mapping[str, Any]) -> LengthDist:
    """Rebuild a length distribution from :meth:`LengthDist.to_dict` output.

    Raises
    ------
    ValueError
        Unknown ``kind``.
    """
    kind = d.get("kind")
    if kind == "fixed":
        return Fixed(int(d["value"]))
    if kind == "uniform":
        return Uniform(int(d["low"]), int(d["high"]))
    if kind == "lognormal":
        return LogNormal(float(d["median"]), float(d["sigma"]), int(d["min"]), int(d["max"]))
    if kind == "mixture":
        return Mixture(tuple((float(c["weight"]), length_dist_from_dict(c["dist"])) for c in d["components"]))
    raise ValueError(f"unknown length distribution kind {kind!r}")


def parse_length_dist(spec: str) -> LengthDist:
    """Parse a length distribution from its compact string form.

    Parameters
    ----------
    spec : str
        One of ``"N"`` or ``"fixed:N"``; ``"uniform:LOW:HIGH"``;
        ``"lognormal:MEDIAN:SIGMA:MIN:MAX"``; or a mixture
        ``"W1*SPEC1+W2*SPEC2"`` such as ``"0.8*fixed:128+0.2*fixed:1024"``.

    Returns
    -------
    LengthDist

    Raises
    ------
    ValueError
        Malformed spec.
    """
    s = spec.strip()
    try:
        if "+" in s or "*" in s:
            parts = []
            for term in s.split("+"):
                w, _, sub = term.partition("*")
                if not sub:
                    raise ValueError("each mixture term is WEIGHT*SPEC")
                parts.append((float(w), parse_length_dist(sub)))
            return Mixture(tuple(parts))
        kind, _, rest = s.partition(":")
        args = rest.split(":") if rest else []
        if not rest and kind.isdigit():
            return Fixed(int(kind))
        if kind == "fixed" and len(args) == 1:
            return Fixed(int(args[0]))
        if kind == "uniform" and len(args) == 2:
            return Uniform(int(args[0]), int(args[1]))
        if kind == "lognormal" and len(args) == 4:
            return LogNormal(float(args[0]), float(args[1]), int(args[2]), int(args[3]))
    except ValueError as exc:
        raise ValueError(f"bad length distribution {spec!r}: {exc}") from None
    raise ValueError(
        f"bad length distribution {spec!r}: expected N, fixed:N, uniform:LO:HI, "
        "lognormal:MEDIAN:SIGMA:MIN:MAX or W*SPEC+W*SPEC"
    )


# --------------------------------------------------------------------------------------
# Arrival processes
# --------------------------------------------------------------------------------------


class ArrivalProcess:
    """Inter-arrival times: i.i.d. unit-mean gaps divided by ``rate`` (requests/s).

    The first request arrives at t = 0; request *i* at ``sum(gaps[:i]) / rate``.
    """

    rate: float
    #: Coefficient of variation of the gaps (std / mean): 0 periodic, 1 Poisson, > 1 bursty.
    cv: float

    def unit_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` gaps with mean 1 (seconds at rate 1).

        Returns
        -------
        numpy.ndarray
            ``[n]`` float64, >= 0.
        """
        raise NotImplementedError

    def with_rate(self, rate: float) -> "ArrivalProcess":
        """The same process at another mean rate (requests/s)."""
        return replace(self, rate=rate)  # type: ignore[type-var]

    def spec(self) -> str:
        """Compact string form read by :func:`parse_arrival` (without the rate)."""
        raise NotImplementedError

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form."""
        return {"kind": self.spec().split(":")[0], "rate": self.rate, "cv": self.cv}


def check_rate(rate: float) -> None:
    """Raises ``ValueError`` unless ``rate`` (requests/s) is finite and > 0."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"arrival rate must be a finite number > 0 requests/s, got {rate!r}")


@dataclass(frozen=True)
class Poisson(ArrivalProcess):
    """Poisson arrivals: exponential gaps, CV 1.

    Parameters
    ----------
    rate : float
        Mean requests per second, > 0.
    """

    rate: float
    cv: ClassVar[float] = 1.0

    def __post_init__(self) -> None:
        check_rate(self.rate)

    def unit_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        return rng.standard_exponential(n)

    def spec(self) -> str:  # noqa: D102
        return "poisson"


@dataclass(frozen=True)
class Gamma(ArrivalProcess):
    """Gamma-distributed gaps with a given coefficient of variation (burstiness).

    Shape ``k = 1 / cv**2``, scale ``1 / (rate * k)``: the mean rate is ``rate``
    whatever the CV. ``cv = 1`` has the law of Poisson arrivals; ``cv = 3`` sends
    most requests in tight bursts separated by long idle gaps.

    Parameters
    ----------
    rate : float
        Mean requests per second, > 0.
    cv : float
        Coefficient of variation of the gaps, > 0.
    """

    rate: float
    cv: float = 2.0

    def __post_init__(self) -> None:
        check_rate(self.rate)
        if not (self.cv > 0 and math.isfinite(self.cv)):
            raise ValueError(f"gamma CV must be > 0, got {self.cv!r}")

    def unit_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        k = 1.0 / (self.cv * self.cv)
        return rng.standard_gamma(k, n) / k

    def spec(self) -> str:  # noqa: D102
        return f"gamma:{self.cv:g}"


@dataclass(frozen=True)
class Periodic(ArrivalProcess):
    """One request exactly every ``1 / rate`` seconds (CV 0).

    Parameters
    ----------
    rate : float
        Requests per second, > 0.
    """

    rate: float
    cv: ClassVar[float] = 0.0

    def __post_init__(self) -> None:
        check_rate(self.rate)

    def unit_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        return np.ones(n)

    def spec(self) -> str:  # noqa: D102
        return "periodic"


def parse_arrival(spec: str, rate: float) -> ArrivalProcess:
    """Parse ``"poisson"``, ``"periodic"`` or ``"gamma:CV"`` into an arrival process.

    Parameters
    ----------
    spec : str
        Process name, with the CV for gamma (``"gamma:2"``).
    rate : float
        Mean requests per second.

    Raises
    ------
    ValueError
        Unknown process or bad parameter.
    """
    kind, _, arg = spec.strip().partition(":")
    if kind == "poisson" and not arg:
        return Poisson(rate)
    if kind == "periodic" and not arg:
        return Periodic(rate)
    if kind == "gamma":
        return Gamma(rate, float(arg) if arg else 2.0)
    raise ValueError(f"bad arrival process {spec!r}: expected poisson, periodic or gamma:CV")


def arrival_from_dict(d: Mapping[str, Any]) -> ArrivalProcess:
    """Rebuild an arrival process from :meth:`ArrivalProcess.to_dict` output."""
    kind = d.get("kind")
    if kind == "gamma":
        return Gamma(float(d["rate"]), float(d["cv"]))
    return parse_arrival(str(kind), float(d["rate"]))
