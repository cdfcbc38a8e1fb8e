"""Smoke test of the checkpoint benchmark (bench/bench_checkpoint.py) at tiny size, so
``python -m bench.bench_checkpoint`` cannot rot: one round on 2 gloo ranks, and the
planning simulation at 8 ranks, with their reports."""

from __future__ import annotations

import pytest

from bench import bench_checkpoint as bc

TINY: dict[str, int] = {}  # LlamaConfig's defaults: the model generated/llama.py was built from


def test_bench_spec_is_the_generated_spec_at_tiny_size() -> None:
    import generated.llama as L

    spec = bc.bench_spec(TINY)
    assert spec.rules == L.SPEC.rules
    assert spec.params == L.SPEC.params
    big = bc.bench_spec(bc.IO_MODEL)
    assert len(big.params) == 6 * bc.IO_MODEL["n_layers"] + 3


@pytest.mark.dist
def test_io_part_runs_and_round_trips() -> None:
    res = bc.run_io(TINY, rounds=1, world=2, sizes={"tp": 2})
    ops = {f"save:{w}:{k}" for w, k in bc.SAVES}
    ops |= {f"load:{w}:{k}:{t}" for w, k in bc.LOADS for t in ("warm", "cold")}
    assert set(res["times"]) == ops
    assert all(len(t) == 1 and t[0] > 0 for t in res["times"].values())
    assert res["checks"] == {f"load:{w}:{k}": [] for w, k in bc.LOADS}
    # Every tensor written once: replicated chunks (the norms, over tp) by one rank only.
    for (which, kind), tag in zip(bc.SAVES, res["written"], strict=True):
        assert tag == f"save:{which}:{kind}"
        assert sum(res["written"][tag]["plan"]) == res["sizes"][which], tag
    assert res["sizes"]["common"] < res["sizes"]["full"]
    res["params"], res["mesh"] = bc._n_params(TINY), "dp_shard 1 x tp 2"
    text = "\n".join(bc.io_report(res))
    assert "| generated planner | common |" in text and "all equal" in text


def test_plan_part_runs() -> None:
    rows = bc.run_plan(TINY, worlds=(8,), repeat=1)
    (row,) = rows
    assert row["mesh"] == {"dp_shard": 4, "tp": 2}
    # After DCP's dedup the default planner writes what the generated one plans statically.
    assert row["items_after_dedup"]["default"] <= row["items"]["default"]
    assert row["items_after_dedup"]["gen"] == row["items"]["gen"]
    assert row["global_gen_full"] > 0
    assert "| 8 |" in "\n".join(bc.plan_report(rows))
