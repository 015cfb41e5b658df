"""Prefix-reuse figures of a ``pdkv bench serve`` run: hit rates, computed prompt tokens,
KV bytes moved, and whether the outputs equal the cache-off run's.

Each run (one mode at one rate) gets, in its ``summary`` in results.json:

``prefix_hit_rate``
    ``1 - prefill_tokens / prompt_tokens``: the share of the prompt tokens the client
    sent that no worker computed (their KV was cached locally or pulled).
``prefix_hit_rate_max``
    What a perfect, infinite prefix cache would have hit on the prompts actually sent
    (:func:`hit_rate_max`), so ``prefix_hit_rate / prefix_hit_rate_max`` is the share
    of the reachable reuse a mode reached.
``prefill_tokens``
    Prompt tokens the workers computed: the growth of ``pdkv_prefill_computed_tokens_total``
    summed over every worker during the run.
``kv_bytes``
    KV bytes moved between workers during the run: the growth of
    ``pdkv_kv_transfer_bytes_total`` (pushed prefill -> decode) plus
    ``pdkv_kv_pull_bytes_total`` (pulled from a worker holding a prefix), over every
    worker; ``kv_bytes_pushed`` and ``kv_bytes_pulled`` separately.
``outputs_equal``
    The run's outputs equal, token for token and request by request, those of the
    cache-off run of the same mode at the same rate (greedy decoding), else of another
    mode's cache-off run (:func:`fill_outputs_equal`); ``None`` when no cache-off run
    was measured, or for a cache-off run itself. With it: ``outputs_baseline`` (that
    run's label), ``outputs_compared`` and ``outputs_differ`` (``[index, first differing
    output position]`` per request that differs).

Also ``prompt_tokens`` (sent by the client), ``worker_prompt_tokens`` (the growth of the
workers' ``pdkv_prompt_tokens_total``, for reference), ``new_prompt_tokens`` (prompt
tokens not in the same session's previous prompt: the new message and the previous
answer), ``prefix_hit_tokens`` (``{"local", "pulled"}``), ``kv_bytes_per_turn``,
``kv_bytes_vs_new_tokens`` (``kv_bytes`` over the KV of the new prompt tokens, when the
model's KV size per token is known) and ``block_tokens``. A figure a worker does not expose (a worker that predates the
prefix cache) is ``None`` (JSON ``null``), never 0.

The denominator of ``prefix_hit_rate`` is the client's count and not the workers':
in a disaggregated deployment a prompt is counted by the prefill worker that computes
it and may be counted again by the decode worker that admits it, so the workers'
``pdkv_prompt_tokens_total`` is not "tokens sent".
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from pdkv.lab.serve.metrics import BenchResults, RequestRecord, RunResult
from pdkv.serving.prefix_hash import block_hashes, cache_salt

__all__ = [
    "COUNTERS",
    "NOCACHE_SUFFIX",
    "compare_outputs",
    "fetch_counters",
    "fill_outputs_equal",
    "hit_rate_max",
    "kv_bytes_per_token",
    "markdown",
    "metric_deltas",
    "parse_counters",
    "prefix_summary",
]

#: The worker counters a run's figures come from.
COUNTERS = (
    "pdkv_prompt_tokens_total",
    "pdkv_prefill_computed_tokens_total",
    "pdkv_prefix_hit_tokens_total",
    "pdkv_kv_transfer_bytes_total",
    "pdkv_kv_pull_bytes_total",
    "pdkv_kv_pushed_skipped_blocks_total",
    "pdkv_prefix_evictions_total",
)
#: Label of a mode run with the workers' prefix cache off (``disagg`` -> ``disagg-nocache``).
NOCACHE_SUFFIX = "-nocache"

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_counters(metrics_text: str) -> Dict[str, float]:
    """A worker's ``/metrics`` (Prometheus text) -> the :data:`COUNTERS` it exposes,
    each summed over its labels, plus ``pdkv_prefix_hit_tokens_total{source=...}`` per
    source as ``"pdkv_prefix_hit_tokens_total:<source>"``. A counter the worker does
    not expose is absent (not 0)."""
    out: Dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or m["name"] not in COUNTERS:
            continue
        try:
            v = float(m["value"])
        except ValueError:
            continue
        name = m["name"]
        out[name] = out.get(name, 0.0) + v
        if name == "pdkv_prefix_hit_tokens_total":
            source = dict(_LABEL.findall(m["labels"] or "")).get("source", "")
            key = f"{name}:{source}"
            out[key] = out.get(key, 0.0) + v
    return out


async def fetch_counters(urls: Sequence[str], *, timeout_s: float = 10.0) -> List[Optional[Dict[str, float]]]:
    """Every worker's :func:`parse_counters` (``None`` for a worker whose ``/metrics``
    could not be read, with a warning on stderr)."""
    import aiohttp

    async def one(session: "aiohttp.ClientSession", url: str) -> Optional[Dict[str, float]]:
        try:
            async with session.get(url.rstrip("/") + "/metrics") as r:
                if r.status != 200:
                    raise aiohttp.ClientError(f"HTTP {r.status}")
                return parse_counters(await r.text())
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            print(f"warning: could not read {url}/metrics: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        return list(await asyncio.gather(*(one(session, u) for u in urls)))


def metric_deltas(before: Sequence[Optional[Mapping[str, float]]],
                  after: Sequence[Optional[Mapping[str, float]]]) -> Dict[str, Optional[float]]:
    """Growth of each counter over a run, summed over the workers.

    Parameters
    ----------
    before, after : sequence of dict or None
        Per worker (same order), :func:`parse_counters` at the start and end of the run.

    Returns
    -------
    dict
        Counter name -> growth; ``None`` when no worker exposed it at both ends, or when
        a worker could not be read at one end (the sum would be short).
    """
    if len(before) != len(after):
        raise ValueError(f"{len(before)} workers before the run, {len(after)} after")
    names = {k for snap in (*before, *after) if snap for k in snap}
    out: Dict[str, Optional[float]] = {}
    for name in sorted(names):
        total, seen, broken = 0.0, False, False
        for b, a in zip(before, after):
            if b is None or a is None:
                broken = True
                continue
            if name in a:
                total += a[name] - b.get(name, 0.0)  # a counter that appeared during the run started at 0
                seen = True
        out[name] = total if seen and not broken else None
    return out


def hit_rate_max(records: Sequence[RequestRecord], block_tokens: int) -> Dict[str, Any]:
    """The hit rate of a perfect, infinite prefix cache on the prompts ``records`` sent.

    Requests are taken in the order they were sent. A perfect cache holds the KV of
    every full block of every earlier request's prompt and answer (all but the answer's
    last token, whose KV a server never computes); a prompt hits its leading full
    blocks found there, capped so that at least one prompt token is computed (the
    engine must run the last prompt token to sample). Requests without a recorded
    prompt (never sent) are skipped.

    Parameters
    ----------
    records : sequence of RequestRecord
        With ``prompt_token_ids`` (session turns and token-id request prompts keep them).
    block_tokens : int
        Tokens per KV block of the workers.

    Returns
    -------
    dict
        ``{"rate": hit / prompt tokens or None, "hit_tokens", "prompt_tokens"}``.

    Examples
    --------
    Two blocks of 4; the second prompt repeats the first's 8 tokens and adds 4:

    >>> a = RequestRecord(0, 0.0, send_s=0.0, prompt_token_ids=list(range(8)))
    >>> b = RequestRecord(1, 1.0, send_s=1.0, prompt_token_ids=list(range(12)))
    >>> hit_rate_max([a, b], 4)
    {'rate': 0.4, 'hit_tokens': 8, 'prompt_tokens': 20}
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    salt = cache_salt("pdkv-bench-bound", block_tokens=block_tokens, dtype="any")
    seen: set = set()
    hit = total = 0
    sent = sorted((r for r in records if r.prompt_token_ids is not None and r.send_s is not None),
                  key=lambda r: (r.send_s, r.index))
    for r in sent:
        prompt = list(r.prompt_token_ids or [])
        hashes = block_hashes(prompt, block_tokens, salt)
        blocks = 0
        for h in hashes:
            if h not in seen:
                break
            blocks += 1
        total += len(prompt)
        hit += min(blocks * block_tokens, max(len(prompt) - 1, 0))
        kept = prompt + list(r.output_token_ids or [])[:-1]
        seen.update(block_hashes(kept, block_tokens, salt))
    return {"rate": hit / total if total else None, "hit_tokens": hit, "prompt_tokens": total}


