"""Smoke test of the FP8 load benchmark against torch's DCP reader
(bench/bench_hf_fp8_dcp.py) at tiny size, so ``python -m bench.bench_hf_fp8_dcp`` cannot
rot: 4 gloo ranks, a DeepSeek-V3 of 128-dims in 128 x 128 blocks, both layouts, 1 round.
The checks are on bytes and bitwise equality, never on times."""

from __future__ import annotations

import pytest

from bench import bench_hf_fp8_dcp as bd


@pytest.mark.dist
def test_benchmark_runs_and_all_three_methods_load_the_same_bits() -> None:
    res = bd.run(bd.TINY, ["ep", "tp"], 1, 1, None)
    assert set(res["layouts"]) == {"ep", "tp"}
    for ranks in res["layouts"].values():
        for info in ranks:
            assert info["same_bits"] == {"dcp": [], "full": []}
            read = info["bytes_read"]
            assert info["owned"] > 0 and read["shardspec"] == info["ss_read"]
            assert info["owned"] <= read["shardspec"] <= 1.05 * info["owned"]
            assert read["full"] > read["shardspec"]
            assert set(info["times"]) == set(bd.METHODS)
    lines = bd.report(res)
    assert lines[0].startswith("checkpoint") and any("shardspec/dcp" in x for x in lines)
