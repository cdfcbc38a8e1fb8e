"""Checkpoints of vLLM's tp 4 layout with replicated KV heads (`heads k 16 replicated`,
specs/qwen2_vllm_tp4.shard), saved and loaded with the generated ``save``/``load`` across
tp 4, tp 2 and dp_shard 4, both ways: scenarios in tests/ckpt_kvrep_scenarios.py, one
spawn of 4 gloo ranks.

The tp 2 layout is specs/qwen2_vllm_tp2.shard on `dp: 2  tp: 2` (two engine replicas:
the world is 4); the dp_shard 4 layout is specs/qwen2_vllm_tp1.shard under FSDP
(`fsdp dp_shard`), without `replicated` (at tp 1 it changes nothing, and lint refuses
replicated heads on a dimension that FSDP shards too: SS051). Both compiled here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from shardspec.cli import main as shardspec_main
from shardspec.testing import run_ranks
from tests import ckpt_kvrep_scenarios

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "specs"


def _variant(source: str, mesh: str, *, replicated: bool = True) -> str:
    """specs/``source`` with absolute paths and mesh block ``mesh``."""
    text = (SPECS / source).read_text(encoding="utf-8")
    text = re.sub(r'(manifest|hf) "([^"/]+)"', lambda m: f'{m[1]} "{SPECS / m[2]}"', text)
    text, n = re.subn(r"(?m)^mesh over \d+ ranks \{\n    tp: \d+[^\n]*\n\}\n", mesh, text)
    assert n == 1, f"specs/{source} changed"
    if not replicated:
        old = "k 16 replicated, v 16 replicated"
        assert old in text, f"specs/{source} changed"
        text = text.replace(old, "k 16, v 16")
    return text


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("ckpt_kvrep")
    variants = {
        "qwen2_vllm_dp2tp2": _variant(
            "qwen2_vllm_tp2.shard", "mesh over 4 ranks {\n    dp: 2\n    tp: 2\n}\n"
        ),
        "qwen2_vllm_dp4": _variant(
            "qwen2_vllm_tp1.shard",
            "mesh over 4 ranks {\n    dp_shard: *\n    tp: 1\n}\nfsdp dp_shard\n",
            replicated=False,
        ),
    }
    for name, text in variants.items():
        (root / f"{name}.shard").write_text(text, encoding="utf-8")
        assert shardspec_main(["compile", str(root / f"{name}.shard"), "-o", str(root)]) == 0
    return run_ranks(ckpt_kvrep_scenarios.run, 4, str(root), timeout=400)


@pytest.mark.dist
def test_replicated_kv_heads_checkpoint_loads_bitwise_across_layouts(
    results: list[dict[str, Any]],
) -> None:
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fail"]]
    assert not fails, "\n".join(fails[:30])
    for rank, res in enumerate(results):
        count = res["count"]
        for name in ckpt_kvrep_scenarios.LAYOUTS:
            assert count[f"source {name}"] == 1, (rank, count)
        for src, dst in ckpt_kvrep_scenarios.PAIRS:
            assert count[f"{src} -> {dst}"] == 2, (rank, count)
        # rank 0 reads the tp 4 checkpoint's metadata: k and v of 2 layers, weight and bias
        assert count.get("stored once", 0) == (2 * 2 * 2 + 1 if rank == 0 else 0), count
