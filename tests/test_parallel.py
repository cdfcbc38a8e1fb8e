"""``parallelize`` and ``verify`` on 4 gloo ranks (scenarios in tests/parallel_scenarios.py).

The llama spec is also compiled without its manifest (and hf block) by the real CLI, so
the same layout parallelizes a llama of dim 512, whose shapes the manifest does not list.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardspec.cli import main as shardspec_main
from shardspec.testing import run_ranks
from tests import parallel_scenarios

ROOT = Path(__file__).resolve().parent.parent

# Checks each scenario must make on every rank (a scenario that checks nothing fails).
MIN_CHECKS = {
    "train llama": 2 * 15 + 3 + 1,
    "train llama dim 512": 2 * 15 + 3 + 1,
    "train qwen2": 2 * 27 + 3 + 1,
    "train moe": 2 * 30 + 3 + 1,
    "meta qwen2": 1,
    "reshard": 30,
    "handmade": 15 * 4 + 4,
    "errors": 5,
}


def _spec_without_manifest(text: str) -> str:
    """specs/llama.shard for the dim-512 llama (head_dim 128): no manifest or hf block,
    and the fused q/k/v groups at that head size."""
    text = re.sub(r'(?m)^manifest "[^"]*"\n', "", text)
    text = re.sub(r'(?ms)^hf "[^"]*" \{.*?^\}\n?', "", text)
    old = "fuse qkv as 2 groups of q 32, k 16, v 16"
    assert old in text
    return text.replace(old, "fuse qkv as 2 groups of q 256, k 128, v 128")


@pytest.mark.dist
def test_parallelize_and_verify_on_4_ranks(tmp_path: Path) -> None:
    spec = tmp_path / "llama_big.shard"
    spec.write_text(_spec_without_manifest((ROOT / "specs" / "llama.shard").read_text()))
    assert shardspec_main(["compile", str(spec), "-o", str(tmp_path)]) == 0
    results = run_ranks(parallel_scenarios.run_all, 4, "llama_big", str(tmp_path), timeout=240)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, counts) in enumerate(results):
        for tag, least in MIN_CHECKS.items():
            assert counts.get(tag, 0) >= least, f"rank {rank}: {tag} made {counts.get(tag)}"
