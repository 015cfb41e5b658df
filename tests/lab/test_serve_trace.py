"""Trace generation: determinism, distributions, presets, prompts and JSONL replay."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.lab.serve import trace as serve_trace, trace_dist
from pdkv.lab.serve.trace import (
    PRESETS,
    Fixed,
    Gamma,
    LogNormal,
    Mixture,
    Periodic,
    Poisson,
    Trace,
    TraceRequest,
    TraceSpec,
    Uniform,
    generate_trace,
    get_preset,
    length_dist_from_dict,
    load_trace,
    parse_arrival,
    parse_length_dist,
    saturation_rate,
    save_trace,
    text_prompt,
    token_prompt,
    utilisation,
)

FAST = settings(max_examples=25, deadline=None, derandomize=True, database=None)
SLOW = settings(max_examples=8, deadline=None, derandomize=True, database=None)  # 20k-sample draws

seeds = st.integers(min_value=0, max_value=2**32 - 1)
preset_names = st.sampled_from(sorted(PRESETS))


def _spec(arrival, prompt=Fixed(100), output=Fixed(10)):
    return TraceSpec("t", "test", arrival, prompt, output)


# ---------------------------------------------------------------- determinism


@FAST
@given(name=preset_names, seed=seeds)
def test_same_seed_same_trace(name, seed):
    spec = get_preset(name)
    a = spec.generate(seed=seed, duration_s=30)
    b = spec.generate(seed=seed, duration_s=30)
    assert a.requests == b.requests
    assert len(a) > 0 and a.requests[0].arrival_s == 0.0
    t = [r.arrival_s for r in a]
    assert t == sorted(t) and t[-1] < 30
    assert [r.index for r in a] == list(range(len(a)))


@FAST
@given(name=preset_names, seed=seeds)
def test_different_seeds_differ(name, seed):
    spec = get_preset(name)
    a = spec.generate(seed=seed, num_requests=50)
    b = spec.generate(seed=seed + 1, num_requests=50)
    assert a.requests != b.requests


@FAST
@given(name=preset_names, seed=seeds, n=st.integers(1, 3000))
def test_prefix_does_not_depend_on_length(name, seed, n):
    spec = get_preset(name)
    short = spec.generate(seed=seed, num_requests=n)
    long = spec.generate(seed=seed, num_requests=n + 1500)
    assert long.requests[:n] == short.requests


@FAST
@given(name=preset_names, seed=seeds, factor=st.floats(0.25, 4.0))
def test_other_rate_is_the_same_trace_rescaled(name, seed, factor):
    spec = get_preset(name)
    base = spec.generate(seed=seed, num_requests=200)
    fast = spec.with_rate(spec.rate * factor).generate(seed=seed, num_requests=200)
    for a, b in zip(base, fast):
        assert (a.prompt_len, a.output_len) == (b.prompt_len, b.output_len)
        assert b.arrival_s == pytest.approx(a.arrival_s / factor, rel=1e-9, abs=1e-12)


def test_limits():
    spec = _spec(Poisson(10.0))
    assert len(generate_trace(spec, num_requests=7)) == 7
    assert len(generate_trace(spec, num_requests=0)) == 0
    both = generate_trace(spec, duration_s=1.0, num_requests=10_000)
    assert all(r.arrival_s < 1.0 for r in both)
    with pytest.raises(ValueError):
        generate_trace(spec)
    with pytest.raises(ValueError):
        generate_trace(spec, duration_s=-1)
    with pytest.raises(ValueError):
        Poisson(0.0)
    with pytest.raises(ValueError):
        Gamma(1.0, -2.0)


# ---------------------------------------------------------------- arrival processes


@SLOW
@given(rate=st.floats(0.05, 50.0), seed=seeds)
def test_poisson_rate_and_cv(rate, seed):
    n = 20_000
    trace = generate_trace(_spec(Poisson(rate)), seed=seed, num_requests=n)
    gaps = np.diff([r.arrival_s for r in trace]) * rate  # unit-mean exponential
    # mean of n-1 exponentials: std 1/sqrt(n); allow 5 sigma
    assert abs(gaps.mean() - 1.0) < 5 / math.sqrt(n)
    assert abs(gaps.std() - 1.0) < 0.06
    assert trace.mean_rate == pytest.approx(rate, rel=5 / math.sqrt(n))


@SLOW
@given(rate=st.floats(0.05, 50.0), cv=st.floats(0.3, 4.0), seed=seeds)
def test_gamma_rate_and_burstiness(rate, cv, seed):
    n = 20_000
    trace = generate_trace(_spec(Gamma(rate, cv)), seed=seed, num_requests=n)
    gaps = np.diff([r.arrival_s for r in trace]) * rate
    assert abs(gaps.mean() - 1.0) < 5 * cv / math.sqrt(n)
    # The sample CV of a gamma law converges slowly for large CV (heavy right tail): 20%.
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.2)


def test_periodic_is_exact():
    trace = generate_trace(_spec(Periodic(4.0)), duration_s=2.0)
    assert [r.arrival_s for r in trace] == pytest.approx([i / 4 for i in range(8)])


def test_duration_mean_count():
    # Poisson count over T at rate r: mean r*T (+1 for the request at t = 0), std sqrt(r*T).
    counts = [len(generate_trace(_spec(Poisson(5.0)), seed=s, duration_s=40.0)) for s in range(40)]
    assert abs(np.mean(counts) - 201) < 5 * math.sqrt(200 / 40)


def test_parse_arrival():
    assert parse_arrival("poisson", 2.0) == Poisson(2.0)
    assert parse_arrival("periodic", 2.0) == Periodic(2.0)
    assert parse_arrival("gamma:3", 2.0) == Gamma(2.0, 3.0)
    assert parse_arrival("gamma:3", 2.0).cv == 3.0 and Poisson(1.0).cv == 1.0 and Periodic(1.0).cv == 0.0
    with pytest.raises(ValueError):
        parse_arrival("uniform", 1.0)


# ---------------------------------------------------------------- length distributions


def _draw(dist, n=20_000, seed=0):
    return dist.sample(np.random.default_rng(seed), n)


@FAST
@given(v=st.integers(1, 100_000))
def test_fixed(v):
    assert set(_draw(Fixed(v), 100).tolist()) == {v}
    assert Fixed(v).mean() == v


@FAST
@given(lo=st.integers(1, 2000), width=st.integers(0, 2000), seed=seeds)
def test_uniform(lo, width, seed):
    d = Uniform(lo, lo + width)
    x = _draw(d, seed=seed)
    assert x.min() >= lo and x.max() <= lo + width
    std = math.sqrt(((width + 1) ** 2 - 1) / 12)
    assert abs(x.mean() - d.mean()) <= 5 * std / math.sqrt(x.size) + 1e-9
    if width <= 20:
        assert set(x.tolist()) == set(range(lo, lo + width + 1))


@FAST
@given(median=st.floats(8, 2048), sigma=st.floats(0.05, 1.5), seed=seeds)
def test_lognormal_clipped(median, sigma, seed):
    lo, hi = max(1, int(median / 4)), int(median * 4) + 1
    d = LogNormal(median, sigma, lo, hi)
    x = _draw(d, seed=seed)
    assert x.min() >= lo and x.max() <= hi
    # The median survives clipping (it is inside the bounds) and rounding (+-0.5 token);
    # the sample median's standard error is about 1.2533 * median * sigma / sqrt(n).
    assert abs(np.median(x) - median) <= 0.5 + 6 * 1.2533 * median * sigma / math.sqrt(x.size)
    # Mass clipped onto the upper bound matches P(X > hi) (rounding moves the edge by 1/2 token).
    p_hi = 1 - trace_dist._norm_cdf((math.log(hi - 0.5) - math.log(median)) / sigma)
    assert abs((x == hi).mean() - p_hi) < 5 * math.sqrt(max(p_hi * (1 - p_hi), 1e-6) / x.size) + 0.002
    # Sample mean against the exact mean of the clipped law.
    assert abs(x.mean() - d.mean()) < 5 * x.std() / math.sqrt(x.size) + 0.5


@FAST
@given(w=st.floats(0.02, 0.98), seed=seeds)
def test_mixture_fractions(w, seed):
    d = Mixture(((w, Fixed(100)), (1 - w, Fixed(1000))))
    x = _draw(d, seed=seed)
    assert set(np.unique(x).tolist()) <= {100, 1000}
    frac = (x == 100).mean()
    assert abs(frac - w) < 5 * math.sqrt(w * (1 - w) / x.size)
    assert d.mean() == pytest.approx(100 * w + 1000 * (1 - w))


def test_mixture_of_presets_80_20():
    spec = get_preset("mixed")
    trace = spec.generate(seed=3, num_requests=20_000)
    long = np.array([r.prompt_len for r in trace]) >= 512  # short component is clipped to <= 512
    # P(short component yields exactly 512) is tiny; the long one is always >= 512.
    assert abs(long.mean() - 0.2) < 5 * math.sqrt(0.16 / long.size) + 0.01


lengths = st.recursive(
    st.one_of(
        st.integers(1, 5000).map(Fixed),
        st.tuples(st.integers(1, 500), st.integers(0, 500)).map(lambda t: Uniform(t[0], t[0] + t[1])),
        st.tuples(st.integers(2, 4096), st.sampled_from([0.1, 0.25, 0.5, 1.0]), st.integers(1, 16)).map(
            lambda t: LogNormal(float(t[0]), t[1], t[2], t[0] * 4)
        ),
    ),
    lambda inner: st.lists(st.tuples(st.sampled_from([0.1, 0.2, 0.5, 1.0, 3.0]), inner), min_size=1, max_size=3).map(
        lambda cs: Mixture(tuple(cs))
    ),
    max_leaves=4,
)


@FAST
@given(d=lengths)
def test_length_dist_round_trips(d):
    assert length_dist_from_dict(json.loads(json.dumps(d.to_dict()))) == d
    if not any(isinstance(c, Mixture) for _, c in getattr(d, "components", ())):
        assert parse_length_dist(d.spec()) == d  # the string form does not nest mixtures


def test_parse_length_dist():
    assert parse_length_dist("128") == Fixed(128)
    assert parse_length_dist("uniform:1:8") == Uniform(1, 8)
    assert parse_length_dist("0.8*128+0.2*fixed:1024") == Mixture(((0.8, Fixed(128)), (0.2, Fixed(1024))))
    for bad in ("", "uniform:8", "lognormal:1:2", "0.8*", "normal:3", "fixed:0", "uniform:9:1"):
        with pytest.raises(ValueError):
            parse_length_dist(bad)


# ---------------------------------------------------------------- presets


def test_presets_exist_and_round_trip():
    for name in ("chat-short", "rag-long", "mixed", "prefill-heavy"):
        spec = get_preset(name)
        assert spec.description
        assert TraceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ValueError, match="choose from"):
        get_preset("nope")


def test_presets_stay_below_saturation_on_one_core():
    for spec in PRESETS.values():
        assert 0.3 < utilisation(spec) < 0.6, spec.name
        assert saturation_rate(spec) > 1.6 * spec.rate
        # Saturation scales with cores.
        assert saturation_rate(spec, cores=2) == pytest.approx(2 * saturation_rate(spec))


def test_issue_anchor_1024_every_half_second_saturates():
    spec = _spec(Periodic(2.0), Fixed(1024), Fixed(1))
    assert utilisation(spec) > 1.5  # 0.8 s of prefill every 0.5 s
    assert utilisation(spec.with_rate(0.5)) == pytest.approx(0.4)


def test_docstring_table_matches_the_cost_model():
    rows = re.findall(r"^``([\w-]+)``\s.*?([\d.]+)/s\s+([\d.]+)\s+([\d.]+)/s\s*$", serve_trace.__doc__, re.M)
    assert {r[0] for r in rows} == set(PRESETS)
    for name, rate, rho, sat in rows:
        spec = PRESETS[name]
        assert float(rate) == spec.rate
        assert float(rho) == pytest.approx(utilisation(spec), abs=0.006)
        assert float(sat) == pytest.approx(saturation_rate(spec), abs=0.006)


# ---------------------------------------------------------------- prompts


@FAST
@given(n=st.integers(0, 3000), seed=seeds, index=st.integers(0, 10**6))
def test_token_prompt_exact_and_deterministic(n, seed, index):
    ids = token_prompt(n, seed=seed, index=index)
    assert len(ids) == n and all(100 <= t < 1000 for t in ids)
    assert ids == token_prompt(n, seed=seed, index=index)
    if n >= 8:
        assert ids != token_prompt(n, seed=seed, index=index + 1)


def test_token_prompt_vocab_and_text_prompt():
    assert set(token_prompt(2000, vocab_size=5, first_id=3)) == {3, 4}
    with pytest.raises(ValueError):
        token_prompt(4, vocab_size=10, first_id=10)
    text = text_prompt(300, seed=1, index=2)
    assert len(text.split()) == 300 and text == text_prompt(300, seed=1, index=2)
    assert text != text_prompt(300, seed=1, index=3)
    assert text_prompt(0) == ""


def test_trace_prompt_kinds():
    trace = get_preset("chat-short").generate(seed=5, num_requests=3)
    r = trace.requests[1]
    assert len(trace.prompt(r)) == r.prompt_len
    assert len(trace.prompt(r, kind="text").split()) == r.prompt_len
    assert trace.prompt(r, vocab_size=2000) != trace.prompt(r)
    with pytest.raises(ValueError):
        trace.prompt(r, kind="bytes")


# ---------------------------------------------------------------- JSONL


def test_jsonl_round_trip(tmp_path):
    trace = get_preset("mixed").generate(seed=9, num_requests=40)
    path = tmp_path / "t.jsonl"
    save_trace(trace, path)
    back = load_trace(path, seed=9)
    assert back.requests == trace.requests
    assert [back.prompt(r) for r in back] == [trace.prompt(r) for r in trace]


def test_jsonl_replay_formats(tmp_path):
    path = tmp_path / "replay.jsonl"
    lines = [
        {"timestamp": 5000, "prompt": "hello there world", "output_len": 4},
        {"timestamp": 3000, "input_length": 10, "output_length": 2},  # Mooncake names
        {},
        {"timestamp": 4000, "prompt": [5, 6, 7], "output_len": 1},
    ]
    path.write_text("\n".join(json.dumps(d) if d else "" for d in lines) + "\n")
    trace = load_trace(path, time_scale=1e-3)
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 1.0, 2.0])
    assert [(r.prompt_len, r.output_len) for r in trace] == [(10, 2), (3, 1), (3, 4)]
    assert trace.prompt(trace.requests[2]) == "hello there world"
    assert trace.prompt(trace.requests[1]) == [5, 6, 7]
    assert len(trace.prompt(trace.requests[0])) == 10
    assert trace.mean_rate == pytest.approx(1.0)
    faster = trace.scaled_to_rate(4.0)
    assert [r.arrival_s for r in faster] == pytest.approx([0.0, 0.25, 0.5])


@pytest.mark.parametrize(
    "line, match",
    [
        ("[1, 2]", "not a JSON object"),
        ('{"prompt_len": 3, "output_len": 1}', "timestamp"),
        ('{"timestamp": 0, "output_len": 1}', "prompt_len"),
        ('{"timestamp": 0, "prompt_len": 4}', "output_len"),
        ('{"timestamp": 0, "prompt": [1, "a"], "output_len": 1}', "token ids"),
        ("{oops", ":2:"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "prompt_len": 1, "output_len": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_default_output_len_and_rescale_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "prompt_len": 4}\n')
    trace = load_trace(path, default_output_len=16)
    assert trace.requests[0].output_len == 16
    with pytest.raises(ValueError):
        trace.scaled_to_rate(1.0)  # one request has no rate
    assert math.isnan(trace.mean_rate)
    assert Trace((TraceRequest(0, 0.0, 1, 1),)).duration_s == 0.0
