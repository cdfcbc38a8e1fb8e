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
``model_dim_of[k]`` with a 1-D index map, so a holding is a product of per-dimension
axes and two holdings meet in the product of their per-dimension intersections. An axis
is built and kept as runs (:class:`Axis`): each held range is mapped through the
transforms run by run, so planning costs runs, not elements.

*Local positions*: a rank's local tensor holds its global indices of each dimension (the
physical index sets of :func:`shardspec.core.layout.local_indices`) in increasing order,
so the local position of a held global index is its rank in that set (a fused dimension
split over tp holds ``[gate_r; up_r]``: positions 0.. are gate's rows, then up's).
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from shardspec.core.hfmap import Source, Split, rope_row
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
    "Piece",
    "Run",
    "canonical_runs",
    "holdings",
    "local_position",
    "merged_holding",
    "plan_tensor",
    "runs_of",
]

# (src_start, dst_start, count, src_step, dst_step): positions src_start + i*src_step of the
# sender's dimension go to dst_start + i*dst_step of the receiver's, for i in range(count).
Run = tuple[int, int, int, int, int]
# (hf_start, pos_start, count, hf_step, pos_step): HF indices hf_start + i*hf_step of an
# axis lie at local positions pos_start + i*pos_step, for i in range(count).
HFRun = tuple[int, int, int, int, int]
# An axis's HF indices, positions left out: (start, count, step) runs (Axis.hf_set).
HFSet = tuple[tuple[int, int, int], ...]
# (offset, position, count): a held range's indices offset.. lie at positions position..
Piece = tuple[int, int, int]


@dataclass(frozen=True)
class Axis:
    """One HF dimension of a holding: the local tensor's dimension ``dim`` it lies along,
    and which HF indices lie at which local positions, as :data:`HFRun` runs in increasing
    HF order in the one form :func:`canonical_runs` gives (so equal axes compare equal
    however their runs were built). Nothing here lists elements but :meth:`pairs`."""

    dim: int
    runs: tuple[HFRun, ...]

    @classmethod
    def from_pairs(cls, dim: int, hf: Sequence[int], pos: Sequence[int]) -> Axis:
        """The axis holding HF index ``hf[i]`` at local position ``pos[i]``."""
        return cls(dim, hf_runs(hf, pos))

    @functools.cached_property
    def bounds(self) -> tuple[int, int]:
        """The least and the greatest HF index held (``(0, -1)``: none)."""
        if not self.runs:
            return 0, -1
        first, last = self.runs[0], self.runs[-1]
        return first[0], last[0] + (last[2] - 1) * last[3]

    @functools.cached_property
    def count(self) -> int:
        """The number of HF indices held."""
        return sum(r[2] for r in self.runs)

    @functools.cached_property
    def hf_set(self) -> HFSet:
        """The HF indices held, as ``(start, count, step)`` runs in the one greedy form of
        the increasing set (positions left out): equal for equal sets."""
        out: list[list[int]] = []
        for h, _, n, hs, _ in self.runs:
            i = 0
            while i < n:
                e = h + i * hs
                if out and out[-1][1] == 1:
                    out[-1][1], out[-1][2] = 2, e - out[-1][0]
                    i += 1
                elif out and e == out[-1][0] + out[-1][1] * out[-1][2]:
                    take = n - i if hs == out[-1][2] else 1
                    out[-1][1] += take
                    i += take
                else:
                    out.append([e, 1, 1])
                    i += 1
        return tuple((a, b, c) for a, b, c in out)

    def ranges(self) -> list[tuple[int, int]]:
        """The HF indices held as increasing, disjoint, non-touching ``[start, stop)``
        ranges (a strided run gives one range per index)."""
        out: list[tuple[int, int]] = []
        for h, n, s in self.hf_set:
            for a, b in (
                [(h, h + n)] if s == 1 or n == 1 else [(h + i * s, h + i * s + 1) for i in range(n)]
            ):
                if out and out[-1][1] == a:
                    out[-1] = (out[-1][0], b)
                else:
                    out.append((a, b))
        return out

    @functools.cached_property
    def permuted(self) -> bool:
        """Whether the HF indices, read in increasing local position, do not increase."""
        last = -1
        for _, p, n, _, ps in self.runs:
            if p <= last or (n > 1 and ps < 0):
                return True
            last = p + (n - 1) * ps
        return False

    def pairs(self) -> list[tuple[int, int]]:
        """Every ``(HF index, local position)`` pair, in increasing HF order: one per
        element, for views that list them (not the planner)."""
        return [(h + i * hs, p + i * ps) for h, p, n, hs, ps in self.runs for i in range(n)]


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
            n *= a.count
        return n

    def signature(self) -> tuple[HFSet, ...]:
        """The HF elements held, per dimension as :attr:`Axis.hf_set`: equal for replicas."""
        return tuple(a.hf_set for a in self.axes)


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


