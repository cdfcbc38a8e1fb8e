"""Every layout the compiler can emit, through torch's own DTensor operations (run on gloo
ranks by tests/test_layout_torch.py).

One spawn runs a whole hypothesis search: rank 0 draws each example (a layout the compiler
emits, and a second one of the same tensor on the same mesh) and broadcasts it; every rank
then puts its module tensor through ``distribute_tensor`` with the compiler's placements,
compares what torch puts on it with the compiler's rank table (values, local shape, global
offset), gathers it back with ``full_tensor`` and ``redistribute`` to ``Replicate``, and
redistributes it to the second layout; rank 0 gathers every rank's findings and asserts, so
hypothesis shrinks a failure with all ranks in step. The global tensor is an ``arange``, so
equal values mean equal indices.
"""

from __future__ import annotations

import itertools
import math
import traceback
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardspec.core import layout as L
from shardspec.core.layout import (
    SCATTER,
    Dim,
    Fusion,
    LayoutError,
    Mesh,
    ParamLayout,
    Ranges,
    RuleSpec,
    build_layout,
    dim_indices,
    dtensor_mesh,
    dtensor_placements,
    module_shape,
    rank_table,
    representable,
    torch_problem,
    torch_shard_order,
)
from shardspec.runtime.dtensor import redistribute, to_torch
from tests.test_layout_props import AXIS_NAMES, flat, layouts

# A case: the mesh's sizes, the layout, and a second layout of the same module tensor on the
# same DTensor mesh (``None``: no second one was drawn that the compiler emits).
Case = tuple[tuple[int, ...], ParamLayout, ParamLayout | None]


def mesh_shapes(world: int) -> list[tuple[int, ...]]:
    """Every mesh of 1 to 3 axes (size-1 axes included) with ``world`` ranks."""
    sizes = [d for d in range(1, world + 1) if world % d == 0]
    return [
        combo
        for k in range(1, len(AXIS_NAMES) + 1)
        for combo in itertools.product(sizes, repeat=k)
        if math.prod(combo) == world
    ]


def emitted(layout: ParamLayout | None, mesh: Mesh) -> bool:
    """Whether the compiler emits ``layout`` (lint and the runtime refuse it otherwise)."""
    if layout is None:
        return False
    return representable(layout, mesh) is None and torch_problem(layout, mesh) is None


@st.composite
def relayout(draw, layout: ParamLayout, mesh: Mesh) -> ParamLayout | None:
    """The same parameter (dims, fusion, local axes and module tensor) with its non-local
    axes drawn afresh, built by ``build_layout``; ``None`` where it refuses."""
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    tensor_dims = [d.name for d in layout.tensor_dims()]
    free = [a for a in mesh.names if a not in layout.local]
    owner = {a: draw(st.sampled_from([None, *tensor_dims])) for a in free}
    shard = []
    for d in layout.dims:
        mine = [a for a in free if owner[a] == d.name]
        axes = tuple(a for a in d.axes if a in layout.local) + tuple(draw(st.permutations(mine)))
        if axes:
            shard.append((d.name, axes))
    fuse = tuple(
        (d.name, tuple((c, s) for c, s in d.fusion.components), d.fusion.groups)
        for d in layout.dims
        if d.fusion is not None
    )
    rule = RuleSpec(
        pattern="p",
        dims=tuple(d.name for d in layout.dims),
        shard=tuple(shard),
        fuse=fuse,
        local=tuple(sorted(layout.local)),
        name_indexed=tuple(d.name for d in layout.dims if d.name_indexed),
    )
    counts = {
        d.name: d.size // math.prod(sizes[a] for a in d.axes) for d in layout.dims if d.name_indexed
    }
    try:
        return build_layout(rule, module_shape(layout, mesh), sizes, counts)
    except LayoutError:
        return None


@st.composite
def cases(draw, world: int) -> tuple[str, Any]:
    """``("emitted", case)`` for a layout the compiler emits; ``("refused", (layout, mesh))``
    for one it refuses (checked without torch); ``("invalid", error)`` when
    ``build_layout`` refused the rule."""
    # Two times in three, crowd several axes of size > 1 onto one dimension and keep only
    # layouts with a _StridedShard (where torch's operations fall short); few others have one.
    crowd = draw(st.sampled_from([0, 8, 8]))
    shapes = [m for m in mesh_shapes(world) if not crowd or sum(s > 1 for s in m) > 1]
    layout, mesh, _ = draw(layouts(st.sampled_from(shapes), crowd))
    if layout is None:
        return "invalid", mesh
    if crowd:
        assume(any(isinstance(p, L.StridedShard) for p in dtensor_placements(layout, mesh)))
    if not emitted(layout, mesh):
        return "refused", (layout, mesh)
    other = draw(relayout(layout, mesh))
    return "emitted", (mesh.sizes, layout, other if emitted(other, mesh) else None)


