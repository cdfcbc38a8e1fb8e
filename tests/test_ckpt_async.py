"""Asynchronous saves on 4 gloo ranks (scenarios in ``tests/ckpt_async_scenarios.py``, one
spawn): training with all-reduces on the default group runs while a save is in flight on
its own process group; the checkpoint is the state at the call, bitwise; a refused save
fails its future with a CheckpointError and leaves the previous checkpoint."""

from __future__ import annotations

import pytest

from shardspec.testing import run_ranks
from tests import ckpt_async_scenarios

# Checks per scenario on every rank (a scenario that stops early fails).
EXPECTED = {"train": 26, "dcp": 3, "fail": 18}


@pytest.mark.dist
def test_async_saves_on_4_ranks() -> None:
    results = run_ranks(ckpt_async_scenarios.run_all, 4, timeout=180)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, counts) in enumerate(results):
        assert counts == EXPECTED, f"rank {rank} checked {counts}"
