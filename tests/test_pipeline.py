"""Pipeline parallelism on 4 gloo ranks (scenarios in tests/pipeline_scenarios.py).

specs/llama_pp.shard is also compiled by the real CLI with Megatron-style stage-local
layer names (``split layers.{layer} local``), so the two naming styles exchange checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardspec.cli import main as shardspec_main
from shardspec.testing import run_ranks
from tests import pipeline_scenarios

ROOT = Path(__file__).resolve().parent.parent

# Checks each scenario must make on every rank (a scenario that checks nothing fails).
MIN_CHECKS = {
    "train": 2 * (1 + 13),  # two schedules: stage contents and every parameter of a stage
    "reshard": 2 * (2 * 13 + 2),
    "local names": 1 + 27 + 13 + 13,
    "errors": 10,
    # the refusal (message, nothing left holding the state dict, no debris, files
    # unchanged), then every tensor of the stage's model and flattened AdamW state
    # (13 parameters or more: value, exp_avg, exp_avg_sq, step)
    "refused save": 9 + 4 * 13,
}


def _local_names(text: str) -> str:
    manifest = ROOT / "specs" / "llama_pp.manifest.json"
    text = text.replace('manifest "llama_pp.manifest.json"', f'manifest "{manifest}"')
    assert text.count("    split layers.{layer}\n") == 1, "specs/llama_pp.shard changed"
    return text.replace("    split layers.{layer}\n", "    split layers.{layer} local\n")


@pytest.mark.dist
def test_pipeline_on_4_ranks(tmp_path: Path) -> None:
    spec = tmp_path / "llama_pp_local.shard"
    spec.write_text(_local_names((ROOT / "specs" / "llama_pp.shard").read_text()))
    assert shardspec_main(["compile", str(spec), "-o", str(tmp_path)]) == 0
    assert "local_names=True" in (tmp_path / "llama_pp_local.py").read_text()
    results = run_ranks(pipeline_scenarios.run_all, 4, str(tmp_path), timeout=240)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, counts) in enumerate(results):
        for tag, least in MIN_CHECKS.items():
            assert counts.get(tag, 0) >= least, f"rank {rank}: {tag} made {counts.get(tag)}"
