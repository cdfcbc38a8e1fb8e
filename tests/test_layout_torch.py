"""Every layout the compiler can emit, through torch's own DTensor operations on gloo.

The compiler's placements (``dtensor_placements``) are only worth emitting where torch's own
``full_tensor`` and ``redistribute`` can gather them: lint refuses the rest (SS031,
``torch_problem``), and notes where ``distribute_tensor`` cannot scatter them from one rank
(SS023's hint; they are then split locally, ``src_data_rank=None``). A hypothesis search,
run on gloo ranks, puts every layout the compiler emits through those operations and
compares what torch puts on each rank with the compiler's rank table
(tests/layout_torch_scenarios.py); another spawn shows that what the model says torch
cannot do really fails in torch, and its hints' fixes do not. Single-process tests pin the
placements on size-1 axes and the model's reading of torch.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from shardspec.core import layout as L
from shardspec.core.layout import (
    Dim,
    Fusion,
    Mesh,
    ParamLayout,
    RuleSpec,
    dtensor_placements,
    representable,
    torch_problem,
    torch_problem_text,
    torch_shard_order,
)
from shardspec.runtime.dtensor import to_torch
from shardspec.runtime.spec import CompiledSpec, SpecError
from shardspec.testing import run_ranks
from tests import layout_torch_scenarios as scenarios
from tests.test_layout_props import AXIS_NAMES, layouts, placement_cases

WORLD = 4


@pytest.mark.dist
def test_emitted_layouts_round_trip_through_torch_on_gloo() -> None:
    kinds = run_ranks(scenarios.drive, WORLD, 300, timeout=120)[0]
    # The search must reach torch often, and with every feature the claim covers (the
    # search is derandomized: these counts do not vary from run to run).
    assert kinds.get("emitted", 0) >= 100, kinds
    assert kinds.get("refused", 0) >= 20, kinds
    for feature in ("strided", "size-1 axis", "fused", "local"):
        assert kinds.get(feature, 0) >= 30, (feature, kinds)
    assert kinds.get("uneven", 0) >= 5, kinds
    assert kinds.get("uneven _StridedShard", 0) >= 3, kinds
    assert kinds.get("redistribute to another layout", 0) >= 50, kinds
    assert kinds.get("DTensor.redistribute to another layout", 0) >= 50, kinds


@pytest.mark.dist
def test_what_the_model_refuses_fails_in_torch_and_its_fixes_do_not() -> None:
    for name, sizes, layout in scenarios.LIMITS:
        op = L.SCATTER if name.startswith("scatter") else L.GATHER
        problem = torch_problem(layout, Mesh(AXIS_NAMES, sizes), op)
        assert (problem is None) == name.endswith("fixed"), (name, problem)
    # Lint refuses only what torch cannot gather: the uneven _StridedShard gathers.
    assert torch_problem(scenarios.LIMITS[2][2], Mesh(AXIS_NAMES, (2, 2, 2))) is None
    results = run_ranks(scenarios.limits, 8, timeout=120)
    for got in results:
        # "Expected cond to be True", wherever the tensor comes from.
        assert got["gather"] == got["gather split locally"] == "RuntimeError", got
        assert got["scatter"] == "AssertionError", got  # _StridedShard._shard_tensor
        assert got["scatter split locally"] == "ok", got
        for name in ("gather fixed", "scatter fixed"):
            assert got[name] == got[f"{name} split locally"] == "ok", got
        assert got["runtime redistribute"], got
    # Torch's own one-call redistribute gets the pair wrong somewhere (the reason for
    # runtime.dtensor.redistribute's detour through Replicate).
    assert not all(got["torch redistribute"] for got in results), results


# --------------------------------------------------------------------------- one process

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_the_issue_layout_is_emitted_without_a_strided_size1_axis() -> None:
    _, (sizes, layout, _) = scenarios.the_issue_case()
    mesh = Mesh(AXIS_NAMES, sizes)
    assert dtensor_placements(layout, mesh) == (L.StridedShard(0, 2), L.Shard(0), L.REPLICATE)
    assert representable(layout, mesh) is None
    assert torch_problem(layout, mesh) is None


def _without_size1(layout: ParamLayout, mesh: Mesh) -> tuple[ParamLayout, Mesh]:
    """The same layout on the mesh without its size-1 axes. A fused dimension whose first
    axis has size 1 is not split per component (its next axis cuts it as one block): it is
    the same dimension unfused."""
    keep = [n for n, s in zip(mesh.names, mesh.sizes, strict=True) if s > 1]
    dims = tuple(
        Dim(
            d.name,
            d.size,
            tuple(a for a in d.axes if a in keep),
            None if d.axes and mesh.size(d.axes[0]) == 1 else d.fusion,
            d.name_indexed,
        )
        for d in layout.dims
    )
    local = frozenset(a for a in layout.local if a in keep)
    return ParamLayout(dims, local), mesh.submesh(keep)


@SETTINGS
@given(st.sampled_from([0, 8]).flatmap(lambda crowd: layouts(crowd=crowd)))
def test_size1_axes_replicate_and_change_no_split_factor(case) -> None:
    """A size-1 axis cuts nothing: its placement is Replicate, and the layout's placements,
    and whether the compiler emits it, are those of the same layout without the axis."""
    layout, mesh, _ = case
    if layout is None:
        return
    placements = dtensor_placements(layout, mesh)
    sub = L.dtensor_mesh(layout, mesh)
    for p, n in zip(placements, sub.sizes, strict=True):
        assert n > 1 or p == L.REPLICATE, (layout, mesh, placements)
    small, small_mesh = _without_size1(layout, mesh)
    kept = tuple(p for p, n in zip(placements, sub.sizes, strict=True) if n > 1)
    assert dtensor_placements(small, small_mesh) == kept
    assert (representable(layout, mesh) is None) == (representable(small, small_mesh) is None)
    assert (torch_problem(layout, mesh) is None) == (torch_problem(small, small_mesh) is None)


class _SizedMesh:
    """What torch's shard-order decoder asks of a DeviceMesh: its sizes."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    def size(self, i: int) -> int:
        return self.sizes[i]


