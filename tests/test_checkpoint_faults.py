"""Checkpoint plan caching, validation, empty shards, bad checkpoints and failed saves on 4
gloo ranks (scenarios in ``tests/ckpt_fault_scenarios.py``, all in one spawn)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardspec.testing import run_ranks
from tests import ckpt_fault_scenarios

EXPECTED = {
    "[caching]": 4,
    "[validation]": 4,
    "[ignore]": 1,
    "[bad-files]": 4,
    "[failed-save]": 2,
    "[empty]": 1,
    "[locality]": 2,
    "[ckpt-placement]": 1,
    "[local-experts-ep]": 1,
}


@pytest.mark.dist
def test_checkpoint_faults_on_4_ranks(tmp_path: Path) -> None:
    results = run_ranks(ckpt_fault_scenarios.run_all, 4, str(tmp_path), timeout=240)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, checked) in enumerate(results):
        assert checked == EXPECTED, f"rank {rank} checked {checked}"
