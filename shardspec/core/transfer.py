"""Weight-transfer arithmetic: which elements of each Hugging Face tensor every rank of a
layout holds, and the point-to-point moves that give each receiving rank its own.

Pure Python, no torch: the compiler plans a transfer between two specs with it
(:mod:`shardspec.transfer`), and the runtime that executes the plan reads what it wrote.

A rank's *holding* of an HF tensor is where, in one of its local tensors (a parameter's
local shard, as the rank keeps it in memory), each HF element it holds lies. The
arithmetic from a storage unit's box to HF indices is :func:`shardspec.core.hfmap.
source_indices`, the same that ``load_hf`` reads with, so the transfer and the loader
cannot disagree about transforms (``transpose``, ``rope N``) and fused splits (``as``,
``grouped``). Every map is separable: HF dimension ``k`` is model dimension
``model_dim_of[k]`` with a 1-D index map, so a holding is a product of per-dimension lists
and two holdings meet in the product of their per-dimension intersections.

*Local positions*: a rank's local tensor holds its global indices of each dimension (the
physical index sets of :func:`shardspec.core.layout.local_indices`) in increasing order,
so the local position of a held global index is its rank in that set (a fused dimension
split over tp holds ``[gate_r; up_r]``: positions 0.. are gate's rows, then up's).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from shardspec.core.hfmap import Source, source_indices
from shardspec.core.layout import (
    Fusion,
    Mesh,
    ParamLayout,
    Ranges,
    component_indices,
    local_indices,
)

__all__ = [
    "Axis",
    "Holding",
    "Move",
    "Run",
    "holdings",
    "local_position",
    "merged_holding",
    "plan_tensor",
    "runs_of",
]

# (src_start, dst_start, count, src_step, dst_step): positions src_start + i*src_step of the
# sender's dimension go to dst_start + i*dst_step of the receiver's, for i in range(count).
Run = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class Axis:
    """One HF dimension of a holding: the local tensor's dimension ``dim`` it lies along,
    the HF indices held (``hf``, in increasing local position) and their local positions
    (``pos``, increasing)."""

    dim: int
    hf: tuple[int, ...]
    pos: tuple[int, ...]

    @functools.cached_property
    def bounds(self) -> tuple[int, int]:
        """The least and the greatest HF index held."""
        return min(self.hf), max(self.hf)

    @functools.cached_property
    def position_of(self) -> dict[int, int]:
        """HF index -> local position."""
        return dict(zip(self.hf, self.pos, strict=True))


@dataclass(frozen=True)
class Holding:
    """What rank ``rank`` holds of one HF tensor: in its local tensor ``param``, at the
    fixed positions ``fixed`` (``(dim, position)``: a stacked source's index), the product
    of its ``axes`` (one per HF dimension, in HF order)."""

    rank: int
    param: str
    fixed: tuple[tuple[int, int], ...]
    axes: tuple[Axis, ...]

    @property
    def count(self) -> int:
        n = 1
        for a in self.axes:
            n *= len(a.hf)
        return n

    def signature(self) -> tuple[tuple[int, ...], ...]:
        """The HF elements held, as per-dimension sorted index tuples: equal for replicas."""
        return tuple(tuple(sorted(a.hf)) for a in self.axes)


@dataclass(frozen=True)
class Move:
    """Elements of one HF tensor from sender ``src`` to receiver ``dst``: per HF dimension
    the runs from the sender's local positions to the receiver's; ``count`` elements."""

    src: Holding
    dst: Holding
    runs: tuple[tuple[Run, ...], ...]
    count: int


def local_position(held: Ranges, index: int) -> int:
    """The local position of global ``index`` in a rank's increasing index set ``held``."""
    starts = [a for a, _ in held]
    i = bisect.bisect_right(starts, index) - 1
    before = sum(b - a for a, b in held[:i])
    return before + index - held[i][0]


def _unit_to_global(fusion: Fusion, comp: str) -> tuple[int, int, int]:
    """``(per_group, group_size, start)``: component ``comp``'s index ``c`` is the fused
    dimension's index ``(c // per_group) * group_size + start + c % per_group``."""
    start = 0
    for name, size in fusion.components:
        if name == comp:
            return size, fusion.group_size, start
        start += size
    raise KeyError(comp)  # pragma: no cover - callers pass known names


def _run_positions(held: Ranges, g: tuple[int, int, int] | None, a: int, b: int) -> range | list:
    """The local positions of the unit's indices ``a..b`` along a dimension whose held
    global indices are ``held`` (``g``: a component's map to the fused dimension, see
    :func:`_unit_to_global`). A run of held indices lies inside one held range (a
    component's, inside one group), so each piece costs one lookup."""
    if g is None:
        p = local_position(held, a)
        return range(p, p + b - a)
    per, size, start = g
    out: list[int] = []
    u = a
    while u < b:
        group, j = divmod(u, per)
        end = min(b, (group + 1) * per)
        p = local_position(held, group * size + start + j)
        out.extend(range(p, p + end - u))
        u = end
    return out


def _positions(
    held: Sequence[Ranges], to_global: Sequence[tuple[int, int, int] | None], d: int, a: int, b: int
) -> range | list:
    """:func:`_run_positions` along dimension ``d``."""
    return _run_positions(held[d], to_global[d], a, b)


def holdings(
    param: str,
    layout: ParamLayout,
    mesh: Mesh,
    component: str | None,
    source: Source,
    ranks: Iterable[int] | None = None,
) -> dict[str, list[Holding]]:
    """Per HF key, every rank's holding of storage unit (``component`` of ``param``, or
    the whole parameter) whose HF source is ``source``. The layout must have no
    name-indexed dimension (its units are per module; the caller refuses them)."""
    fused_at = next((i for i, d in enumerate(layout.dims) if d.fusion is not None), None)
    out: dict[str, list[Holding]] = {}
    for rank in range(mesh.world) if ranks is None else ranks:
        coord = mesh.coord_of(rank)
        held = local_indices(layout, mesh, coord)
        if any(not r for r in held):
            continue
        unit_held: list[Ranges] = list(held)
        to_global: list[tuple[int, int, int] | None] = [None] * len(held)
        if component is not None and fused_at is not None:
            fusion = layout.dims[fused_at].fusion
            assert fusion is not None
            unit_held[fused_at] = component_indices(fusion, held[fused_at], component)
            to_global[fused_at] = _unit_to_global(fusion, component)
            if not unit_held[fused_at]:
                continue

        pos = functools.partial(_positions, held, tuple(to_global))
        first = 1 if source.stacked else 0
        axes = _axes(source, unit_held[first:], first, pos)
        if source.stacked:
            for a, b in unit_held[0]:
                for e, p in zip(range(a, b), pos(0, a, b), strict=True):
                    h = Holding(rank, param, ((0, p),), axes)
                    out.setdefault(source.keys[e], []).append(h)
        else:
            out.setdefault(source.keys[0], []).append(Holding(rank, param, (), axes))
    return out


def _axes(
    source: Source, held: Sequence[Ranges], first: int, pos: Callable[[int, int, int], Sequence]
) -> tuple[Axis, ...]:
    """The HF axes of a rank's unit index sets ``held`` (model dims ``first``..), through
    the source's transforms and split: one :func:`source_indices` call per run of the dim
    with the most runs (every map is separable, so run ``i`` of each dim is mapped once)."""
    n = max(len(r) for r in held) if held else 0
    hf: list[list[int]] = [[] for _ in held]
    local: list[list[int]] = [[] for _ in held]
    dim_of: tuple[int, ...] = tuple(range(len(held)))
    for i in range(n):
        box = [r[min(i, len(r) - 1)] for r in held]
        per_dim, dim_of = source_indices(
            source.transforms, [a for a, _ in box], [b - a for a, b in box], source.split
        )
        for k, idx in enumerate(per_dim):
            d = dim_of[k]
            if i < len(held[d]):
                hf[k].extend(idx)  # a pad's real indices: the run's leading positions
                local[k].extend(pos(d + first, *held[d][i])[: len(idx)])
    return tuple(Axis(dim_of[k] + first, tuple(hf[k]), tuple(local[k])) for k in range(len(held)))


def runs_of(pairs: Iterable[tuple[int, int]]) -> tuple[Run, ...]:
    """``(src, dst)`` position pairs, in order, as strided runs (each pair extends the last
    run when it continues both its strides)."""
    out: list[list[int]] = []
    for s, d in pairs:
        if out:
            r = out[-1]
            if r[2] == 1 and s > r[0] and d > r[1]:
                r[3], r[4], r[2] = s - r[0], d - r[1], 2
                continue
            if r[2] > 1 and s == r[0] + r[2] * r[3] and d == r[1] + r[2] * r[4]:
                r[2] += 1
                continue
        out.append([s, d, 1, 1, 1])
    return tuple((a, b, c, e, f) for a, b, c, e, f in out)


def _meet(src: Holding, dst: Holding) -> tuple[tuple[Run, ...], ...] | None:
    """The runs that move ``src``'s elements that ``dst`` holds, or None if none."""
    for sa, da in zip(src.axes, dst.axes, strict=True):  # disjoint bounds: nothing to move
        if sa.bounds[1] < da.bounds[0] or da.bounds[1] < sa.bounds[0]:
            return None
    out = []
    for sa, da in zip(src.axes, dst.axes, strict=True):
        where = sa.position_of
        pairs = [(where[h], p) for h, p in zip(da.hf, da.pos, strict=True) if h in where]
        if not pairs:
            return None
        out.append(runs_of(pairs))
    return tuple(out)


def _count(runs: Sequence[Sequence[Run]]) -> int:
    n = 1
    for dim_runs in runs:
        n *= sum(r[2] for r in dim_runs)
    return n


def plan_tensor(
    senders: Sequence[Holding],
    receivers: Sequence[Holding],
    itemsize: int,
    load: dict[int, int],
) -> tuple[list[Move], list[tuple[Holding, int]]]:
    """The moves that give every receiver its elements of one HF tensor, each element once.

    Senders with the same elements are replicas (a dp-replicated or tp-replicated
    parameter): for each receiver and each group of replicas it meets, the sender is the
    replica with the fewest bytes sent so far (``load``, by sender rank, updated; ties: the
    lowest rank) -- greedy least-loaded, in the order of the receivers given. Returns the
    moves and, per receiver whose elements the senders do not all provide, the number of
    elements without a source."""
    groups: dict[tuple[tuple[int, ...], ...], list[Holding]] = {}
    for h in senders:
        groups.setdefault(h.signature(), []).append(h)
    moves: list[Move] = []
    short: list[tuple[Holding, int]] = []
    for dst in receivers:
        got = 0
        for members in groups.values():
            runs = _meet(members[0], dst)
            if runs is None:
                continue
            src = min(members, key=lambda h: (load.get(h.rank, 0), h.rank))
            if src is not members[0]:
                runs = _meet(src, dst)
                assert runs is not None
            n = _count(runs)
            load[src.rank] = load.get(src.rank, 0) + n * itemsize
            moves.append(Move(src, dst, runs, n))
            got += n
        if got != dst.count:
            short.append((dst, dst.count - got))
    return moves, short


def merged_holding(held: Sequence[Holding]) -> Holding:
    """One rank's holdings of one HF tensor as one: a split line (an HF tensor holding
    several components of a fused parameter) gives one holding per component, equal but
    along the split dimension, where their indices and positions are concatenated in
    increasing local position. Raises ``ValueError`` for holdings that are not so."""
    first = held[0]
    if len(held) == 1:
        return first
    if any(h.rank != first.rank or h.param != first.param or h.fixed != first.fixed for h in held):
        raise ValueError("the holdings are of several parameters or ranks")
    differ = {
        k
        for h in held[1:]
        for k, (a, b) in enumerate(zip(h.axes, first.axes, strict=True))
        if a != b
    }
    if len(differ) > 1:
        raise ValueError("the holdings differ along more than one dimension")
    k = differ.pop() if differ else 0
    pairs = sorted({(p, i) for h in held for i, p in zip(h.axes[k].hf, h.axes[k].pos, strict=True)})
    axis = Axis(first.axes[k].dim, tuple(i for _, i in pairs), tuple(p for p, _ in pairs))
    return Holding(
        first.rank, first.param, first.fixed, (*first.axes[:k], axis, *first.axes[k + 1 :])
    )