def _position_pieces(held: Ranges, g: tuple[int, int, int] | None, a: int, b: int) -> list[Piece]:
    """Where the unit's indices ``a..b`` lie along a dimension whose held global indices
    are ``held`` (``g``: a component's map to the fused dimension, see
    :func:`_unit_to_global`): ``(offset, position, count)`` pieces, index ``a + offset +
    i`` at local position ``position + i``. A run of held indices lies inside one held range
    (a component's, inside one group), so each piece costs one lookup."""
    if g is None:
        return [(0, local_position(held, a), b - a)]
    per, size, start = g
    out: list[Piece] = []
    u = a
    while u < b:
        group, j = divmod(u, per)
        end = min(b, (group + 1) * per)
        out.append((u - a, local_position(held, group * size + start + j), end - u))
        u = end
    return out


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

        def pieces(d: int, a: int, b: int) -> list[Piece]:
            return _position_pieces(held[d], to_global[d], a, b)  # noqa: B023 (used at once)

        first = 1 if source.stacked else 0
        axes = _axes(source, unit_held[first:], first, pieces)
        if source.stacked:
            for a, b in unit_held[0]:
                for off, p, n in pieces(0, a, b):
                    for i in range(n):
                        h = Holding(rank, param, ((0, p + i),), axes)
                        out.setdefault(source.keys[a + off + i], []).append(h)
        else:
            out.setdefault(source.keys[0], []).append(Holding(rank, param, (), axes))
    return out


def _axes(
    source: Source,
    held: Sequence[Ranges],
    first: int,
    pieces: Callable[[int, int, int], list[Piece]],
) -> tuple[Axis, ...]:
    """The HF axes of a rank's unit index sets ``held`` (model dims ``first``..), through
    the source's transforms and split, as :func:`shardspec.core.hfmap.source_indices` maps
    a box: every map is
    separable (HF dimension ``k`` is one model dimension, with a 1-D index map), so each
    held range of each dimension is mapped once, run by run (:func:`_hf_of_range`)."""
    axes: list[Axis | None] = [None] * len(held)
    for d, ranges in enumerate(held):
        k, got = 0, []
        for a, b in ranges:
            k, mapped = _hf_of_range(source, len(held), d, a, b - a)
            got += _placed(mapped, pieces(d + first, a, b))
        axes[k] = Axis(d + first, canonical_runs(got))
    assert all(a is not None for a in axes)
    return tuple(a for a in axes if a is not None)


def _hf_of_range(source: Source, ndim: int, d: int, a: int, n: int) -> tuple[int, list[HFRun]]:
    """Model dimension ``d``'s indices ``a..a+n`` of a box of ``ndim`` dimensions,
    mapped as :func:`~shardspec.core.hfmap.source_indices` maps them: ``(k, runs)``, HF
    dimension ``k`` and runs ``(hf_start, offset, count, hf_step, offset_step)``, HF
    index ``hf_start + i*hf_step`` at the box's offset ``offset + i*offset_step`` along
    ``d`` (a pad's real indices take the leading offsets). A range stays one run; a RoPE
    permutation gives two runs per head, a pad cuts runs, a grouped split gives one run
    per group."""
    runs: list[HFRun] = [(a, 0, n, 1, 1)]
    at = d
    for t in reversed(source.transforms):
        if t.kind == "transpose":
            at = ndim - 1 - at
        elif t.kind == "rope" and at == 0:
            runs = [r for run in runs for r in _rope_run(run, t.head_dim)]
        elif t.kind == "pad" and at == t.dim:
            runs = _unpadded_runs(runs, t.size)
    split = source.split
    if split is not None and (split.start or split.groups > 1) and at == split.dim:
        runs = [r for run in runs for r in _split_run(run, split)]
    return at, runs


def _elements(run: HFRun, f: Callable[[int], int]) -> list[HFRun]:
    """A run's elements one by one, their HF index mapped by ``f`` (transforms of strided
    runs, which no layout makes: the general case, element-wise)."""
    h, o, n, hs, os_ = run
    return [(f(h + i * hs), o + i * os_, 1, 1, 1) for i in range(n)]


