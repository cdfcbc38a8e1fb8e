"""Parameters the spec replicates over the fsdp axis (FSDP2 leaves them alone): parallelize
makes the plain ones Replicate DTensors (every parameter a DTensor, as CUDA's default
foreach optimizers need), their module computes with the local tensors of those only (a
style's own DTensor parameters stay DTensors), and every one of them, converted or not,
has its gradient averaged over the axis."""

from __future__ import annotations

import pytest

from shardspec.testing import run_ranks
from tests import replica_scenarios

pytestmark = pytest.mark.dist


def test_replicas_compute_locally_and_average_their_gradients() -> None:
    results = run_ranks(replica_scenarios.run, 2)
    for r in results:
        assert r["returned"] == ["m.a", "m.b"]  # the style's DTensor is averaged too
        assert r["types_after"] == ("DTensor", "DTensor")  # restored after the forward
        # during the forward: the converted one is local, the style's stays a DTensor
        assert r["seen"] == [("Tensor", "DTensor")]
        # x = rank + 1 on each rank: the mean over the 2 ranks is 1.5 for both
        assert r["a_grad"] == [1.5] * 3 and r["b_grad"] == [1.5] * 3