# --------------------------------------------------------------------------- one rank's side


def _select(t: torch.Tensor, ranges: Sequence[Ranges]) -> torch.Tensor:
    for d, r in enumerate(ranges):
        t = t.index_select(d, torch.tensor(flat(r), dtype=torch.long))
    return t


def _module_block(layout: ParamLayout, mesh: Mesh, coord: Sequence[int]) -> list[Ranges]:
    """Per dim, the global indices of the tensor the module holds (its local-axis block)."""
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    c = dict(zip(mesh.names, coord, strict=True))
    out = []
    for d in layout.dims:
        local = tuple(a for a in d.axes if a in layout.local)
        out.append(dim_indices(Dim(d.name, d.size, local, d.fusion), sizes, c))
    return out


def _drop_name_indexed(layout: ParamLayout, t: torch.Tensor) -> torch.Tensor:
    """One module's tensor: the first of the rank's name-indexed modules (index 0 of each
    name-indexed dim of ``t``), those dims dropped."""
    for i in reversed(range(len(layout.dims))):
        if layout.dims[i].name_indexed:
            t = t.select(i, 0)
    return t


def settle(e: BaseException) -> None:
    """Forget a failed torch operation: wait for every collective it issued and never
    waited for (torch's functional collectives keep such work, and with it the process
    group and its gloo threads, in a registry until someone waits for its tensor), then drop
    the frames' locals (a DTensor or mesh kept there outlives the teardown)."""
    tb = e.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, torch.Tensor):
                try:
                    torch.ops._c10d_functional.wait_tensor(getattr(value, "elem", value))
                except Exception:
                    pass
        tb = tb.tb_next
    traceback.clear_frames(e.__traceback__)