def _new_tokens(records: Sequence[RequestRecord]) -> Optional[int]:
    """Prompt tokens not in the same session's previous prompt, over the sent requests."""
    by_key = {(r.session, r.turn): r for r in records if r.session is not None}
    if not by_key:
        return None
    n = 0
    for (s, t), r in by_key.items():
        if r.send_s is None:
            continue
        prev = by_key.get((s, (t or 0) - 1))
        n += r.prompt_len - (prev.prompt_len if prev is not None and t else 0)
    return n


def prefix_summary(records: Sequence[RequestRecord], deltas: Optional[Mapping[str, Optional[float]]],
                   *, block_tokens: int, kv_token_bytes: Optional[int] = None) -> Dict[str, Any]:
    """A run's prefix-reuse figures (see the module docstring).

    Parameters
    ----------
    records : sequence of RequestRecord
        The run's requests.
    deltas : mapping or None
        :func:`metric_deltas` of the workers over the run; ``None`` when the workers
        were not scraped (every worker figure is then ``None``).
    block_tokens : int
        Tokens per KV block (for :func:`hit_rate_max`).
    kv_token_bytes : int, optional
        KV bytes of one token (:func:`kv_bytes_per_token`): adds
        ``kv_bytes_vs_new_tokens`` = ``kv_bytes`` / the KV of ``new_prompt_tokens``.

    Returns
    -------
    dict
        JSON-serialisable; ``outputs_equal`` is ``None`` until :func:`fill_outputs_equal`.
    """
    d = dict(deltas or {})

    def count(name: str) -> Optional[int]:
        v = d.get(name)
        return None if v is None else int(round(v))

    sent = [r for r in records if r.send_s is not None]
    prompt_tokens = sum(r.prompt_len for r in sent)
    computed = count("pdkv_prefill_computed_tokens_total")
    pushed, pulled = count("pdkv_kv_transfer_bytes_total"), count("pdkv_kv_pull_bytes_total")
    kv = None if pushed is None and pulled is None else (pushed or 0) + (pulled or 0)
    best = hit_rate_max(records, block_tokens) if any(r.prompt_token_ids is not None for r in records) else None
    hits = {s: count(f"pdkv_prefix_hit_tokens_total:{s}") for s in ("local", "pulled")}
    return {
        "prefix_hit_rate": (1 - computed / prompt_tokens) if computed is not None and prompt_tokens else None,
        "prefix_hit_rate_max": None if best is None else best["rate"],
        "prefill_tokens": computed,
        "kv_bytes": kv,
        "outputs_equal": None,
        "prompt_tokens": prompt_tokens,
        "worker_prompt_tokens": count("pdkv_prompt_tokens_total"),
        "new_prompt_tokens": _new_tokens(records),
        "prefix_hit_tokens": hits if any(v is not None for v in hits.values()) else None,
        "kv_bytes_pushed": pushed,
        "kv_bytes_pulled": pulled,
        "kv_bytes_per_turn": kv / len(sent) if kv is not None and sent else None,
        "kv_pushed_skipped_blocks": count("pdkv_kv_pushed_skipped_blocks_total"),
        "prefix_evictions": count("pdkv_prefix_evictions_total"),
        "block_tokens": block_tokens,
        "kv_bytes_vs_new_tokens": (kv / (new * kv_token_bytes)
                                   if kv is not None and kv_token_bytes and (new := _new_tokens(records)) else None),
    }


