"""Smoke test of the weight-transfer benchmark (bench/bench_transfer.py) at tiny size, so
``python -m bench.bench_transfer`` cannot rot: its spec writer, its planner timing, and
one round of every method on 2 trainer + 2 engine gloo ranks, with the report (no timing
assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_transfer as bt
from shardspec.transfer import plan_json, plan_transfer

REPO = Path(__file__).resolve().parents[1]
TINY: dict[str, int] = {}  # LlamaConfig's defaults: the model specs/llama.shard describes


def test_write_specs_at_tiny_size_is_the_llama_spec(tmp_path: Path) -> None:
    spec = bt.write_specs(tmp_path, TINY)
    assert Path(spec).read_text() == (REPO / "specs" / "llama.shard").read_text()
    entries = json.loads((tmp_path / "llama.manifest.json").read_text())["entries"]
    want = json.loads((REPO / "specs" / "llama.manifest.json").read_text())["entries"]
    assert entries == want
    # The same moves as the plan from the repository's files (the manifests' hashes aside).
    sizes = ({"tp": 2}, {"tp": 2}, 4, 2)
    ours = plan_json(plan_transfer(spec, spec, *sizes))
    llama = str(REPO / "specs" / "llama.shard")
    theirs = plan_json(plan_transfer(llama, llama, *sizes))
    assert ours["tensors"] == theirs["tensors"] and ours["totals"] == theirs["totals"]


def test_write_specs_scales_the_heads(tmp_path: Path) -> None:
    text = Path(bt.write_specs(tmp_path, bt.MODEL)).read_text()
    assert "fuse qkv as 4 groups of q 256, k 64, v 64" in text and "rope 64" in text
    doc, timing = bt.make_plan(str(tmp_path / "llama.shard"), bt.TRAIN, bt.ENGINE)
    totals = doc["totals"]
    assert totals["wire_bytes"] == totals["engine_bytes"]
    # Every HF byte, and the norms (replicated over tp 4) once more on 3 of the 4 ranks.
    norms = (2 * bt.MODEL["n_layers"] + 1) * bt.MODEL["dim"] * 4
    assert totals["engine_bytes"] == bt._full_bytes(bt.MODEL) + 3 * norms
    assert timing["plan_s"] > 0 and timing["plan_peak"] > 0


@pytest.mark.dist
def test_bench_runs_every_method_bitwise() -> None:
    every = (*bt.METHODS, bt.INDEX)
    res = bt.run(
        TINY, rounds=1, train=(2, {"tp": 2}), engine=(2, {"tp": 2}), bucket=4096, methods=every
    )
    s = bt.summary(res)
    methods = s["methods"]
    assert set(methods) == set(every)
    for m, r in methods.items():
        assert r["mismatch"] == [], m  # every engine parameter equal to torch's cut, bitwise
        assert r["best"] > 0
    p2p = methods["p2p"]
    for m in ("p2p", bt.INDEX):
        assert methods[m]["wire"] == s["engine_bytes"], m
        assert methods[m]["per_engine_ratio"] == [1.0, 1.0], m
    for side in ("trainer", "engine"):
        calls = p2p["collectives"][side]
        assert calls.get("all_reduce") == 2 and not any("gather" in k for k in calls), calls
        assert "broadcast" not in calls, calls
    assert methods["gather_bcast"]["collectives"]["engine"]["broadcast"] > 0
    assert methods["gather_bcast"]["wire"] > p2p["wire"]
    text = "\n".join(bt.report(res, s))
    assert "| p2p |" in text and "| gather_bcast |" in text and "| dcp |" in text
    assert "DIFFERS" not in text
