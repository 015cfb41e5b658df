"""The streaming report (pdkv.lab.serve.stream_report) and streambench's argument checks."""

from __future__ import annotations

import json

import pytest

import pdkv
from pdkv.lab.serve import stream_report


def report(preset: str, prompt_len: int, link: str | None, streamed_ready: float, mono_ready: float,
           exposed: float, met: bool) -> dict:
    r = {"preset": preset, "prompt_len": prompt_len, "transport": "tcp", "trials": 3, "layers": 30,
         "kv_bytes": 47185920,
         "streamed": {"prefill_s": 4.0, "kv_ready_s": streamed_ready, "exposed_s": exposed, "transfer_only_s": 0.4},
         "monolithic": {"prefill_s": 4.0, "kv_ready_s": mono_ready, "exposed_s": mono_ready - 4.0,
                        "transfer_only_s": 0.4},
         "kv_ready_ratio": streamed_ready / mono_ready, "hidden_share": 1 - exposed / (mono_ready - 4.0),
         "target_exposed_s": 0.053, "target_met": met, "transfer_only_throughput_ratio": 0.97}
    if link:
        r["link"] = {"spec": link, "rtt_emulated": True}
    return r


def test_table_orders_by_model_length_then_link_speed_and_shows_the_values(tmp_path):
    for name, r in {"a": report("smollm2", 1024, "1gbit", 4.001, 4.4, 0.001, True),
                    "b": report("smollm2", 1024, None, 4.0, 4.03, 0.0005, True),
                    "c": report("smollm2", 1024, "100mbit", 4.5, 8.0, 0.5, False)}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    rows = stream_report.table(stream_report.load(tmp_path)).splitlines()[2:]
    assert [row.split("|")[3].strip() for row in rows] == ["lo", "1gbit", "100mbit"]
    slow = rows[2].split("|")
    assert slow[6].strip() == "4500 / 8000" and slow[7].strip() == "0.56" and slow[10].strip() == "missed"
    assert rows[1].split("|")[9].strip() == "100%"  # 1 ms of 400 ms exposed
    assert rows[1].split("|")[11].strip() == "0.97"


def test_an_empty_directory_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no streambench reports"):
        stream_report.main([str(tmp_path)])


def test_streambench_link_runs_over_tcp_only():
    torch = pytest.importorskip("torch")  # noqa: F841  (streambench runs a model)
    from pdkv.lab.serve import streambench

    with pytest.raises(pdkv.InvalidArgument, match="--link runs over tcp"):
        streambench.run("tiny", 64, "shm", 1, 16, link="1gbit")
