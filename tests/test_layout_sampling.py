"""Property tests: the layout checks' sampling of the mesh (``layout.sample_boxes``) against
a walk over every rank.

Lint checks each parameter group at one rank per box of ranks that hold alike, so that its
cost does not grow with the world size. These tests draw layouts on meshes with long runs
of ordinary coordinates (axes up to 13 ranks, dimensions up to 160 rows, fused and grouped
dimensions, any axis order) and check, against every rank:

* over each box, every rank has the corner's local shape, empty dimensions and number of
  pieces per stored unit (what SS023, SS024 and SS030 read);
* :func:`representable` (SS031) names the same first rank as a walk over every rank;
* :func:`first_difference` of two layouts (the pipeline tie check) names the same first
  rank as a walk;
* the boxes cover the mesh exactly once, in rank order of their corners;
* their number does not grow with the world (the example spec at 2**10 and 2**20 ranks).
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardspec.core import layout as L
from shardspec.core.layout import (
    Dim,
    Fusion,
    Mesh,
    ParamLayout,
    _dtensor_view,
    component_indices,
    dtensor_mesh,
    dtensor_placements,
    first_difference,
    local_indices,
    module_shape,
    representable,
    sample_boxes,
    sampled_table,
    storage_units,
    torch_placement_indices,
)

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NAMES = ("a", "b", "c")


@st.composite
def fusions(draw, size_hint: int) -> tuple[int, Fusion | None]:
    kind = draw(st.sampled_from(["plain", "plain", "sized", "grouped"]))
    if kind == "plain":
        return draw(st.integers(0, size_hint)), None
    comps = tuple(
        (f"c{j}", draw(st.integers(1, 40 if kind == "sized" else 6)))
        for j in range(draw(st.integers(2, 3)))
    )
    groups = draw(st.integers(2, 24)) if kind == "grouped" else 1
    f = Fusion(comps, groups)
    return f.size, f


@st.composite
def cases(draw) -> tuple[ParamLayout, Mesh]:
    sizes = tuple(draw(st.lists(st.integers(1, 13), min_size=1, max_size=3)))
    names = NAMES[: len(sizes)]
    ndim = draw(st.integers(1, 2))
    owner = {a: draw(st.sampled_from([None, *range(ndim)])) for a in names}
    dims = []
    for d in range(ndim):
        axes = tuple(draw(st.permutations([a for a in names if owner[a] == d])))
        size, fusion = draw(fusions(160))
        dims.append(Dim(f"d{d}", size, axes, fusion))
    return ParamLayout(tuple(dims)), Mesh(names, sizes)


def _box_coords(box: L.Box):
    return itertools.product(*(range(a, b) for a, b in zip(box.lo, box.hi, strict=True)))


def _pieces(layout: ParamLayout, indices) -> tuple:
    out = []
    for comp, d in storage_units(layout):
        idx = list(indices)
        if comp is not None and d is not None:
            fusion = layout.dims[d].fusion
            assert fusion is not None
            idx[d] = component_indices(fusion, idx[d], comp)
        out.append(tuple(len(r) for r in idx))
    return tuple(out)


def _alike(layout: ParamLayout, mesh: Mesh, a, b) -> bool:
    x, y = local_indices(layout, mesh, a), local_indices(layout, mesh, b)
    shape = lambda r: tuple(L.ranges_len(i) for i in r)  # noqa: E731
    return shape(x) == shape(y) and _pieces(layout, x) == _pieces(layout, y)


def _walk_representable(layout: ParamLayout, mesh: Mesh):
    sub = dtensor_mesh(layout, mesh)
    placements = dtensor_placements(layout, mesh)
    shape = module_shape(layout, mesh)
    pos = [mesh.names.index(n) for n in sub.names]
    for coord in mesh.coords():
        want = _dtensor_view(layout, mesh, coord)
        if want != torch_placement_indices(shape, sub, placements, [coord[p] for p in pos]):
            return coord
    return None


GQA = Fusion((("q", 4), ("k", 2), ("v", 2)), 12)


@SETTINGS
@given(cases())
@example((ParamLayout((Dim("x", 100, ("b", "a")),)), Mesh(("a", "b"), (13, 3))))
@example(
    (ParamLayout((Dim("x", GQA.size, ("a",), GQA), Dim("y", 40, ("b",)))), Mesh(("a", "b"), (6, 7)))
)
@example(
    (
        ParamLayout((Dim("x", 150, ("a", "b"), Fusion((("g", 75), ("u", 75)))),)),
        Mesh(("a", "b"), (5, 4)),
    )
)
def test_boxes_hold_alike_and_cover_the_mesh(case) -> None:
    layout, mesh = case
    boxes = sample_boxes((layout,), mesh)
    corners = [mesh.rank_of(b.corner) for b in boxes]
    assert corners == sorted(corners)
    assert sum(b.size for b in boxes) == mesh.world
    seen = set()
    for box in boxes:
        for coord in _box_coords(box):
            seen.add(coord)
            assert _alike(layout, mesh, box.corner, coord), (box, coord)
    assert len(seen) == mesh.world
    table = sampled_table(layout, mesh)
    assert [t.coord for t, _ in table] == [b.corner for b in boxes]


@SETTINGS
@given(cases())
@example((ParamLayout((Dim("x", 100, ("b", "a")),)), Mesh(("a", "b"), (13, 3))))
@example((ParamLayout((Dim("x", 96, ("b", "a")), Dim("y", 7))), Mesh(("a", "b"), (4, 6))))
# Found by a search: with only the physical layout's special coordinates (not DTensor's
# reading of the placements), the first rank reported was (0, 6), not (0, 5).
@example(
    (
        ParamLayout((Dim("d0", 56, ("a", "b"), Fusion((("c0", 1), ("c1", 6)), 8)),)),
        Mesh(("a", "b"), (13, 13)),
    )
)
def test_representable_names_the_first_rank_a_walk_names(case) -> None:
    layout, mesh = case
    representable.cache_clear()
    assert representable(layout, mesh) == _walk_representable(layout, mesh)


@SETTINGS
@given(cases(), st.data())
def test_first_difference_of_two_layouts_is_the_walks(case, data) -> None:
    layout, mesh = case
    # The same dims over other axes, in another order, or fewer: a layout to compare with.
    other = []
    for dim in layout.dims:
        axes = data.draw(st.permutations(dim.axes))
        keep = data.draw(st.integers(0, len(axes)))
        other.append(Dim(dim.name, dim.size, tuple(axes[:keep]), dim.fusion))
    alias = ParamLayout(tuple(other))

    def differs(c) -> bool:
        return local_indices(layout, mesh, c) != local_indices(alias, mesh, c)

    walk = next((c for c in mesh.coords() if differs(c)), None)
    assert first_difference(layout, mesh, differs, alias) == walk


def test_box_count_does_not_grow_with_the_world() -> None:
    """The example Llama's layouts: vocab over (tp, dp_shard), hidden over dp_shard, a
    fused q/k/v dim; from 2**10 to 2**20 ranks the boxes stay as few."""
    counts = []
    for world in (1 << 10, 1 << 14, 1 << 20):
        mesh = Mesh(("dp_shard", "tp"), (world // 2, 2))
        qkv = Fusion((("q", 64), ("k", 32), ("v", 32)))
        layouts = (
            ParamLayout((Dim("vocab", 256, ("tp", "dp_shard")), Dim("hidden", 64))),
            ParamLayout((Dim("qkv", 128, ("tp", "dp_shard"), qkv), Dim("hidden", 64))),
            ParamLayout((Dim("hidden", 4096, ("dp_shard",)), Dim("ffn", 11008, ("tp",)))),
        )
        counts.append(sum(len(sample_boxes((lay,), mesh)) for lay in layouts))
    assert max(counts) <= 100, counts  # against 2**20 ranks per layout for a walk
    assert counts[1] == counts[2], counts  # once every block is small, no more boxes


def test_lint_at_a_million_ranks_samples_few_ranks(monkeypatch, tmp_path) -> None:
    """``shardspec lint -D world=1048576`` on the example Llama spec evaluates a few
    hundred shards, not a million per parameter group (the count of ``dim_indices``
    calls, which every per-rank computation goes through)."""
    from shardspec import api

    calls = 0
    real = L.dim_indices

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    L.sample_boxes.cache_clear()
    L.sampled_table.cache_clear()
    L.representable.cache_clear()
    monkeypatch.setattr(L, "dim_indices", counted)
    _results, outcome = api.lint_specs(["specs/llama.shard"], world=1 << 20)
    messages = [d.message for d in outcome.diagnostics if d.code == "SS024"]
    assert any("1048448 ranks" in m for m in messages), messages
    assert 0 < calls < 20_000, calls


def test_first_difference_steps_into_a_box() -> None:
    """Within a box the two index sets are affine in the coordinate, so they can agree at
    the corner and differ one step on: the step is then the first rank that differs.
    (An affine stand-in for two index sets: they differ from coordinate 3 on.)"""
    layout = ParamLayout((Dim("x", 130, ("a",)),))  # 13 blocks of 10: [2, 12) is one box
    mesh = Mesh(("a",), (13,))
    boxes = sample_boxes((layout,), mesh)
    assert any(b.lo == (2,) and b.hi[0] > 3 for b in boxes), boxes
    assert first_difference(layout, mesh, lambda c: c[0] >= 3) == (3,)
    assert first_difference(layout, mesh, lambda c: c[0] >= 2) == (2,)
    assert first_difference(layout, mesh, lambda c: False) is None
    box = L.Box((2, 0), (12, 4))
    assert box.steps() == [(2, 1), (3, 0)]  # innermost axis first
    assert list(box.ranks(Mesh(("a", "b"), (13, 4))))[:5] == [8, 9, 10, 11, 12]


@st.composite
def placement_pairs(draw):
    """A shape, a mesh with long runs, placements on it, and other placements on a
    sub-mesh (often the same layout spelled otherwise)."""
    ndim = draw(st.integers(1, 2))
    shape = tuple(draw(st.lists(st.integers(0, 150), min_size=ndim, max_size=ndim)))
    sizes = tuple(draw(st.lists(st.integers(1, 13), min_size=1, max_size=3)))
    mesh = Mesh(NAMES[: len(sizes)], sizes)

    def placement():
        kind = draw(st.sampled_from(["R", "S", "S", "SS"]))
        d = draw(st.integers(0, ndim - 1))
        if kind == "R":
            return L.Replicate()
        return L.Shard(d) if kind == "S" else L.StridedShard(d, draw(st.integers(1, 5)))

    placements = tuple(placement() for _ in sizes)
    names = tuple(n for n in mesh.names if draw(st.booleans()))
    same = draw(st.booleans())
    other = tuple(placements[mesh.names.index(n)] if same else placement() for n in names)
    return shape, mesh, placements, names, other


@SETTINGS
@given(placement_pairs())
# Found by a search: deciding the whole mesh as one box (corner and one step) misses the
# first difference, at (0, 0, 4); the sampled boxes find it.
@example(
    (
        (85,),
        Mesh(("a", "b", "c"), (13, 12, 12)),
        (L.Shard(0), L.Replicate(), L.Shard(0)),
        ("a", "b", "c"),
        (L.Replicate(), L.StridedShard(0, 2), L.Shard(0)),
    )
)
def test_same_layout_names_the_first_rank_a_walk_names(case) -> None:
    shape, mesh, placements, names, other = case
    sub = mesh.submesh(names)
    pos = [mesh.names.index(n) for n in names]
    walk = None
    for coord in mesh.coords():
        want = torch_placement_indices(shape, mesh, placements, coord)
        have = torch_placement_indices(shape, sub, other, [coord[p] for p in pos])
        if want != have and not L._same_empty(want, have):
            walk = (tuple(coord), want, have)
            break
    L.same_layout.cache_clear()
    assert L.same_layout(shape, mesh, placements, names, other) == walk