def _rope_run(run: HFRun, head_dim: int) -> list[HFRun]:
    """:func:`rope_row` of a run of model rows: per head, the rows of each parity are one
    run of HF rows (row ``h*hd + 2j + t`` is HF row ``h*hd + t*hd/2 + j``)."""
    v, o, n, vs, os_ = run
    if vs != 1 or head_dim % 2 or n < 2:
        return _elements(run, lambda m: rope_row(m, head_dim))
    out: list[HFRun] = []
    end = v + n
    for head in range(v // head_dim, (end - 1) // head_dim + 1):
        base = head * head_dim
        lo, hi = max(v, base), min(end, base + head_dim)
        for t in (0, 1):
            m = lo + (t - (lo - base)) % 2  # the first row >= lo of parity t in the head
            if m < hi:
                out.append(
                    (rope_row(m, head_dim), o + (m - v) * os_, (hi - 1 - m) // 2 + 1, 1, 2 * os_)
                )
    return out


def _unpadded_runs(runs: list[HFRun], size: int) -> list[HFRun]:
    """A pad's real indices (below ``size``): they keep their order and take the leading
    offsets (:func:`shardspec.core.hfmap.source_indices`)."""
    kept: list[HFRun] = []
    for run in runs:
        v, o, n, vs, os_ = run
        if vs > 0:
            k = 0 if v >= size else min(n, (size - 1 - v) // vs + 1)
            if k:
                kept.append((v, o, k, vs, os_))
        else:
            kept += [r for r in _elements(run, lambda x: x) if r[0] < size]
    count = sum(r[2] for r in kept)
    if not kept or max(max(o, o + (n - 1) * s) for _, o, n, _, s in kept) == count - 1:
        return kept  # offsets 0..count-1 already (always, from a range)
    order = sorted((o + i * s, h + i * hs) for h, o, n, hs, s in kept for i in range(n))
    return [(h, j, 1, 1, 1) for j, (_, h) in enumerate(order)]


def _split_run(run: HFRun, split: Split) -> list[HFRun]:
    """:meth:`Split.hf_index` of a run of the unit's indices: one run per group."""
    v, o, n, vs, os_ = run
    if split.groups == 1:
        return [(v + split.start, o, n, vs, os_)]
    per = split.size // split.groups
    if vs != 1 or per == 0:
        return _elements(run, split.hf_index)
    out: list[HFRun] = []
    u, end = v, v + n
    while u < end:
        stop = min(end, (u // per + 1) * per)
        out.append((split.hf_index(u), o + (u - v) * os_, stop - u, 1, os_))
        u = stop
    return out


def _placed(runs: list[HFRun], pieces: list[Piece]) -> list[HFRun]:
    """Runs of ``(hf, offset, ...)`` with each offset replaced by its local position
    (``pieces``: :func:`_position_pieces`), cut where the pieces are."""
    if len(pieces) == 1:
        off, p, _ = pieces[0]
        return [(h, p + o - off, n, hs, os_) for h, o, n, hs, os_ in runs]
    starts = [off for off, _, _ in pieces]
    out: list[HFRun] = []
    for run in runs:
        h, o, n, hs, os_ = run
        if n > 1 and os_ <= 0:  # (no transform makes these: element by element)
            out += _placed(_elements(run, lambda x: x), pieces)
            continue
        os_ = os_ if n > 1 else 1
        i = 0
        while i < n:
            at = o + i * os_
            off, p, m = pieces[bisect.bisect_right(starts, at) - 1]
            last = min(n - 1, i + (off + m - 1 - at) // os_)  # the run's last index in the piece
            out.append((h + i * hs, p + at - off, last - i + 1, hs, os_))
            i = last + 1
    return out


def canonical_runs(pieces: Iterable[HFRun]) -> tuple[HFRun, ...]:
    """The ``(HF index, position)`` pairs of ``pieces`` (runs in any order, with any cuts)
    as :func:`hf_runs` gives them: sorted by HF index, greedily as long as both strides go.
    The cost is in runs, but where pieces interleave in HF (parts of one RoPE head on two
    held ranges), whose pairs are listed and sorted."""
    seq: list[HFRun] = []
    for cluster in _clusters(pieces, 0):
        if len(cluster) == 1:
            seq += cluster
        else:
            pairs = {(h + i * hs, p + i * ps) for h, p, n, hs, ps in cluster for i in range(n)}
            seq += [(h, p, 1, 1, 1) for h, p in sorted(pairs)]
    return merge_runs(seq, any_order=True)


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
    """The runs that move ``src``'s elements that ``dst`` holds, or None if none: per HF
    dimension, the two axes' HF runs (:attr:`Axis.runs`) intersected run by run and
    merged in the receiver's position order as :func:`runs_of` merges pairs, at a cost in
    runs, not elements."""
    for sa, da in zip(src.axes, dst.axes, strict=True):  # disjoint bounds: nothing to move
        if sa.bounds[1] < da.bounds[0] or da.bounds[1] < sa.bounds[0]:
            return None
    out = []
    for sa, da in zip(src.axes, dst.axes, strict=True):
        pieces = intersect_runs(sa.runs, da.runs)
        if not pieces:
            return None
        out.append(merge_runs(_in_dst_order(pieces)))
    return tuple(out)


def hf_runs(hf: Sequence[int], pos: Sequence[int]) -> tuple[HFRun, ...]:
    """An axis's ``(HF index, local position)`` pairs as :data:`HFRun` runs in increasing
    HF order (disjoint, increasing HF ranges), each as long as both its strides go."""
    if len(hf) > 1 and all(map(operator.lt, hf, hf[1:])) and all(map(operator.lt, pos, pos[1:])):
        return _unit_runs(hf, pos)
    pairs = sorted(zip(hf, pos, strict=True))  # (a RoPE dimension: another order)
    return merge_runs(((h, p, 1, 1, 1) for h, p in pairs), any_order=True)


def _unit_runs(hf: Sequence[int], pos: Sequence[int]) -> tuple[HFRun, ...]:
    """:func:`hf_runs` of increasing ``hf`` and ``pos``, in a number of steps that grows
    with the runs, not the elements: both lists increase, so elements ``i..j`` are one
    run of strides 1 exactly when both ends are ``j - i`` apart, and the end of each run
    is found by a galloping search."""
    out: list[HFRun] = []
    n, i = len(hf), 0
    while i < n:
        h, p = hf[i], pos[i]

        def unit(j: int) -> bool:
            return hf[j] - h == j - i and pos[j] - p == j - i  # noqa: B023 (used at once)

        if i + 1 < n and unit(i + 1):
            step = 1
            while i + step * 2 < n and unit(i + step * 2):
                step *= 2
            lo, hi = i + step, min(n, i + step * 2)  # unit(lo); not unit(hi) or hi == n
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if unit(mid) else (lo, mid)
            out.append((h, p, lo - i + 1, 1, 1))
            i = lo + 1
        elif i + 1 < n:  # a run with other strides: as long as they go, one by one
            dh, dp, j = hf[i + 1] - h, pos[i + 1] - p, i + 1
            while j + 1 < n and hf[j + 1] - hf[j] == dh and pos[j + 1] - pos[j] == dp:
                j += 1
            out.append((h, p, j - i + 1, dh, dp))
            i = j + 1
        else:
            out.append((h, p, 1, 1, 1))
            i += 1
    return tuple(out)


def _common(a: HFRun, b: HFRun) -> tuple[int, int, int] | None:
    """``(first, step, count)``: the HF indices both runs hold (None: none)."""
    lo = max(a[0], b[0])
    hi = min(a[0] + (a[2] - 1) * a[3], b[0] + (b[2] - 1) * b[3])
    if lo > hi:
        return None
    if a[3] == b[3] == 1:  # (the common case: contiguous HF ranges)
        return lo, 1, hi - lo + 1
    # h = a0 (mod as) and h = b0 (mod bs): the Chinese remainder theorem.
    g = math.gcd(a[3], b[3])
    if (b[0] - a[0]) % g:
        return None
    step = a[3] // g * b[3]
    k = (b[0] - a[0]) // g * pow(a[3] // g, -1, b[3] // g) % (b[3] // g)
    first = a[0] + k * a[3]
    first += -(-(lo - first) // step) * step  # the least solution >= lo
    if first > hi:
        return None
    return first, step, (hi - first) // step + 1


def intersect_runs(src: Sequence[HFRun], dst: Sequence[HFRun]) -> list[Run]:
    """The HF indices two axes both hold, as runs from the sender's local positions to the
    receiver's (steps may be negative; in HF order): one sweep over both run lists."""
    out: list[Run] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        a, b = src[i], dst[j]
        a_end, b_end = a[0] + (a[2] - 1) * a[3], b[0] + (b[2] - 1) * b[3]
        c = _common(a, b)
        if c is not None:
            first, step, n = c
            ka, kb = (first - a[0]) // a[3], (first - b[0]) // b[3]
            sa, sb = step // a[3] * a[4], step // b[3] * b[4]
            out.append(
                (a[1] + ka * a[4], b[1] + kb * b[4], n, sa if n > 1 else 1, sb if n > 1 else 1)
            )
        if a_end <= b_end:
            i += 1
        if b_end <= a_end:
            j += 1
    return out


def _in_dst_order(pieces: list[Run]) -> list[Run]:
    """Runs whose receiver positions increase, in the receiver's order, covering the same
    pairs as ``pieces`` (in any order, any steps). Runs whose receiver ranges interleave
    (a RoPE head's two halves) become one run when together they are one progression on
    both sides, and single pairs otherwise."""
    return [r for cluster in _clusters(pieces, 1) for r in _untangle(cluster)]


def _clusters(runs: Iterable[Run], at: int) -> Iterator[list[Run]]:
    """Runs along coordinate ``at`` of theirs (0: the first, a sender's position or an HF
    index; 1: the second), each turned to increase there (a negative step reversed),
    sorted by their start there, in clusters whose extents there overlap."""
    up = [
        (s + (n - 1) * ss, d + (n - 1) * ds, n, -ss, -ds) if (ss, ds)[at] < 0 else (s, d, n, ss, ds)
        for s, d, n, ss, ds in runs
    ]
    up.sort(key=lambda r: r[at])
    k = 0
    while k < len(up):
        end, m = up[k][at] + (up[k][2] - 1) * up[k][at + 3], k + 1
        while m < len(up) and up[m][at] <= end:
            end = max(end, up[m][at] + (up[m][2] - 1) * up[m][at + 3])
            m += 1
        yield up[k:m]
        k = m


def _untangle(cluster: list[Run]) -> list[Run]:
    """One cluster of :func:`_in_dst_order`, sorted by receiver start."""
    if len(cluster) == 1:
        return cluster
    k, (s0, d0, n, _, ds) = len(cluster), cluster[0]
    sigma, delta = (cluster[1][0] - s0, cluster[1][1] - d0)
    if all(
        r[2] == n
        and r[3] == k * sigma
        and r[4] == k * delta == ds
        and r[0] == s0 + j * sigma
        and r[1] == d0 + j * delta
        for j, r in enumerate(cluster)
    ):
        return [(s0, d0, k * n, sigma, delta)]
    pairs = sorted(
        ((d + i * e, s + i * t) for s, d, c, t, e in cluster for i in range(c)), key=lambda x: x[0]
    )
    return [(s, d, 1, 1, 1) for d, s in pairs]


def merge_runs(runs: Iterable[Run], *, any_order: bool = False) -> tuple[Run, ...]:
    """:func:`runs_of` of the pairs the runs hold, in order, at a cost in runs: a run
    whose strides continue the last merged run's joins it whole. ``any_order``: a
    one-pair run takes the next pair whichever way it goes (:func:`hf_runs`: runs in
    increasing HF order, whose positions may go down)."""
    out: list[list[int]] = []
    for s, d, n, ss, ds in runs:
        i = 0
        while i < n:
            es, ed = s + i * ss, d + i * ds
            if out:
                r = out[-1]
                if r[2] == 1 and (any_order or (es > r[0] and ed > r[1])):
                    r[3], r[4], r[2] = es - r[0], ed - r[1], 2
                    i += 1
                    continue
                if r[2] > 1 and es == r[0] + r[2] * r[3] and ed == r[1] + r[2] * r[4]:
                    take = n - i if (ss, ds) == (r[3], r[4]) else 1
                    r[2] += take
                    i += take
                    continue
            out.append([es, ed, 1, 1, 1])
            i += 1
    return tuple((a, b, c, e, f) for a, b, c, e, f in out)


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
    groups: dict[tuple[HFSet, ...], list[Holding]] = {}
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
    axis = Axis(first.axes[k].dim, canonical_runs(r for h in held for r in h.axes[k].runs))
    return Holding(
        first.rank, first.param, first.fixed, (*first.axes[:k], axis, *first.axes[k + 1 :])
    )
