"""Planning expert parallelism under sequence parallelism, in one process (no ranks): which
MoE blocks ``parallelize`` and ``tp_plan`` give ``MoESequenceParallel``, and each refusal of
``moe_blocks`` with its message. The multi-rank proofs are tests/test_ep_sp.py (its
trainer's own parallelization takes ``tp_plan``'s MoE blocks)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from shardspec.runtime import parallel
from shardspec.runtime.spec import SpecError
from tests import ep_sp_scenarios
from tests.ep_sp_specs import compile_all

SIZES = {"fsdp": 2, "tp": 2, "efsdp": 2, "ep": 2}
BLOCKS = ["layers.0.moe", "layers.1.moe"]


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Any:
    gen = tmp_path_factory.mktemp("ep_sp_plan")
    compile_all(Path(gen))
    return ep_sp_scenarios._generated(str(gen), "moe_sp").module


def _plans(spec: Any) -> tuple[dict[str, Any], set[str]]:
    model = ep_sp_scenarios.model()
    plans, _ = parallel.plan_params(spec, model, spec.layout_mesh(SIZES))
    experts = {
        parallel._owner(f)[0] for f, p in plans.items() if parallel.is_expert_parallel(spec, p)
    }
    return plans, experts


def test_the_moe_blocks_under_sequence_parallelism(layout: Any) -> None:
    plans, experts = _plans(layout.SPEC)
    assert experts == {f"{b}.experts" for b in BLOCKS}
    assert parallel.moe_blocks(layout.SPEC, plans, experts, "tp", {}) == BLOCKS


def test_no_moe_blocks_without_sequence_parallelism() -> None:
    folded = importlib.import_module("generated.deepseek_moe_folded")
    model = ep_sp_scenarios.ept.example()
    plans, _ = parallel.plan_params(folded.SPEC, model, folded.SPEC.layout_mesh(SIZES))
    experts = {f"{b}.experts" for b in BLOCKS}
    assert parallel.moe_blocks(folded.SPEC, plans, experts, "tp", {}) == []


@pytest.mark.parametrize(
    ("experts", "axis", "tp", "want"),
    [
        (
            ["experts"],
            "tp",
            {},
            "experts: expert parallelism under sequence parallelism: it "
            "has no parent module to route its tokens",
        ),
        (
            None,
            None,
            {},
            "layers.0.moe.experts: expert parallelism under sequence "
            "parallelism: the dense view has no tensor-parallel axis",
        ),
        (
            None,
            "tp",
            {"layers.1.moe.router": object()},
            "layers.1.moe: under sequence "
            "parallelism each tp rank routes its own tokens through this MoE block, so its "
            "parameters outside the experts (router, shared experts) must be whole on every tp "
            "rank, with no tensor-parallel style (their gradients are summed over tp): "
            "layers.1.moe.router",
        ),
    ],
)
def test_moe_blocks_refusals(
    layout: Any, experts: list[str] | None, axis: str | None, tp: dict[str, Any], want: str
) -> None:
    plans, found = _plans(layout.SPEC)
    with pytest.raises(SpecError) as e:
        parallel.moe_blocks(layout.SPEC, plans, found if experts is None else experts, axis, tp)
    assert want in str(e.value)
    assert "the model is unchanged" in str(e.value)
