"""``pdkv demo`` end to end with SmolLM2-135M-Instruct (slow): it streams answers, prints
the TTFT/ITL/KV figures and leaves no process behind, also when interrupted; and the
model's greedy answers through the proxy equal ``generate``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from pdkv.errors import NotFound  # noqa: E402
from pdkv.serving import models  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_dir():
    try:
        return models.default_model_dir()
    except NotFound as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")


def _children_of(pid: int) -> list[int]:
    """Processes started for the launcher ``pid`` (they carry PDKV_PARENT_PID)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"PDKV_PARENT_PID={pid}".encode() in env:
            found.append(int(entry))
    return found


def test_demo_runs_end_to_end(smollm2_dir) -> None:
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pdkv.cli", "demo", "--max-tokens", "16"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert time.monotonic() - t0 < 180
    for needle in ("prefill-0", "decode-0", "proxy", "[1/3] user: What is the capital of France?", "TTFT",
                   "ITL p50", "over shm", "per request:", "stopping the processes... done"):
        assert needle in out, out
    assert "Paris" in out
    assert not _children_of(proc.pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_demo_stops_everything_on_ctrl_c(smollm2_dir) -> None:
    # SIGINT back to its default in the child: a shell runs background jobs with SIGINT
    # ignored, and an ignored signal stays ignored across exec (then Ctrl-C cannot reach it).
    proc = subprocess.Popen([sys.executable, "-m", "pdkv.cli", "demo", "--max-tokens", "2000", "--question",
                             "Write a very long story about a lighthouse keeper."], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("assistant:") or not line:
                break
        assert any(ln.startswith("assistant:") for ln in lines), "".join(lines)
        children = _children_of(proc.pid)
        assert len(children) == 3, children  # prefill, decode, proxy
        time.sleep(1.0)  # mid-answer
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, rest
        assert "interrupted" in rest and "stopping the processes... done" in rest
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if proc.stdout:
            proc.stdout.close()


def test_smollm2_through_the_proxy_equals_generate(smollm2_dir) -> None:
    from pdkv.serving.demo import QUESTIONS
    from pdkv.serving.openai_api import TextCodec
    from servers import Stack, TinyServing, concurrently, post, reference

    codec = TextCodec.load(smollm2_dir)
    prompts = [codec.chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    refs = reference(models.load_model(smollm2_dir, dtype="float32", attn_implementation="sdpa"), prompts, 12,
                     pad=codec.tokenizer.pad_token_id)
    sm = TinyServing(smollm2_dir, smollm2_dir.name, models.load_model(smollm2_dir, dtype="float32"), codec, prompts,
                     refs)
    stack = Stack()
    try:
        p = stack.worker(sm, "prefill", block_tokens=16, num_blocks=64)
        d = stack.worker(sm, "decode", mode="chunked", max_batch_tokens=32, block_tokens=16, num_blocks=64)
        shortest = min(len(x) for x in prompts)
        for mode in ("disagg", "hybrid"):
            base = stack.proxy(mode, prefill=[p], decode=[d], hybrid_threshold=shortest)

            def ask(q: str) -> tuple[list[int], dict]:
                status, obj = post(base + "/v1/chat/completions", {
                    "model": sm.name, "messages": [{"role": "user", "content": q}], "max_tokens": 12,
                    "temperature": 0, "return_token_ids": True, "pdkv_stats": True})
                assert status == 200, obj
                return obj["choices"][0]["token_ids"], obj["pdkv"]

            got = concurrently(ask, list(QUESTIONS))
            assert [ids for ids, _ in got] == refs
            routes = [st["route"] for _, st in got]
            assert routes == (["disagg"] * 3 if mode == "disagg" else
                              ["local" if len(x) <= shortest else "disagg" for x in prompts])
    finally:
        stack.close()
