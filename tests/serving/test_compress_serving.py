"""KV compression in the reference serving stack (``WorkerConfig.kv_compress``,
``pdkv serve prefill --compress``; docs/compression.md, docs/serving.md).

Prefill workers whose agent talks tcp only (``transports=("tcp",)``: the workers share
this host, where shm would be chosen and nothing compressed) push the KV compressed:
lossless gives token-for-token the output of ``model.generate`` through the proxy,
streamed layer by layer and in one write; fp8 runs and returns tokens. The prefill
worker's ``pdkv_kv_wire_bytes_total`` says which codec carried the bytes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

import pdkv  # noqa: E402
from pdkv import codec  # noqa: E402
from pdkv.errors import InvalidArgument  # noqa: E402
from pdkv.serving.cli import build_parser, _kv_compress, _transports  # noqa: E402
from pdkv.serving.worker import kv_compression  # noqa: E402

from servers import Stack, completion_ids, concurrently, tiny  # noqa: E402,F401  (tiny: a fixture)

LOSSLESS = next((k for k in ("zstd", "lz4") if codec.available(k)), None)
TCP_ONLY = ("tcp",)


@pytest.fixture(scope="module")
def stack(tiny):
    if LOSSLESS is None:
        pytest.skip("this build has neither zstd nor lz4")
    lossless = pdkv.TcpCompression(mode="lossless", codec=LOSSLESS)
    s = Stack()
    try:
        s.d = s.worker(tiny, "decode", mode="chunked", max_batch_tokens=16)
        s.prefill = {
            "lossless": s.worker(tiny, "prefill", kv_compress=lossless, transports=TCP_ONLY),
            "lossless-monolithic": s.worker(tiny, "prefill", kv_compress=lossless, transports=TCP_ONLY,
                                            stream_layers=False),
            "fp8": s.worker(tiny, "prefill", kv_compress=pdkv.TcpCompression(mode="fp8"), transports=TCP_ONLY),
        }
        s.proxies = {k: s.proxy("disagg", prefill=[p], decode=[s.d]) for k, p in s.prefill.items()}
        yield s
    finally:
        s.close()


def wire_bytes(stack, which: str) -> dict[tuple[str, str], float]:
    """The prefill worker's ``pdkv_kv_wire_bytes_total`` per (transport, codec)."""
    m = stack.workers[stack.prefill[which]].sender.m_kv_wire
    return {k: m.value(k) for k in [("tcp", LOSSLESS), ("tcp", "fp8"), ("tcp", "none")]}


@pytest.mark.parametrize("which", ["lossless", "lossless-monolithic"])
def test_lossless_disagg_equals_generate_token_for_token(tiny, stack, which: str) -> None:
    before = wire_bytes(stack, which)
    base = stack.proxies[which]
    results = concurrently(lambda p: completion_ids(base, tiny.name, p), tiny.prompts)
    assert [ids for ids, _ in results] == tiny.refs
    for _ids, st in results:
        assert st["route"] == "disagg" and st["recomputed"] is False and st["kv_bytes"] > 0
    after = wire_bytes(stack, which)
    assert after[("tcp", LOSSLESS)] > before[("tcp", LOSSLESS)]  # the KV went compressed, over tcp
    assert after[("tcp", "fp8")] == before[("tcp", "fp8")]


def test_fp8_disagg_runs_and_returns_tokens(tiny, stack) -> None:
    before = wire_bytes(stack, "fp8")
    base = stack.proxies["fp8"]
    results = concurrently(lambda p: completion_ids(base, tiny.name, p), tiny.prompts)
    for (ids, st), ref in zip(results, tiny.refs):
        assert len(ids) == len(ref)  # quality is measured elsewhere (docs/compression.md)
        assert st["route"] == "disagg" and st["recomputed"] is False
    assert wire_bytes(stack, "fp8")[("tcp", "fp8")] > before[("tcp", "fp8")]


def test_the_worker_sets_dtype_and_fp8_grouping_from_its_pool() -> None:
    geo = pdkv.KVGeometry(num_layers=3, num_blocks=8, block_tokens=16, kv_heads=3, head_dim=64, dtype="bfloat16")
    asked = pdkv.TcpCompression(mode="fp8", level=3, dtype="float32", fp8_heads=9)
    z = kv_compression(asked, geo)
    assert (z.mode, z.level, z.dtype, z.fp8_heads, z.fp8_head_dim, z.fp8_rows_per_group) == \
        ("fp8", 3, "bfloat16", 3, 64, 16)
    assert asked.dtype == "float32" and asked.fp8_heads == 9  # the caller's object is left alone
    assert kv_compression(None, geo).mode == "off"


def test_cli_flags_become_the_worker_config() -> None:
    args = build_parser().parse_args(["prefill", "--compress", "auto", "--compress-policy", "lossy-allowed",
                                      "--compress-codec", "lz4", "--transports", "tcp"])
    z = _kv_compress(args)
    assert (z.mode, z.policy, z.codec) == ("auto", "lossy-allowed", "lz4")
    assert _transports(args) == ("tcp",)
    assert _kv_compress(build_parser().parse_args(["prefill"])) is None  # off: the default
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill", "--compress", "gzip"])
    with pytest.raises(InvalidArgument, match="no-such"):
        _transports(build_parser().parse_args(["decode", "--transports", "tcp,no-such"]))


def test_bad_worker_settings_are_named() -> None:
    from pdkv.serving.engine import EngineConfig
    from pdkv.serving.worker import WorkerConfig

    eng = EngineConfig(num_blocks=8, block_tokens=4)
    with pytest.raises(InvalidArgument, match="kv_compress"):
        WorkerConfig(role="prefill", engine=eng, model_name="m", kv_compress="lossless")
    with pytest.raises(InvalidArgument, match="transports"):
        WorkerConfig(role="prefill", engine=eng, model_name="m", transports="tcp")


def test_demo_passes_compress_to_the_prefill_worker(monkeypatch, tmp_path) -> None:
    import io

    from pdkv.serving import demo, launch

    seen = {}

    class FakeDeployment:
        def __init__(self, mode, model_dir, **kw):
            seen.update(kw, mode=mode)

        def start(self, timeout):
            raise launch.StartupError("not starting anything in this test")

        def stop(self):
            seen["stopped"] = True

    monkeypatch.setattr(launch, "Deployment", FakeDeployment)
    out = io.StringIO()
    assert demo.run_demo(tmp_path, compress="fp8", out=out) == 1
    assert seen["mode"] == "disagg" and seen["stopped"]
    assert seen["prefill_args"] == ["--transports", "tcp", "--compress", "fp8"]
    assert "KV compression: fp8" in out.getvalue()
    with pytest.raises(SystemExit):
        demo.main(["--compress", "gzip"])
