"""Unit tests of ``shardspec.core.layout``: the shard arithmetic shared by compiler and runtime."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from shardspec.checks.layouts import LAYOUT_CODES
from shardspec.core import layout as layout_module
from shardspec.core.layout import (
    Dim,
    Fusion,
    LayoutError,
    LayoutProblem,
    Mesh,
    ParamLayout,
    Replicate,
    RuleSpec,
    Shard,
    StridedShard,
    box,
    build_layout,
    chunk_bounds,
    chunk_sizes,
    component_indices,
    dim_indices,
    dtensor_mesh,
    dtensor_placements,
    local_indices,
    module_shape,
    ranges_len,
    rank_table,
    representable,
    resolve_sizes,
    slice_ranges,
    storage_units,
    torch_local_shape_and_offset,
)
from shardspec.findings.codes import BY_CODE

DP_TP = Mesh(("dp_shard", "tp"), (2, 2))
SIZES = {"dp_shard": 2, "tp": 2}


def rule(dims, shard=(), fuse=(), local=(), name_indexed=(), **kw) -> RuleSpec:
    return RuleSpec(
        "p", tuple(dims), tuple(shard), tuple(fuse), tuple(local), tuple(name_indexed), **kw
    )


# --------------------------------------------------------------------------- chunks, ranges


@pytest.mark.parametrize("n", [0, 1, 5, 7, 8, 10])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
def test_chunk_bounds_is_torch_chunk(n: int, k: int) -> None:
    chunks = torch.chunk(torch.arange(n), k)
    for i in range(k):
        a, b = chunk_bounds(n, k, i)
        want = chunks[i].tolist() if i < len(chunks) else []
        assert list(range(a, b)) == want
    assert chunk_sizes(n, k) == tuple(
        len(c) for c in list(chunks) + [torch.arange(0)] * (k - len(chunks))
    )
    assert sum(chunk_sizes(n, k)) == n


def test_chunk_sizes_uneven_trailing_empty() -> None:
    # torch.chunk(range(10), 4) gives 3, 3, 3, 1; range(5) over 4 gives 2, 2, 1, 0.
    assert chunk_sizes(10, 4) == (3, 3, 3, 1)
    assert chunk_sizes(5, 4) == (2, 2, 1, 0)
    assert chunk_bounds(5, 4, 3) == (5, 5)


def test_slice_ranges() -> None:
    r = ((0, 3), (10, 14), (20, 22))  # enumerates 0 1 2 10 11 12 13 20 21
    assert slice_ranges(r, 0, 9) == r
    assert slice_ranges(r, 2, 5) == ((2, 3), (10, 12))
    assert slice_ranges(r, 3, 7) == ((10, 14),)
    assert slice_ranges(r, 7, 9) == ((20, 22),)
    assert slice_ranges(r, 4, 4) == ()
    assert slice_ranges(((0, 2), (2, 4)), 1, 3) == ((1, 3),)  # adjacent pieces merge
    assert ranges_len(r) == 9


def test_box_and_rank_shard_properties() -> None:
    assert box((((2, 5),), ((0, 4),))) == ((3, 4), (2, 0))
    assert box((((0, 1), (3, 4)),)) is None
    assert box(((),)) == ((0,), (0,))
    layout = ParamLayout((Dim("x", 3, ("dp_shard", "tp")),))
    table = rank_table(layout, DP_TP)
    assert [t.shape for t in table] == [(1,), (1,), (1,), (0,)]
    assert [t.empty for t in table] == [False, False, False, True]
    assert table[2].offset == (2,) and table[2].contiguous


# --------------------------------------------------------------------------- fusions


def test_fusion_component_ranges_and_indices() -> None:
    f = Fusion((("gate", 6), ("up", 6)))
    assert f.size == 12 and f.group_size == 12
    assert f.component_ranges("up") == ((6, 12),)
    # tp rank 1 of 2 holds gate[3:6] and up[3:6].
    held = dim_indices(Dim("ffn", 12, ("tp",), f), {"tp": 2}, {"tp": 1})
    assert held == ((3, 6), (9, 12))
    assert component_indices(f, held, "gate") == ((3, 6),)
    assert component_indices(f, held, "up") == ((3, 6),)


def test_grouped_fusion_splits_whole_groups() -> None:
    f = Fusion((("q", 4), ("k", 2), ("v", 2)), groups=2)
    assert f.group_size == 8 and f.size == 16
    assert f.component_ranges("k") == ((4, 6), (12, 14))
    assert dim_indices(Dim("qkv", 16, ("tp",), f), {"tp": 2}, {"tp": 1}) == ((8, 16),)
    # Group 1's q heads are q rows 4..8 of the stored q tensor.
    assert component_indices(f, ((8, 16),), "q") == ((4, 8),)
    assert component_indices(f, ((0, 16),), "v") == ((0, 4),)


def test_unequal_components_split_separately() -> None:
    f = Fusion((("q", 8), ("k", 4), ("v", 4)))
    got = [dim_indices(Dim("qkv", 16, ("tp",), f), {"tp": 2}, {"tp": i}) for i in range(2)]
    assert got == [((0, 4), (8, 10), (12, 14)), ((4, 8), (10, 12), (14, 16))]


# --------------------------------------------------------------------------- build_layout


def test_build_layout_equal_components() -> None:
    r = rule(["ffn", "hidden"], [("ffn", ("tp",))], [("ffn", (("gate", None), ("up", None)), 1)])
    layout = build_layout(r, (192, 64), SIZES)
    assert layout.dims[0].fusion == Fusion((("gate", 96), ("up", 96)))
    assert layout.shape == (192, 64)
    assert storage_units(layout) == [("gate", 0), ("up", 0)]


def test_build_layout_wrong_rank_is_ss021() -> None:
    with pytest.raises(LayoutError) as e:
        build_layout(rule(["a", "b"]), (4,), SIZES)
    assert e.value.problem is LayoutProblem.DIM_COUNT
    assert "shape [4]" in str(e.value)


@pytest.mark.parametrize(
    ("fuse", "size", "code"),
    [
        ((("gate", None), ("up", None)), 7, "SS050"),  # 7 does not split in 2 equal parts
        ((("q", 4), ("k", 2)), 8, "SS050"),  # sizes add up to 6, not 8
        ((("gate", 3), ("up", 3)), 6, "SS051"),  # 3 not divisible by tp=2
    ],
)
def test_build_layout_fusion_errors(fuse, size: int, code: str) -> None:
    r = rule(["f"], [("f", ("tp",))], [("f", fuse, 1)])
    with pytest.raises(LayoutError) as e:
        build_layout(r, (size,), SIZES)
    assert LAYOUT_CODES[e.value.problem] == code, e.value
    assert e.value.hint


def test_build_layout_group_errors() -> None:
    # 3 groups over tp=2: SS051; a group count below 1: SS052.
    r = rule(["f"], [("f", ("tp",))], [("f", (("q", 2), ("k", 1), ("v", 1)), 3)])
    with pytest.raises(LayoutError) as e:
        build_layout(r, (12,), SIZES)
    assert e.value.problem is LayoutProblem.COMPONENT_SPLIT
    r = rule(["f"], [("f", ("tp",))], [("f", (("q", 2), ("k", 2)), 0)])
    with pytest.raises(LayoutError) as e:
        build_layout(r, (4,), SIZES)
    assert e.value.problem is LayoutProblem.GROUP_COUNT
    # Unequal per-group components are fine when groups divide: tp splits whole groups.
    r = rule(["f"], [("f", ("tp",))], [("f", (("q", 3), ("k", 1), ("v", 1)), 2)])
    assert build_layout(r, (10,), SIZES).dims[0].fusion.groups == 2


@pytest.mark.parametrize(
    ("r", "code"),
    [
        (rule(["a"], [("b", ("tp",))]), "SS020"),
        (rule(["a"], [("a", ("pp",))]), "SS011"),
        (rule(["a", "b"], [("a", ("tp",)), ("b", ("tp",))]), "SS012"),
        (rule(["a"], [("a", ("dp_shard", "tp"))], local=["tp"]), "SS026"),
        (rule(["e", "a"], [("e", ("tp",))], name_indexed=["e"]), "SS027"),
    ],
)
def test_build_layout_rechecks_structure(r: RuleSpec, code: str) -> None:
    shape = (4,)
    with pytest.raises(LayoutError) as e:
        build_layout(r, shape, SIZES, {"e": 2})
    assert LAYOUT_CODES[e.value.problem] == code, e.value


def test_every_layout_problem_has_a_check_code() -> None:
    """The compiler reports each problem the layout arithmetic names under a code of the
    registry; the core itself carries no codes."""
    assert set(LAYOUT_CODES) == set(LayoutProblem)
    assert all(code in BY_CODE for code in LAYOUT_CODES.values())
    assert not re.search(r"SS\d{3}", inspect.getsource(layout_module))


def test_build_layout_local_axes_scale_up() -> None:
    # A Megatron-style module holding its tp shard [ffn/tp, hidden]: the global ffn is 2x.
    r = rule(["ffn", "hidden"], [("ffn", ("tp", "dp_shard"))], local=["tp"])
    layout = build_layout(r, (48, 64), SIZES)
    assert layout.shape == (96, 64)
    assert module_shape(layout, DP_TP) == (48, 64)
    assert dtensor_mesh(layout, DP_TP).names == ("dp_shard",)
    assert dtensor_placements(layout, DP_TP) == (Shard(0),)
    assert representable(layout, DP_TP) is None
    # Rank (dp 1, tp 1) holds global rows 72..96 = rows 24..48 of its module tensor.
    assert local_indices(layout, DP_TP, (1, 1)) == (((72, 96),), ((0, 64),))


def test_name_indexed_dims() -> None:
    mesh = Mesh(("dp_shard", "ep"), (2, 2))
    r = rule(
        ["expert", "ffn", "hidden"],
        [("expert", ("ep",)), ("ffn", ("dp_shard",))],
        local=["ep"],
        name_indexed=["expert"],
    )
    layout = build_layout(r, (32, 64), {"dp_shard": 2, "ep": 2}, {"expert": 4})
    assert layout.shape == (8, 32, 64)
    assert [d.name for d in layout.tensor_dims()] == ["ffn", "hidden"]
    assert module_shape(layout, mesh) == (32, 64)
    assert dtensor_placements(layout, mesh) == (Shard(0),)
    table = rank_table(layout, mesh)
    # EP rank r holds global experts 4r..4r+4; dp splits ffn.
    assert [t.indices[0] for t in table] == [((0, 4),), ((4, 8),), ((0, 4),), ((4, 8),)]
    assert [t.indices[1] for t in table] == [((0, 16),), ((0, 16),), ((16, 32),), ((16, 32),)]
    assert representable(layout, mesh) is None


def test_any_rank_rule_replicates() -> None:
    layout = build_layout(rule([], any_rank=True), (2, 128), SIZES)
    assert layout.shape == (2, 128) and layout.axes == ()
    assert dtensor_placements(layout, DP_TP) == (Replicate(), Replicate())
    assert all(t.indices == (((0, 2),), ((0, 128),)) for t in rank_table(layout, DP_TP))


# --------------------------------------------------------------------------- DTensor view


def test_fsdp_over_tp_is_strided_and_representable() -> None:
    layout = ParamLayout((Dim("vocab", 8, ("tp", "dp_shard")), Dim("hidden", 4)))
    assert dtensor_placements(layout, DP_TP) == (StridedShard(0, 2), Shard(0))
    assert representable(layout, DP_TP) is None
    # tp outer: tp rank t holds rows 4t..4t+4, dp then halves that block.
    got = [t.indices[0] for t in rank_table(layout, DP_TP)]
    assert got == [((0, 2),), ((4, 6),), ((2, 4),), ((6, 8),)]


def test_tp_over_fsdp_is_plain() -> None:
    layout = ParamLayout((Dim("x", 8, ("dp_shard", "tp")),))
    assert dtensor_placements(layout, DP_TP) == (Shard(0), Shard(0))
    assert representable(layout, DP_TP) is None


def test_fused_with_fsdp_on_hidden_is_representable() -> None:
    # Llama's w13: gate/up over tp, FSDP on hidden.
    layout = ParamLayout(
        (
            Dim("ffn", 8, ("tp",), Fusion((("gate", 4), ("up", 4)))),
            Dim("hidden", 4, ("dp_shard",)),
        )
    )
    assert dtensor_placements(layout, DP_TP) == (Shard(1), StridedShard(0, 2))
    assert representable(layout, DP_TP) is None


def test_fused_and_fsdp_on_the_same_dim_is_not_representable() -> None:
    mesh = Mesh(("dp_shard", "tp"), (4, 2))
    layout = ParamLayout((Dim("ffn", 16, ("tp", "dp_shard"), Fusion((("gate", 8), ("up", 8)))),))
    assert representable(layout, mesh) is not None
    # The physical layout itself is fine: tp rank t holds gate[4t:4t+4] and up[4t:4t+4],
    # and dp quarters that block, so dp ranks 0-1 hold gate rows and 2-3 up rows.
    table = rank_table(layout, mesh)
    by_coord = {t.coord: t.indices[0] for t in table}
    assert by_coord[(0, 1)] == ((4, 6),)
    assert by_coord[(2, 1)] == ((12, 14),)
    assert sorted(r for t in table for r in t.indices[0]) == [(i, i + 2) for i in range(0, 16, 2)]


def test_torch_local_shape_and_offset_empty_shard() -> None:
    mesh = Mesh(("a",), (4,))
    # 3 rows over 4 ranks: the last is empty and torch reports the dim size as its offset.
    assert torch_local_shape_and_offset((3, 2), mesh, (Shard(0),), (3,)) == ((0, 2), (3, 0))
    assert torch_local_shape_and_offset((3, 2), mesh, (Shard(0),), (1,)) == ((1, 2), (1, 0))


# --------------------------------------------------------------------------- meshes, sizes


def test_mesh_coords_round_trip() -> None:
    mesh = Mesh(("a", "b", "c"), (2, 3, 2))
    coords = list(mesh.coords())
    assert len(coords) == mesh.world == 12
    for rank, coord in enumerate(coords):
        assert mesh.coord_of(rank) == coord
        assert mesh.rank_of(coord) == rank
    assert mesh.submesh(["c", "a"]) == Mesh(("c", "a"), (2, 2))


def test_resolve_sizes() -> None:
    assert resolve_sizes(("dp", "tp"), (None, 2), 8) == (4, 2)
    assert resolve_sizes(("dp", "tp"), (4, 2), 8) == (4, 2)
    assert resolve_sizes(("dp", "tp"), (4, 2), None) == (4, 2)


@pytest.mark.parametrize(
    ("sizes", "world", "needle"),
    [
        ((None, None), 8, "at most one"),
        ((4, 4), 8, "16 ranks"),
        ((None, 2), None, "no world size"),
        ((None, 3), 8, "not divisible"),
        ((None, 0), 8, "not divisible"),
    ],
)
def test_resolve_sizes_errors(sizes, world, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        resolve_sizes(("dp", "tp"), sizes, world)
