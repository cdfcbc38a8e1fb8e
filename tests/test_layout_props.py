"""Property tests: ``shardspec.core.layout``'s shard arithmetic against torch's own.

Single process, no process group: torch's placement arithmetic is exercised through the
pieces that need no mesh (``_compute_local_shape_and_global_offset`` with a plain mesh shape
and coordinate, ``Shard``/``_StridedShard`` ``_split_tensor`` and
``local_shard_size_and_offset``, ``torch.chunk``).

(a) random shapes, meshes and placements: our simulation of DTensor's left-to-right
    placement semantics equals torch's, shapes, first offsets and full index sets;
(b) random parameter layouts (fused, grouped, local and name-indexed dims, any axis order):
    every element is held exactly ``replication`` times, each rank's indices follow nested
    ``torch.chunk``, and whenever :func:`representable` says yes, a DTensor with
    :func:`dtensor_placements` holds exactly the physical indices on every rank (and when it
    says no, it really does not).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from shardspec.core import layout as L
from shardspec.core.layout import (
    Dim,
    Fusion,
    LayoutError,
    LayoutProblem,
    Mesh,
    ParamLayout,
    Placement,
    Ranges,
    RuleSpec,
    _block,
    _dtensor_view,
    _strided,
    build_layout,
    dtensor_mesh,
    dtensor_placements,
    local_indices,
    module_shape,
    rank_table,
    representable,
    same_layout,
    torch_local_shape_and_offset,
    torch_placement_indices,
)
from shardspec.runtime.dtensor import to_torch

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
AXIS_NAMES = ("a", "b", "c")


# --------------------------------------------------------------------------- torch oracles


def flat(r: Ranges) -> list[int]:
    """The indices a range tuple enumerates, in order."""
    return [x for a, b in r for x in range(a, b)]


def torch_split(t: torch.Tensor, placement: Shard, n: int, i: int) -> torch.Tensor:
    """Shard ``i`` of ``n`` of ``t`` under ``placement``, by torch's own splitting code."""
    shards, _ = placement._split_tensor(t, n, with_padding=False, contiguous=True)
    assert len(shards) == n
    return shards[i]


def strided_offsets(p: _StridedShard, size: int, n: int, i: int) -> tuple[int, list[int]]:
    """``_StridedShard.local_shard_size_and_offset`` with every offset (torch 2.11 and 2.13)."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShardOffsetMode
    except ImportError:  # torch 2.11: the flag was a boolean
        size_, offsets = p.local_shard_size_and_offset(size, n, i, return_first_offset=False)
    else:
        size_, offsets = p.local_shard_size_and_offset(
            size, n, i, offset_mode=_StridedShardOffsetMode.ALL
        )
    return int(size_), [int(x) for x in offsets]


def chunk_of(idx: torch.Tensor, n: int, i: int) -> torch.Tensor:
    """``torch.chunk(idx, n)[i]`` with the empty trailing chunks torch leaves out."""
    chunks = torch.chunk(idx, n)
    return chunks[i] if i < len(chunks) else idx[:0]


def physical_oracle(layout: ParamLayout, sizes: dict[str, int], coord: dict[str, int]):
    """Per dim, the global indices a rank holds, computed with torch.chunk directly from the
    documented semantics (independent of ``shardspec.core.layout``'s range arithmetic)."""
    out = []
    for dim in layout.dims:
        idx = torch.arange(dim.size)
        for k, axis in enumerate(dim.axes):
            n, i = sizes[axis], coord[axis]
            f = dim.fusion
            if k == 0 and f is not None and f.groups > 1:
                idx = chunk_of(idx.view(f.groups, f.group_size), n, i).reshape(-1)
            elif k == 0 and f is not None:
                comps = torch.split(idx, [s for _, s in f.components])
                idx = torch.cat([chunk_of(c, n, i) for c in comps])
            else:
                idx = chunk_of(idx, n, i)
        out.append(idx.tolist())
    return out


def torch_dim_indices(
    shape: Sequence[int], placements: Sequence[Placement], mesh_sizes: Sequence[int], coord
) -> list[list[int]]:
    """Per dim, the indices torch's own split code gives the rank at ``coord``: the dim's
    placements applied left to right to a 1-D arange (dims shard independently)."""
    out = []
    for d, size in enumerate(shape):
        idx = torch.arange(size)
        for p, n, i in zip(placements, mesh_sizes, coord, strict=True):
            if not isinstance(p, L.Replicate) and p.dim == d:
                idx = torch_split(idx, to_torch(dataclasses.replace(p, dim=0)), n, i)
        out.append(idx.tolist())
    return out


def select(t: torch.Tensor, ranges: Sequence[Ranges]) -> torch.Tensor:
    """``t`` at the given per-dim index ranges."""
    for d, r in enumerate(ranges):
        t = t.index_select(d, torch.tensor(flat(r), dtype=torch.long))
    return t


# --------------------------------------------------------------------------- (a) placements


@st.composite
def placement_cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim)))
    mesh_sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = []
    for _ in mesh_sizes:
        kind = draw(st.sampled_from(["R", "S", "SS"]))
        d = draw(st.integers(0, ndim - 1))
        if kind == "R":
            placements.append(L.Replicate())
        elif kind == "S":
            placements.append(L.Shard(d))
        else:
            placements.append(L.StridedShard(d, draw(st.integers(1, 4))))
    return shape, mesh_sizes, tuple(placements)


