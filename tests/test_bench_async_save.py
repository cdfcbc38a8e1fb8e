"""Smoke test of the asynchronous-save benchmark (bench/bench_async_save.py) at tiny size,
so ``python -m bench.bench_async_save`` cannot rot: 2 gloo ranks, the tiny Llama, 1 round,
and its report. The checks are on structure and bitwise equality, never on times."""

from __future__ import annotations

import pytest

from bench import bench_async_save as ba


@pytest.mark.dist
def test_async_save_bench_runs_at_tiny_size() -> None:
    res = ba.run({}, rounds=1, world=2, sizes={"tp": 2})
    assert res["checks"] == []  # the asynchronous checkpoint is the state at the call
    for op in ba.OPS:
        for kind in ("blocking", "complete"):
            (t,) = res["times"][op][kind]
            assert t > 0, (op, kind)
    assert res["times"]["async"]["complete"][0] >= res["times"]["async"]["blocking"][0]
    text = "\n".join(ba.report(res))
    assert "Paired ratio, async call / sync save" in text and "all equal." in text