class Meshes:
    """DeviceMeshes by sizes, and their DTensor sub-meshes by axis names, built once."""

    def __init__(self) -> None:
        self.full: dict[tuple[int, ...], DeviceMesh] = {}
        self.sub: dict[tuple[tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}

    def get(self, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        if sizes not in self.full:
            self.full[sizes] = init_device_mesh(
                "cpu", sizes, mesh_dim_names=AXIS_NAMES[: len(sizes)]
            )
        key = (sizes, names)
        if key not in self.sub:
            self.sub[key] = self.full[sizes][names]
        return self.sub[key]

    def clear(self) -> None:
        self.full.clear()
        self.sub.clear()


def run_case(case: Case, meshes: Meshes, rank: int) -> tuple[list[str], Counter]:
    """Put this rank's tensor through torch's operations; return what differed from the
    compiler (``[]``: nothing), and what the case exercised."""
    sizes, layout, other = case
    mesh = Mesh(AXIS_NAMES[: len(sizes)], sizes)
    coord = mesh.coord_of(rank)
    fails: list[str] = []
    seen: Counter = Counter()

    def check(what: str, ok: bool, detail: object = "") -> None:
        if not ok:
            fails.append(f"rank {rank} {coord}: {what} {detail}")

    full = torch.arange(math.prod(layout.shape), dtype=torch.int64).view(layout.shape)
    block = _module_block(layout, mesh, coord)
    module = _drop_name_indexed(layout, _select(full, block))
    check("module shape", tuple(module.shape) == module_shape(layout, mesh), module.shape)
    sub = dtensor_mesh(layout, mesh)
    if not sub.names:
        return fails, seen
    device_mesh = meshes.get(sizes, sub.names)
    placements = dtensor_placements(layout, mesh)
    seen["strided"] += any(isinstance(p, L.StridedShard) for p in placements)
    seen["size-1 axis"] += 1 in sub.sizes
    seen["fused"] += any(d.fusion is not None for d in layout.dims)
    seen["local"] += bool(layout.local)
    seen["uneven"] += any(
        d.size % math.prod(mesh.size(a) for a in d.axes) for d in layout.dims if d.axes
    )
    for p, n in zip(placements, sub.sizes, strict=True):
        check("a size-1 axis cuts", n > 1 or isinstance(p, L.Replicate), placements)

    def expect(lay: ParamLayout) -> torch.Tensor:
        """What the compiler's rank table says this rank holds of ``lay``."""
        return _drop_name_indexed(lay, _select(full, rank_table(lay, mesh)[rank].indices))

    def held(what: str, got: torch.Tensor, lay: ParamLayout) -> None:
        want = expect(lay)
        check(what, got.shape == want.shape and torch.equal(got, want), (got, want))

    # Torch's distribute_tensor cannot scatter an uneven _StridedShard from one rank (lint
    # says so in SS023's hint); every rank holds the whole tensor here, so split it locally.
    scatter = torch_problem(layout, mesh, SCATTER) is None
    seen["uneven _StridedShard"] += not scatter
    try:
        ps = [to_torch(p) for p in placements]
        d = distribute_tensor(module, device_mesh, ps, src_data_rank=0 if scatter else None)
        held("distribute_tensor", d.to_local(), layout)
        shape, offset = compute_local_shape_and_global_offset(module.shape, device_mesh, ps)
        table = rank_table(layout, mesh)[rank]
        tensor_ranges = [
            r for r, dim in zip(table.indices, layout.dims, strict=True) if not dim.name_indexed
        ]
        check("local shape", tuple(shape) == tuple(map(L.ranges_len, tensor_ranges)), shape)
        blocks = [b for b, dim in zip(block, layout.dims, strict=True) if not dim.name_indexed]
        for r, b, off in zip(tensor_ranges, blocks, offset, strict=True):
            if r:  # torch's offset within the module's block is the table's first index
                check("global offset", flat(b)[off] == r[0][0], (offset, table.offset))
        check("full_tensor", torch.equal(d.full_tensor(), module))
        back = d.redistribute(device_mesh, [Replicate()] * len(ps)).to_local()
        check("redistribute to Replicate", torch.equal(back, module))
        if other is not None:
            target = [to_torch(p) for p in dtensor_placements(other, mesh)]
            moved = redistribute(d, target)
            held("redistribute to the other layout", moved.to_local(), other)
            check("full_tensor of the other layout", torch.equal(moved.full_tensor(), module))
            seen["redistribute to another layout"] += 1
            order = [
                torch_shard_order(ps_, sub.sizes)
                for ps_ in (placements, dtensor_placements(other, mesh))
            ]
            if None not in order:
                # Both decode as shard orders: torch's own redistribute, in one call.
                held("DTensor.redistribute", d.redistribute(device_mesh, target).to_local(), other)
                seen["DTensor.redistribute to another layout"] += 1
    except Exception as e:
        fails.append(f"rank {rank} {coord}: {type(e).__name__}: {e}"[:2000])
        settle(e)
    return fails, seen


# --------------------------------------------------------------------------- the spawn


def the_issue_case() -> tuple[str, Case]:
    """Issue 20's layout on 4 ranks: experts [expert, ffn (gate|up), hidden], expert over ep
    then FSDP (mesh order dp_shard, ep), ffn per component over a size-1 tp. Its
    ``full_tensor`` failed while the compiler put a _StridedShard on the size-1 axis; it is
    sent to torch whatever the compiler says (test_layout_torch checks that it emits it)."""
    gate_up = Fusion((("gate", 6), ("up", 6)))
    layout = ParamLayout(
        (Dim("expert", 4, ("b", "a")), Dim("ffn", 12, ("c",), gate_up), Dim("hidden", 6))
    )
    return "emitted", ((2, 2, 1), layout, None)


def drive(rank: int, world: int, max_examples: int) -> dict[str, int]:
    """The rank function: rank 0 runs the hypothesis search and hands each example to every
    rank; the others follow until it hands them ``None``. Returns what the examples
    exercised (rank 0: counts of each kind of example too)."""
    import logging
    import warnings

    # torch warns that gathers in non-ascending mesh order take several collectives.
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    meshes = Meshes()
    totals: Counter = Counter()

    def step(case: Case | None) -> list[str] | None:
        """Every rank runs rank 0's ``case``; rank 0 gets every rank's findings (``None``:
        rank 0 said stop)."""
        box: list[Any] = [case]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return None
        fails, seen = run_case(box[0], meshes, rank)
        totals.update(seen)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, fails)
        return [f for g in gathered for f in g]

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )
    @given(cases(world))
    def search(drawn: tuple[str, Any]) -> None:
        kind, payload = drawn
        totals[kind] += 1
        if kind == "emitted":
            fails = step(payload)
            assert not fails, "\n".join([repr(payload), *(fails or [])[:8]])

    if world == 4:
        search = example(the_issue_case())(search)

    try:
        if rank != 0:
            while step(None) is not None:
                pass
            return dict(totals)
        try:
            search()
        finally:
            step(None)  # release the other ranks, pass or fail
        return dict(totals)
    finally:
        meshes.clear()


