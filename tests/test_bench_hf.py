"""Smoke test of the Hugging Face load benchmark (bench/bench_hf.py) at tiny size, so
``python -m bench.bench_hf`` cannot rot: 2 gloo ranks, the tiny Llama, 1 round, and its
report. The checks are on counts and bitwise equality, never on times."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_hf as bh

TINY: dict[str, int] = {}  # LlamaConfig's defaults: the model generated/llama.py was built from


def test_bench_map_is_the_generated_map_at_tiny_size() -> None:
    import generated.llama as L

    assert bh.bench_hfmap(TINY) == L.HF
    big = bh.bench_hfmap(bh.MODEL)
    ropes = {t.head_dim for r in big.rules for t in r.transforms if t.kind == "rope"}
    assert ropes == {bh.MODEL["head_dim"]}


def test_checkpoint_is_laid_out_like_save_pretrained(tmp_path: Path) -> None:
    import json

    info = bh.write_checkpoint(str(tmp_path), TINY, files=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(bh.hf_shapes(TINY))
    names = sorted(set(index["weight_map"].values()))
    assert names == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == info["tensor_bytes"]


@pytest.mark.dist
def test_benchmark_runs_and_every_method_loads_the_same_shards() -> None:
    res = bh.run(TINY, rounds=1, world=2, sizes={"tp": 2}, files=2)
    tags = {f"{m}:{t}" for m in bh.METHODS for t in bh.TEMPS}
    assert set(res["times"]) == tags
    assert all(len(t) == 1 and t[0] > 0 for t in res["times"].values())
    assert set(res["round0"]) == set(bh.METHODS)
    assert res["checks"] == {m: [] for m in bh.METHODS}  # bitwise equal to shardspec's load
    s = bh.summary(res)
    ours = s["shardspec"]
    assert ours["report_ratio"] <= bh.TARGET_READ
    assert ours["st_ratio"] <= bh.TARGET_READ
    assert ours["collectives"] == 0 and ours["dispatched"] == 0
    # The counters see the baselines' collectives: DCP's plan exchange, the scatters of
    # distribute_tensor (invisible to the wrapped torch.distributed functions).
    assert s["dcp"]["collectives"] > 0
    assert s["full"]["dispatched"] > 0
    assert s["full"]["st_ratio"] > 1.5  # every rank reads every tensor
    text = "\n".join(bh.report(res))
    assert "all methods identical" in text
    for label in bh.LABELS.values():
        assert label in text
