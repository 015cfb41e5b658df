"""Host-side cost of preparing (validating, planning, laying out) a block transfer,
for 1k to 100k scattered llama-3-8b blocks (64 extents per block)."""

from __future__ import annotations

import pytest

from pdkv.lab.transfer.bench import prepare_cost


@pytest.mark.parametrize("blocks", [1_000, 10_000, 100_000])
def test_prepare_blocks(benchmark, blocks):
    res = benchmark.pedantic(lambda: prepare_cost("llama-3-8b", blocks), rounds=1, iterations=1)
    benchmark.extra_info.update(res)