# --------------------------------------------------------------------------- torch's limits

GATE_UP = Fusion((("gate", 4), ("up", 4)))

# (name, mesh sizes, layout): layouts on 8 ranks (axes a, b, c) where the model
# (``torch_problem``) says torch fails, and their fixes where it says torch works. Each
# failing one fails at the same step on every rank, so torch raises (or returns) everywhere
# and no rank is left waiting in a collective.
LIMITS: list[tuple[str, tuple[int, ...], ParamLayout]] = [
    # Issue 20 with tp = 2: expert over ep then FSDP (mesh order dp, ep), ffn per component.
    (
        "gather",
        (2, 2, 2),
        ParamLayout((Dim("expert", 4, ("b", "a")), Dim("ffn", 8, ("c",), GATE_UP), Dim("h", 6))),
    ),
    # The hint's fix: the mesh lists ep before dp, so no _StridedShard cuts the experts.
    (
        "gather fixed",
        (2, 2, 2),
        ParamLayout((Dim("expert", 4, ("a", "b")), Dim("ffn", 8, ("c",), GATE_UP), Dim("h", 6))),
    ),
    # FSDP over TP on a dimension of 6 (not divisible by 2 x 2): an uneven _StridedShard,
    # which distribute_tensor cannot scatter from one rank (SCATTER; lint notes it in SS023)
    # but splits locally, and gathers.
    ("scatter", (2, 2, 2), ParamLayout((Dim("x", 6, ("b", "a")), Dim("y", 3)))),
    # The hint's fix: a size divisible by both axes.
    ("scatter fixed", (2, 2, 2), ParamLayout((Dim("x", 8, ("b", "a")), Dim("y", 3)))),
]

# Two layouts the compiler emits, between which torch's own one-call redistribute returns
# wrong data without an error (its greedy plan, as the first one's split factor does not
# decode): runtime.dtensor.redistribute goes through Replicate instead.
GREEDY_PAIR = (
    (2, 2, 2),
    ParamLayout((Dim("x", 4, ("a",), Fusion((("c0", 2), ("c1", 2)))),)),
    ParamLayout((Dim("x", 4, ("b",), Fusion((("c0", 2), ("c1", 2)))),)),
)


def limits(rank: int, world: int) -> dict[str, Any]:
    """Each of :data:`LIMITS` through distribute_tensor (scattered from rank 0, and split
    locally) and full_tensor (what torch did: ``"ok"``, ``"wrong"`` or the exception's
    type), and :data:`GREEDY_PAIR` through torch's redistribute and the runtime's."""
    meshes = Meshes()
    out: dict[str, Any] = {}
    try:
        for name, sizes, layout in LIMITS:
            mesh = Mesh(AXIS_NAMES[: len(sizes)], sizes)
            device_mesh = meshes.get(sizes, dtensor_mesh(layout, mesh).names)
            full = torch.arange(math.prod(layout.shape)).view(layout.shape)
            ps = [to_torch(p) for p in dtensor_placements(layout, mesh)]
            for source, key in ((0, name), (None, f"{name} split locally")):
                try:
                    d = distribute_tensor(full, device_mesh, ps, src_data_rank=source)
                    out[key] = "ok" if torch.equal(d.full_tensor(), full) else "wrong"
                except Exception as e:
                    out[key] = type(e).__name__
                    settle(e)
                d = None
        sizes, first, second = GREEDY_PAIR
        mesh = Mesh(AXIS_NAMES, sizes)
        device_mesh = meshes.get(sizes, mesh.names)
        full = torch.arange(4)
        d = distribute_tensor(
            full, device_mesh, [to_torch(p) for p in dtensor_placements(first, mesh)]
        )
        target = [to_torch(p) for p in dtensor_placements(second, mesh)]
        want = full[list(flat(rank_table(second, mesh)[rank].indices[0]))]
        out["torch redistribute"] = torch.equal(
            d.redistribute(device_mesh, target).to_local(), want
        )
        out["runtime redistribute"] = torch.equal(redistribute(d, target).to_local(), want)
        d = None
        return out
    finally:
        meshes.clear()
