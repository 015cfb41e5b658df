"""Layer-wise KV streaming in the prefill worker (``stream_layers``, docs/streaming.md):
greedy output through the proxy equals ``model.generate`` with streaming on and off,
for whole-prompt and chunked prefill and for differing block sizes, and each path is
the one taken (the prefill worker's ``pdkv_kv_streamed_total``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from servers import Stack, completion_ids, concurrently, tiny  # noqa: E402,F401  (tiny: a fixture)


@pytest.fixture(scope="module")
def stack(tiny):
    s = Stack()
    try:
        s.d = s.worker(tiny, "decode", mode="chunked", max_batch_tokens=16)
        s.prefill = {
            "streamed": s.worker(tiny, "prefill"),
            "monolithic": s.worker(tiny, "prefill", stream_layers=False),
            # Prompts longer than 16 tokens are prefilled in chunks.
            "streamed-chunked": s.worker(tiny, "prefill", mode="chunked", max_batch_tokens=16),
            # Blocks of 8 tokens here, 4 at the decode worker: planned token by token.
            "streamed-8": s.worker(tiny, "prefill", block_tokens=8, num_blocks=48),
        }
        s.proxies = {k: s.proxy("disagg", prefill=[p], decode=[s.d]) for k, p in s.prefill.items()}
        yield s
    finally:
        s.close()


def kv_paths(stack, which: str) -> dict[str, float]:
    m = stack.workers[stack.prefill[which]].sender.m_kv_streamed
    return {path: m.value((path,)) for path in ("streamed", "monolithic")}


@pytest.mark.parametrize("which", ["streamed", "monolithic", "streamed-chunked", "streamed-8"])
@pytest.mark.parametrize("streamed_sse", [False, True], ids=["json", "sse"])
def test_greedy_output_is_unchanged_token_for_token(tiny, stack, which: str, streamed_sse: bool) -> None:
    before = kv_paths(stack, which)
    base = stack.proxies[which]
    results = concurrently(lambda p: completion_ids(base, tiny.name, p, streamed=streamed_sse), tiny.prompts)
    assert [ids for ids, _ in results] == tiny.refs
    for _ids, st in results:
        assert st["route"] == "disagg" and st["recomputed"] is False and st["kv_bytes"] > 0
    after = kv_paths(stack, which)
    n = len(tiny.prompts)
    if which == "monolithic":
        assert after["monolithic"] - before["monolithic"] == n and after["streamed"] == before["streamed"]
    else:
        assert after["streamed"] - before["streamed"] == n and after["monolithic"] == before["monolithic"]


def _histogram_counts(registry_text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in registry_text.splitlines()
               if line.startswith(name + "_count"))


@pytest.mark.parametrize("which", ["streamed", "monolithic", "streamed-chunked", "streamed-8"])
def test_kv_span_tail_and_wire_times_are_reported(tiny, stack, which: str) -> None:
    """``pdkv_stats`` and the metrics tell the KV's span (a stream's overlaps the
    prefill), the time it added after the prefill's last layer and its time on the wire."""
    from servers import get

    prompt = max(tiny.prompts, key=len)
    ids, st = completion_ids(stack.proxies[which], tiny.name, prompt)
    assert st["route"] == "disagg" and st["kv_bytes"] > 0 and not st["recomputed"], st
    span, tail, wire = st["kv_seconds"], st["kv_tail_seconds"], st["kv_wire_seconds"]
    assert span > 0 and 0 < tail <= span and 0 < wire <= span, st
    if which == "monolithic":  # one write after the prefill: all of it is tail and wire
        assert tail == span == wire, st
    for url in (stack.prefill[which], stack.proxies[which]):
        status, text = get(url + "/metrics")
        assert status == 200
        for name in ("pdkv_kv_transfer_span_seconds", "pdkv_kv_transfer_tail_seconds",
                     "pdkv_kv_transfer_wire_seconds"):
            assert _histogram_counts(text, name) >= 1, (url, name)
