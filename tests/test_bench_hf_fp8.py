"""Smoke test of the FP8 load benchmark (bench/bench_hf_fp8.py) at tiny size, so
``python -m bench.bench_hf_fp8`` cannot rot: 2 gloo ranks, the tiny Llama in 8 x 8 blocks
(which its dp_shard cuts cut), 1 round. The checks are on bytes and bitwise equality,
never on times."""

from __future__ import annotations

import pytest

from bench import bench_hf_fp8 as bf


@pytest.mark.dist
def test_benchmark_runs_and_both_methods_load_the_same_bits() -> None:
    res = bf.run(bf.TINY, 2, 1, (8, 8))
    for info in res["ranks"]:
        assert info["same_bits"]
        assert info["bytes_owned"] > 0
        assert info["bytes_owned"] <= info["bytes_read"] <= 1.5 * info["bytes_owned"]
        assert set(info["times"]) == {"shardspec", "full"}
    lines = bf.report(res)
    assert lines[1].startswith("rank") and "ratio" in lines[-1]