def kv_bytes_per_token(model_dir: Any) -> Optional[int]:
    """K and V bytes of one token over every layer, from the model's config.json (None without one)."""
    if model_dir is None:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(cfg.get("torch_dtype", "float32")), 4)
        return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * size
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def _cache_off(run: RunResult) -> bool:
    return run.config.get("prefix_cache") == "off"


def _base_mode(run: RunResult) -> str:
    return run.mode[: -len(NOCACHE_SUFFIX)] if run.mode.endswith(NOCACHE_SUFFIX) else run.mode


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_outputs(run: Sequence[RequestRecord], base: Sequence[RequestRecord]) -> Dict[str, Any]:
    """Requests of ``run`` against their pairs in ``base`` (same index), both successful.

    Returns
    -------
    dict
        ``equal``: True when every compared pair has the same token ids, False when one
        differs, None when nothing could be compared or a successful pair lacks token
        ids (nothing to compare is not "equal"); ``compared``; ``differ``: up to 20
        ``[index, first differing output position]`` pairs.
    """
    other = {r.index: r for r in base}
    compared, differ, missing = 0, [], False
    for r in run:
        m = other.get(r.index)
        if m is None or not (r.ok and m.ok):
            continue
        if r.output_token_ids is None or m.output_token_ids is None:
            missing = True
            continue
        compared += 1
        if r.output_token_ids != m.output_token_ids:
            differ.append([r.index, _first_difference(r.output_token_ids, m.output_token_ids)])
    equal = False if differ else (None if missing or not compared else True)
    return {"equal": equal, "compared": compared, "differ": differ[:20], "num_differ": len(differ)}


def fill_outputs_equal(results: BenchResults) -> None:
    """Sets ``outputs_equal`` (and ``outputs_baseline``) of every cache-on run that has
    prefix figures: against the cache-off run of the same mode at the same rate, else
    the first cache-off run of another mode at that rate (greedy outputs do not depend
    on the mode). Cache-off runs keep ``None``."""
    off = [r for r in results.runs if _cache_off(r)]
    for run in results.runs:
        if run.prefix is None or _cache_off(run):
            continue
        same_rate = [b for b in off if abs(b.rate - run.rate) <= 1e-9 * max(1.0, run.rate)]
        same_rate.sort(key=lambda b: _base_mode(b) != _base_mode(run))
        if not same_rate:
            continue
        base = same_rate[0]
        c = compare_outputs(run.records, base.records)
        run.prefix["outputs_equal"] = c["equal"]
        run.prefix["outputs_baseline"] = base.mode
        run.prefix["outputs_compared"] = c["compared"]
        run.prefix["outputs_differ"] = c["differ"]


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:,.0f}"


