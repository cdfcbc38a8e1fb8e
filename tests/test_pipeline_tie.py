"""Weights tied across pipeline stages on 4 gloo ranks (scenarios in
tests/pipeline_tie_scenarios.py), through specs/llama_pp_tied.shard."""

from __future__ import annotations

import pytest

from shardspec.testing import run_ranks
from tests import pipeline_tie_scenarios

# Checks each scenario must make on every rank (a scenario that checks nothing fails).
MIN_CHECKS = {
    "train": 2 + 13 + 2 + 1,  # stage contents, every parameter, copies, the control
    "reshard": 3 + 2 * (13 + 1 + 13 + 1),
    "broadcast": 2 * 2,
    "errors": 3 * 2,
}


@pytest.mark.dist
def test_tied_pipeline_on_4_ranks() -> None:
    results = run_ranks(pipeline_tie_scenarios.run_all, 4, timeout=240)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, counts) in enumerate(results):
        for tag, least in MIN_CHECKS.items():
            assert counts.get(tag, 0) >= least, f"rank {rank}: {tag} made {counts.get(tag)}"