@SETTINGS
@given(placement_cases())
def test_placement_simulation_matches_torch(case) -> None:
    shape, mesh_sizes, placements = case
    mesh = Mesh(AXIS_NAMES[: len(mesh_sizes)], mesh_sizes)
    tp = [to_torch(p) for p in placements]
    full = torch.arange(math.prod(shape)).view(shape)
    for coord in mesh.coords():
        ours = torch_local_shape_and_offset(shape, mesh, placements, coord)
        theirs = _compute_local_shape_and_global_offset(shape, mesh_sizes, list(coord), tp)
        assert ours == (tuple(theirs[0]), tuple(theirs[1])), (coord, ours, theirs)
        # Full index sets: torch's own split code, applied left to right on an arange.
        want = full
        for p, n, i in zip(tp, mesh_sizes, coord, strict=True):
            if not isinstance(p, Replicate):
                want = torch_split(want, p, n, i)
        got = torch_placement_indices(shape, mesh, placements, coord)
        assert torch.equal(select(full, got), want), (coord, got)
        assert [flat(r) for r in got] == torch_dim_indices(shape, placements, mesh_sizes, coord)


@SETTINGS
@given(
    size=st.integers(0, 40),
    n=st.integers(1, 5),
    sf=st.integers(1, 5),
    data=st.data(),
)
def test_single_split_matches_torch(size: int, n: int, sf: int, data) -> None:
    """One step on an already-sharded dim (a non-trivial range set): ``_block`` is torch.chunk
    and Shard's size/offset, ``_strided`` is _StridedShard's full offset list."""
    cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=3)))
    # A range set enumerating `size` indices in pieces: [0, c0), [c0 + 100, ...), ...
    bounds = [0, *cuts, size]
    r = tuple(
        (a + 100 * k, b + 100 * k) for k, (a, b) in enumerate(itertools.pairwise(bounds)) if a < b
    )
    seq = flat(r)
    assert len(seq) == size
    for i in range(n):
        block = flat(_block(r, n, i))
        assert block == chunk_of(torch.tensor(seq, dtype=torch.long), n, i).tolist()
        ssize, soff = Shard.local_shard_size_and_offset(size, n, i)
        assert len(block) == ssize
        assert block == seq[soff : soff + ssize]
        strided = flat(_strided(r, sf, n, i))
        want_size, want_offsets = strided_offsets(_StridedShard(0, split_factor=sf), size, n, i)
        assert len(strided) == want_size
        assert strided == [seq[o] for o in want_offsets]


# --------------------------------------------------------------------------- (b) layouts


MESH_SIZES = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