def markdown(results: BenchResults) -> Optional[str]:
    """The report's "Prefix reuse" section: one row per run that has prefix figures
    (``None`` when no run has them)."""
    runs = [r for r in results.runs if r.prefix is not None]
    if not runs:
        return None
    lines = [
        "## Prefix reuse",
        "",
        "Hit rate = 1 - prompt tokens computed / prompt tokens sent; max = what a perfect infinite cache would hit "
        "on the same prompts (block granularity, send order). Prefill tokens = computed by the workers; KV bytes = "
        "moved between workers (pushed + pulled); KV / new tokens' KV relates them to the KV of the prompt tokens not in the "
        "session's previous prompt. Rate: sessions/s for session workloads. Outputs equal: token for token against the cache-off run "
        "(`-`: no cache-off run to compare with). `-` elsewhere: the workers do not expose that counter.",
        "",
        "| Mode | Rate | Hit rate | Max | Of max | Prompt tokens | Prefill tokens | Hit tokens local / pulled | "
        "KV bytes | KV bytes/turn | KV / new tokens' KV | TTFT p50 (s) | Goodput | Outputs equal |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for run in runs:
        p = run.prefix or {}
        s = run.summary(results.slo)
        hr, mx = p.get("prefix_hit_rate"), p.get("prefix_hit_rate_max")
        of_max = hr / mx if hr is not None and mx else None
        eq = p.get("outputs_equal")
        n_diff = len(p.get("outputs_differ") or [])
        eq_s = "-" if eq is None else ("yes" if eq else f"**NO** ({n_diff} of {p.get('outputs_compared')})") + \
            f" (vs {p.get('outputs_baseline')})"
        ttft = "-" if s.ttft.p50 is None else f"{s.ttft.p50:.3g}"
        gp = "-" if s.goodput_fraction is None else f"{100 * s.goodput_fraction:.0f}%"
        h = p.get("prefix_hit_tokens") or {}
        hits = f"{_num(h.get('local'))} / {_num(h.get('pulled'))}"
        lines.append(f"| {run.candidate} | {run.rate:g} | {_pct(hr)} | {_pct(mx)} | {_pct(of_max)} | "
                     f"{_num(p.get('prompt_tokens'))} | {_num(p.get('prefill_tokens'))} | {hits} | "
                     f"{_num(p.get('kv_bytes'))} | "
                     f"{_num(p.get('kv_bytes_per_turn'))} | {_ratio(p.get('kv_bytes_vs_new_tokens'))} | {ttft} | "
                     f"{gp} | {eq_s} |")
    if any((r.prefix or {}).get("outputs_equal") is False for r in runs):
        lines += ["", "**Outputs differ from the cache-off run**: `outputs_differ` in results.json lists each request "
                  "and the first output position that differs. Either a bug, or two logits within float noise of "
                  "each other (KV computed by another path: one decode step instead of a batched prefill) that "
                  "greedy decoding broke differently; check the margin at that position."]
    return "\n".join(lines) + "\n"


def plot(results: BenchResults, path: Any) -> Optional[Any]:
    """``prefix_reuse.png``: per run, hit rate against its maximum, and TTFT p50.
    Returns the path, or None when no run has prefix figures."""
    runs = [r for r in results.runs if r.prefix is not None]
    if not runs:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = [f"{r.candidate} @{r.rate:g}" for r in runs]
    hr = [(r.prefix or {}).get("prefix_hit_rate") or 0.0 for r in runs]
    mx = [(r.prefix or {}).get("prefix_hit_rate_max") or 0.0 for r in runs]
    ttft = [r.summary(results.slo).ttft.p50 or 0.0 for r in runs]
    fig = Figure(figsize=(max(7.0, 1.6 * len(runs) + 2), 4.2))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    xs = list(range(len(runs)))
    ax1.bar([x - 0.2 for x in xs], [100 * v for v in hr], width=0.4, label="measured")
    ax1.bar([x + 0.2 for x in xs], [100 * v for v in mx], width=0.4, label="perfect cache")
    ax1.set_ylabel("prefix hit rate (%)")
    ax1.set_xticks(xs)
    ax1.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    ax1.legend(fontsize=7)
    ax2.bar(xs, ttft)
    ax2.set_ylabel("TTFT p50 (s)")
    ax2.set_xticks(xs)
    ax2.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
