"""Checkpoint plan caching, validation, empty shards, bad checkpoints, failed saves and
state dicts with entries the spec does not cover, on 4 gloo ranks (scenarios in
``tests/ckpt_fault_scenarios.py``, all in one spawn)."""

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
    "[uncovered]": 3,
}


@pytest.mark.dist
def test_checkpoint_faults_on_4_ranks(tmp_path: Path) -> None:
    results = run_ranks(ckpt_fault_scenarios.run_all, 4, str(tmp_path), timeout=240)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, checked) in enumerate(results):
        assert checked == EXPECTED, f"rank {rank} checked {checked}"


def test_what_save_counts_as_uncovered() -> None:
    """Which tensors without a parameter name ``save`` refuses (one process: the rule is
    pure computation over the compiled spec's tables)."""
    from shardspec.runtime import CompiledSpec, Param, RuleSpec
    from shardspec.runtime.units import uncovered

    wqkv = "layers.0.attention.qkv_linear.wqkv.weight"
    spec = CompiledSpec(
        name="hooked",
        axes=("dp",),
        sizes={"dp": None},
        world=None,
        rules=(RuleSpec(pattern="**", dims=("a", "b")),),
        params={wqkv: Param(0, (4, 4), "float32")},
        buffers=("rope.cache", "layers.0.attention.scale"),
        hook_keys={"layers.0.attention.wq.weight": ("layers.0.attention", (wqkv,))},
    )
    keys = [
        "model.layers.0.attention.wq.weight",  # a state-dict hook's key
        "model.layers.0.attention.scale",  # a buffer the manifest lists
        "model.rope.cache",  # another one, outside every parameter's module
        "model.layers.0.attention.stray",  # inside the model, nothing covers it
        "model.norm.bias",  # inside a module only this state dict shows
        "extra.rng",  # not the model's
        "step",
    ]
    got = uncovered(spec, keys, {"norm.weight"})
    assert got == (
        "model.layers.0.attention.wq.weight (written by a state-dict hook of "
        f"layers.0.attention in place of {wqkv})",
        "model.layers.0.attention.stray (no parameter, no buffer of the manifest, no ignore)",
        "model.norm.bias (no parameter, no buffer of the manifest, no ignore)",
    )
    assert uncovered(spec, [], set()) == ()