@st.composite
def layouts(
    draw, mesh_sizes_strategy: st.SearchStrategy[tuple[int, ...]] = MESH_SIZES, crowd: int = 0
):
    """A random rule, module shape and mesh (sizes drawn from ``mesh_sizes_strategy``),
    built with ``build_layout``. ``crowd`` > 0 weighs each axis's choice of dimension that
    many times more towards the first one, and leaves half the dims without local axes, so
    that several DTensor axes cut one dimension.

    Returns ``(layout, mesh, info)``, or ``(None, error, info)`` when ``build_layout``
    refused (then ``info`` says whether it had to).
    """
    mesh_sizes = draw(mesh_sizes_strategy)
    names = AXIS_NAMES[: len(mesh_sizes)]
    sizes = dict(zip(names, mesh_sizes, strict=True))
    ndim = draw(st.integers(1, 3))
    has_name_indexed = draw(st.booleans())
    dims = [f"d{i}" for i in range(ndim)]
    # Each mesh axis shards at most one dim (or none); a name-indexed dim only takes local axes.
    choices = [*[dims[0]] * crowd, None, *dims, *(["v"] if has_name_indexed else [])]
    owner = {a: draw(st.sampled_from(choices)) for a in names}
    all_dims = (["v"] if has_name_indexed else []) + dims
    order = {}
    for d in all_dims:
        mine = [a for a in names if owner[a] == d]
        order[d] = tuple(draw(st.permutations(mine))) if mine else ()
    local: set[str] = set()
    for d in all_dims:
        if d == "v":
            local.update(order[d])
        elif order[d] and not crowd:  # crowded: no local axes but a name-indexed dim's
            local.update(order[d][: draw(st.integers(0, len(order[d])))])
    if has_name_indexed and not order["v"]:
        has_name_indexed = False  # a name-indexed dim needs a local axis; drop it
        all_dims = dims
    # Module shape and at most one fused dim.
    fused_dim = draw(st.sampled_from([None, *dims]))
    fuse = ()
    shape = []
    info: dict = {}
    for d in dims:
        axes = order[d]
        lf = math.prod(sizes[a] for a in axes if a in local)
        if d != fused_dim:
            if draw(st.booleans()):  # evenly divisible by all its axes
                unit = math.prod(sizes[a] for a in axes)
                shape.append(draw(st.integers(1, 3)) * unit // lf)
            else:
                shape.append(draw(st.integers(0, 4)) * lf if lf > 1 else draw(st.integers(0, 12)))
            continue
        kind = draw(st.sampled_from(["equal", "sized", "grouped"]))
        ncomp = draw(st.integers(2, 3))
        unit = math.prod(sizes[a] for a in axes) if axes else 1
        even = draw(st.booleans()) or lf > 1  # local axes must divide evenly
        groups = 1
        if kind == "grouped":
            groups = unit * draw(st.integers(1, 2)) if even else draw(st.integers(2, 4))
        csizes = [draw(st.integers(1, 3)) * (unit if even and groups == 1 else 1)]
        if kind == "equal" or (kind == "grouped" and draw(st.booleans())):
            csizes = csizes * ncomp  # equal parts, sizes left to the layout
            comps = tuple((f"c{j}", None) for j in range(ncomp))
        else:
            csizes += [
                draw(st.integers(1, 3)) * (unit if even and groups == 1 else 1)
                for _ in range(ncomp - 1)
            ]
            comps = tuple((f"c{j}", s) for j, s in enumerate(csizes))
        total = sum(csizes) * groups
        fuse = ((d, comps, groups),)
        info = {"csizes": csizes, "groups": groups, "first": sizes[axes[0]] if axes else None}
        assert total % lf == 0
        shape.append(total // lf)
    rule = RuleSpec(
        pattern="p",
        dims=tuple(all_dims),
        shard=tuple((d, order[d]) for d in all_dims if order[d]),
        fuse=fuse,
        local=tuple(sorted(local)),
        name_indexed=("v",) if has_name_indexed else (),
    )
    counts = {"v": draw(st.integers(1, 3))} if has_name_indexed else None
    mesh = Mesh(names, mesh_sizes)
    try:
        layout = build_layout(rule, tuple(shape), sizes, counts)
    except LayoutError as e:
        return None, e, info
    return layout, mesh, info


def _coord_dict(mesh: Mesh, coord: Sequence[int]) -> dict[str, int]:
    return dict(zip(mesh.names, coord, strict=True))


def _must_refuse(info: dict) -> bool:
    """Whether the drawn fusion breaks SS050/SS051 (component or group divisibility)."""
    first = info.get("first")
    if first is None:
        return False
    if info["groups"] > 1:
        return info["groups"] % first != 0
    return any(s % first for s in info["csizes"])


def _case(
    ok: bool, dims: tuple[Dim, ...], names: tuple[str, ...], sizes: tuple[int, ...], local=()
):
    """A hand-written example; ``ok``: whether DTensor placements can describe it."""
    return ParamLayout(dims, frozenset(local)), Mesh(names, sizes), {"representable": ok}


GATE_UP = Fusion((("gate", 4), ("up", 4)))


@settings(SETTINGS, max_examples=1000)
@given(layouts())
# FSDP over TP: representable with _StridedShard.
@example(_case(True, (Dim("x", 8, ("b", "a")), Dim("y", 3)), ("a", "b"), (2, 2)))
# Uneven FSDP over TP.
@example(_case(True, (Dim("x", 5, ("b", "a")),), ("a", "b"), (2, 2)))
# Fused gate/up over b, then FSDP on a on the same dim: not representable.
@example(_case(False, (Dim("x", 8, ("b", "a"), GATE_UP),), ("a", "b"), (2, 2)))
# Unequal components over one axis: not representable.
@example(_case(False, (Dim("x", 6, ("a",), Fusion((("q", 4), ("k", 2)))),), ("a",), (2,)))
# Fused per component over a local axis, then FSDP: representable.
@example(_case(True, (Dim("x", 8, ("b", "a"), GATE_UP), Dim("y", 2)), ("a", "b"), (2, 2), ("b",)))
# Grouped GQA layout over tp then FSDP (Llama's wqkv).
@example(
    _case(
        True,
        (Dim("qkv", 16, ("b", "a"), Fusion((("q", 4), ("k", 2), ("v", 2)), 2)), Dim("h", 2)),
        ("a", "b"),
        (2, 2),
    )
)
# A name-indexed expert dim over a local axis, FSDP on the next dim.
@example(
    _case(
        True,
        (Dim("e", 4, ("b",), name_indexed=True), Dim("f", 6, ("a",)), Dim("h", 2)),
        ("a", "b"),
        (3, 2),
        ("b",),
    )
)
def test_layout_properties(case) -> None:
    layout, mesh, info = case
    if layout is None:
        assert isinstance(mesh, LayoutError)
        assert mesh.problem is LayoutProblem.COMPONENT_SPLIT and _must_refuse(info), mesh
        return
    assert not _must_refuse(info), (layout, info)
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    used = set(layout.axes)
    replication = math.prod(s for n, s in sizes.items() if n not in used)

    # 1. Every element is held exactly `replication` times; per-rank indices follow nested
    #    torch.chunk (an oracle written with torch directly).
    counts = torch.zeros(layout.shape, dtype=torch.long)
    table = rank_table(layout, mesh)
    assert [t.coord for t in table] == list(mesh.coords())
    for shard in table:
        c = _coord_dict(mesh, shard.coord)
        assert shard.indices == local_indices(layout, mesh, shard.coord)
        oracle = physical_oracle(layout, sizes, c)
        assert [flat(r) for r in shard.indices] == oracle, (shard.coord, shard.indices)
        for r in shard.indices:  # strictly increasing, disjoint, merged ranges
            assert all(a < b for a, b in r)
            assert all(r[k][1] < r[k + 1][0] for k in range(len(r) - 1))
        idx = [torch.tensor(flat(r), dtype=torch.long) for r in shard.indices]
        if all(len(x) for x in idx):
            counts[torch.meshgrid(*idx, indexing="ij")] += 1
    assert torch.all(counts == replication), counts

    # 2. The module tensor's shape: what a rank holds before DTensor sharding.
    mshape = module_shape(layout, mesh)
    assert len(mshape) == len(layout.tensor_dims())

    # 3. DTensor placements vs the physical layout, with torch's own splitting.
    bad = representable(layout, mesh)
    if "representable" in info:
        assert (bad is None) == info["representable"], (layout, bad)
    placements = dtensor_placements(layout, mesh)
    sub = dtensor_mesh(layout, mesh)
    assert set(sub.names) == set(mesh.names) - layout.local
    sub_pos = [mesh.names.index(n) for n in sub.names]
    full = torch.arange(math.prod(mshape)).view(mshape)
    tp = [to_torch(p) for p in placements]
    for coord in mesh.coords():
        sub_coord = [coord[p] for p in sub_pos]
        view = _dtensor_view(layout, mesh, coord)
        assert tuple(len(flat(r)) for r in view) == tuple(
            len(flat(r))
            for d, r in zip(layout.dims, local_indices(layout, mesh, coord), strict=True)
            if not d.name_indexed
        )
        real = full
        for p, n, i in zip(tp, sub.sizes, sub_coord, strict=True):
            if not isinstance(p, Replicate):
                real = torch_split(real, p, n, i)
        # Per dim too: an empty dim elsewhere would hide differences in the full tensor.
        per_dim = torch_dim_indices(mshape, placements, sub.sizes, sub_coord)
        agrees = per_dim == [flat(r) for r in view]
        if bad is None:
            assert agrees, (coord, view, per_dim, placements)
            assert torch.equal(select(full, view), real), (coord, view, placements)
            assert torch_placement_indices(mshape, sub, placements, sub_coord) == view
            shape, offset = _compute_local_shape_and_global_offset(mshape, sub.sizes, sub_coord, tp)
            assert tuple(shape) == tuple(len(flat(r)) for r in view)
            sharded = {p.dim for p in placements if not isinstance(p, L.Replicate)}
            for d, r in enumerate(view):
                if r and d in sharded:
                    assert offset[d] == r[0][0]
        elif tuple(coord) == bad:
            assert not agrees, (coord, view, placements)

    # 4. Completeness: even layouts without a per-component split over several DTensor
    #    axes are always representable.
    if _even(layout, sizes) and not _per_component_then_more(layout):
        assert bad is None, (layout, mesh, placements)


def _even(layout: ParamLayout, sizes: dict[str, int]) -> bool:
    for d in layout.dims:
        unit = math.prod(sizes[a] for a in d.axes)
        if d.size % unit:
            return False
        f = d.fusion
        if f is not None and d.axes:
            first = sizes[d.axes[0]]
            if f.groups > 1 and f.groups % first:
                return False
            if f.groups == 1 and any(s % unit for _, s in f.components):
                return False
    return True


def _per_component_then_more(layout: ParamLayout) -> bool:
    """A fused (ungrouped) dim split per component by a DTensor axis: representable only
    with equal components and that single axis."""
    for d in layout.tensor_dims():
        f = d.fusion
        if f is None or f.groups > 1 or not d.axes or d.axes[0] in layout.local:
            continue
        sizes_ = {s for _, s in f.components}
        if len(d.axes) > 1 or len(sizes_) > 1:
            return True
    return False


# --------------------------------------------------------------------------- same_layout


@SETTINGS
@given(placement_cases(), st.data())
def test_same_layout_compares_what_torch_holds(case, data) -> None:
    """``same_layout`` (what ``verify`` and checkpoints use) says two spellings agree
    exactly when torch's own split code gives every rank the same elements: one spelling
    on the whole mesh, the other on a sub-mesh of some of its axes (the rest replicated)
    with placements drawn afresh, or the first one's own on those axes."""
    shape, mesh_sizes, placements = case
    mesh = Mesh(AXIS_NAMES[: len(mesh_sizes)], mesh_sizes)
    keep = data.draw(st.lists(st.booleans(), min_size=len(mesh_sizes), max_size=len(mesh_sizes)))
    names = tuple(n for n, k in zip(mesh.names, keep, strict=True) if k)
    if data.draw(st.booleans()):
        other = tuple(p for p, k in zip(placements, keep, strict=True) if k)
    else:
        other = tuple(
            data.draw(
                st.sampled_from(
                    [L.Replicate()]
                    + [L.Shard(d) for d in range(len(shape))]
                    + [L.StridedShard(d, f) for d in range(len(shape)) for f in (1, 2, 3)]
                )
            )
            for _ in names
        )
    full = torch.arange(math.prod(shape)).view(shape)

    def held(ps: tuple, axes: tuple[str, ...], coord: tuple[int, ...]) -> torch.Tensor:
        out = full
        for p, axis in zip(ps, axes, strict=True):
            i = mesh.names.index(axis)
            if not isinstance(p, L.Replicate):
                out = torch_split(out, to_torch(p), mesh_sizes[i], coord[i])
        return out

    agree = all(
        torch.equal(held(placements, mesh.names, c), held(other, names, c)) for c in mesh.coords()
    )
    got = same_layout(shape, mesh, placements, names, other)
    assert (got is None) == agree, (names, other, got)