@SETTINGS
@given(placement_cases())
def test_shard_order_is_torchs(case) -> None:
    """``torch_shard_order`` reads split factors as torch's own decoder does."""
    _, sizes, placements = case
    theirs = DTensorSpec._maybe_convert_StridedShard_to_shard_order(
        tuple(to_torch(p) for p in placements),
        _SizedMesh(sizes),  # type: ignore[arg-type]
    )
    ours = torch_shard_order(placements, sizes)
    if theirs is None:
        assert ours is None
    else:
        assert ours is not None
        assert {e.tensor_dim: list(e.mesh_dims) for e in theirs} == ours


def test_torch_problem_names_the_step_and_the_way_out() -> None:
    gather = scenarios.LIMITS[0][2]
    mesh = Mesh(("dp", "ep", "tp"), (2, 2, 2))
    renamed = ParamLayout(
        (Dim("expert", 4, ("ep", "dp")), Dim("ffn", 8, ("tp",), scenarios.GATE_UP), gather.dims[2])
    )
    problem = torch_problem(renamed, mesh)
    assert problem == L.TorchProblem("full_tensor", (0, 0, 0), "ep", 0)
    message, hint = torch_problem_text(renamed, mesh, problem)
    assert "'ffn' is split per component over 'tp'" in message
    assert "'expert' over 'ep'" in message and "_StridedShard over 'dp'" in message
    assert "ep before dp" in hint and "local tp" in hint

    uneven = ParamLayout((Dim("x", 6, ("tp", "dp")),))
    dp_tp = Mesh(("dp", "tp"), (2, 2))
    assert torch_problem(uneven, dp_tp) is None  # it gathers: lint emits it
    problem = torch_problem(uneven, dp_tp, L.SCATTER)
    assert problem == L.TorchProblem("distribute_tensor", (0, 0), "dp", 0)
    message, hint = torch_problem_text(uneven, dp_tp, problem)
    assert "distribute_tensor cannot scatter 'x' from one rank" in message
    assert "src_data_rank=None" in hint and "divisible by tp x dp = 4" in hint


def test_torch_problem_cost_does_not_grow_with_the_world(monkeypatch) -> None:
    """Sampled like the other layout checks: a million ranks cost what 64 do (the ranks
    whose step sizes it computes)."""
    step_sizes = L._step_sizes
    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return step_sizes(*args)

    monkeypatch.setattr(L, "_step_sizes", counted)
    fused = Fusion((("gate", 1 << 12), ("up", 1 << 12)))
    visited = []
    for world in (64, 1 << 20):
        n = math.isqrt(world // 4)
        mesh = Mesh(("dp", "ep", "tp"), (n, 4, n))
        layout = ParamLayout(
            (Dim("expert", 4 * n, ("ep", "dp")), Dim("ffn", 1 << 13, ("tp",), fused))
        )
        calls.clear()
        assert torch_problem(layout, mesh) is not None
        visited.append(len(calls))
    assert visited[1] <= visited[0] * 2 and visited[1] < 400, visited


@SETTINGS
@given(st.integers(0, 64), st.integers(1, 8), st.integers(1, 8))
def test_strided_shard_sizes_are_torchs(m: int, split_factor: int, n: int) -> None:
    """The shard sizes of a _StridedShard step, as torch's own split gives them (unequal
    ones are what distribute_tensor cannot scatter)."""
    p = to_torch(L.StridedShard(0, split_factor))
    shards, _ = p._split_tensor(torch.arange(m), n, with_padding=False, contiguous=False)
    assert L._strided_shard_sizes(m, split_factor, n) == {len(x) for x in shards}


def test_the_runtime_refuses_what_torch_cannot_gather() -> None:
    """Hand-written rules reach the runtime without lint: it refuses the same layouts
    (SS031, with the hint), and takes the size-1 tp version."""
    rule = RuleSpec(
        pattern="experts.w13",
        dims=("expert", "ffn", "hidden"),
        shard=(("expert", ("ep", "dp")), ("ffn", ("tp",))),
        fuse=(("ffn", (("gate", None), ("up", None)), 1),),
    )
    spec = CompiledSpec(
        name="t", axes=("dp", "ep", "tp"), sizes={}, world=None, rules=(rule,), params=None
    )
    with pytest.raises(SpecError) as e:
        spec.layout("experts.w13", {"dp": 2, "ep": 2, "tp": 2}, shape=(4, 16, 6))
    assert e.value.code == "SS031" and "torch cannot gather" in str(e.value)
    assert "ep before dp" in e.value.hint
    layout = spec.layout("experts.w13", {"dp": 2, "ep": 2, "tp": 1}, shape=(4, 16, 6))
    assert layout.shape == (4, 16, 6)
