"""The canonical checkpoint layout: what a rank stores of each state-dict entry, and where.

Every parameter is stored under its global name and global shape, whatever its runtime form
(a DTensor on the full mesh, or a Megatron-style local shard wrapped by FSDP2 on the
data-parallel mesh only). Fused dimensions are stored as their components
(``<fqn>.<component>``), so the bytes do not depend on the TP degree; per-expert modules
indexed by a name capture (``local_experts.{expert}``) are stored under their global index.

This module is pure computation over :mod:`shardspec.core.layout`: for one rank and one
state-dict entry it yields :class:`Unit` objects (a key, a global shape, this rank's chunk,
how to cut it from the local tensor, and the replicas that hold the same chunk). Writers are
chosen statically from these, balanced by bytes, so no rank needs to ask another.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from functools import lru_cache

from shardspec.core.layout import (
    Mesh,
    ParamLayout,
    Ranges,
    checkpoint_indices,
    component_indices,
    ranges_len,
    rank_table,
    storage_units,
)
from shardspec.core.views import Folded, layout_view


@dataclass(frozen=True)
class Unit:
    """One stored tensor's chunk held by this rank."""

    key: str  # the storage key (the flat state-dict key with the canonical name)
    source: str  # the flat key in the caller's state dict
    shape: tuple[int, ...]  # canonical global shape
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    # How to cut the chunk out of the local tensor: per cut tensor dim, (dim, ((start,
    # length), ...)) runs, concatenated along that dim; None when it is the whole tensor.
    runs: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] | None
    replicas: tuple[int, ...]  # ranks that hold the same chunk (this rank included)
    itemsize: int = 4
    # For a component: (tensor dim, ((start, length), ...)) where it lies in the fused
    # tensor, per group; and the fused tensor's global shape. Lets a fused tensor saved
    # whole (by DCP's default planner) still load.
    fused: tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]] | None = None
    # A squeezed component (`fuse ... squeezed`): the dimension of the cut chunk (one index
    # long) that the stored tensor lacks; None otherwise.
    squeeze: int | None = None

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.itemsize


@dataclass
class CanonicalPlan:
    """All of one rank's units, and the writer of every chunk it holds."""

    units: list[Unit] = field(default_factory=list)
    # Save plans only (a load reads every chunk it holds): the chosen writer per chunk.
    writer: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)  # non-tensor source key -> stored key
    paths: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # key -> name span
    dtypes: dict[str, object] = field(default_factory=dict)  # key -> torch dtype
    # Every stored key of every rank (per-expert modules give each rank other keys): a
    # checkpoint key in here is expected even if this rank does not read it.
    keys: set[str] = field(default_factory=set)
    fingerprint: str = ""
    # Pipeline stages: this rank's stage (None without), and the global names of the
    # parameters other stages hold (their checkpoint keys are expected, not this rank's).
    stage: int | None = None
    foreign: frozenset[str] = frozenset()
    # Tensors of the model's state that no rule, ignore or manifest buffer covers (save
    # refuses them unless strict=False), each with what it is.
    uncovered: tuple[str, ...] = ()

    def writer_of(self, key: str, offsets: tuple[int, ...], replicas: tuple[int, ...]) -> int:
        """The rank that writes chunk ``(key, offsets)``: its only holder, or the one the
        byte balancing chose among its replicas."""
        if len(replicas) == 1:
            return replicas[0]
        return self.writer[(key, offsets)]


def _local_runs(ranges: Ranges, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """Positions, in local order, of the held indices that lie in ``[lo, hi)``."""
    out: list[tuple[int, int]] = []
    pos = 0
    for a, b in ranges:
        s, e = max(a, lo), min(b, hi)
        if s < e:
            start = pos + s - a
            if out and out[-1][0] + out[-1][1] == start:
                out[-1] = (out[-1][0], out[-1][1] + e - s)
            else:
                out.append((start, e - s))
        pos += b - a
    return tuple(out)


@dataclass(frozen=True)
class WholeFused(ParamLayout):
    """A layout whose fused dimension a checkpoint stores whole, under the parameter's own
    name (as a state dict that names it holds it: torchtitan's optimizer state, or a fused
    parameter no state-dict hook splits), instead of one unit per component. Each rank's
    block of the fused dimension must then be one run of it (whole groups, or a dimension
    the rank holds whole)."""


def stored_whole(layout: ParamLayout) -> ParamLayout:
    """``layout`` with its fused dimension stored whole (:class:`WholeFused`); itself
    without one."""
    if all(d.fusion is None for d in layout.dims):
        return layout
    return WholeFused(**{f.name: getattr(layout, f.name) for f in fields(layout)})


@dataclass(frozen=True)
class _Piece:
    """A storage unit of a parameter as one rank holds it (no key names yet)."""

    component: str | None
    shape: tuple[int, ...]  # canonical shape, name-indexed dims removed
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    runs: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] | None
    name_indexed_start: tuple[int, ...]  # first global index of each name-indexed dim on this rank
    fused: tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]] | None = None
    squeeze: int | None = None  # as :attr:`Unit.squeeze`


@lru_cache(maxsize=4096)
def rank_pieces(layout: ParamLayout, mesh: Mesh) -> tuple[tuple[_Piece, ...], ...]:
    """For every rank (in rank order), its storage pieces of a parameter with ``layout``
    (none on a rank of another pipeline stage). A Folded mesh (a spec with views) is read
    on the layout's view: rank numbers are the same in every view."""
    mesh = layout_view(layout, mesh)
    table = rank_table(layout, mesh)
    # A fused tensor stored whole (a key layout such as torchtitan's): one unit, the
    # rank's block of the fused tensor.
    units = [(None, None)] if isinstance(layout, WholeFused) else storage_units(layout)
    out: list[tuple[_Piece, ...]] = []
    for t in table:
        if not layout.on_stage(mesh, t.coord):
            out.append(())
            continue
        pieces = []
        # What the rank stores: its runtime block, cut further by checkpoint-only splits.
        stored = checkpoint_indices(layout, mesh, t.coord, t.indices)
        for comp, d in units:
            shape, offsets, sizes = [], [], []
            cuts: list[tuple[int, tuple[tuple[int, int], ...]]] = []
            fused = None
            squeeze = None
            vstart = []
            for i, (dim, r) in enumerate(zip(layout.dims, stored, strict=True)):
                held = t.indices[i]
                if dim.name_indexed:
                    vstart.append(r[0][0] if r else 0)
                    continue
                tensor_dim = sum(1 for x in layout.dims[:i] if not x.name_indexed)
                if comp is not None and i == d:
                    fusion = dim.fusion
                    assert fusion is not None
                    ci = component_indices(fusion, r, comp)
                    size = dict(fusion.components)[comp] * fusion.groups
                    if len(ci) > 1:
                        raise ValueError(f"component {comp!r} is not one block on rank {t.rank}")
                    local_pos: list[tuple[int, int]] = []
                    for lo, hi in fusion.component_ranges(comp):
                        for a, b in r:
                            if max(lo, a) < min(hi, b):
                                local_pos.extend(_local_runs(held, max(lo, a), min(hi, b)))
                    cuts.append((tensor_dim, tuple(local_pos)))
                    if fusion.squeezed:  # one index, held whole: stored without the dim
                        if ranges_len(ci) != 1:
                            raise ValueError(f"squeezed component {comp!r} is cut on rank {t.rank}")
                        squeeze = tensor_dim
                        continue
                    where = tuple((lo, hi - lo) for lo, hi in fusion.component_ranges(comp))
                    full = tuple(x.size for x in layout.dims if not x.name_indexed)
                    fused = (tensor_dim, where, full)
                    shape.append(size)
                    offsets.append(ci[0][0] if ci else 0)
                    sizes.append(ranges_len(ci))
                else:
                    if len(r) > 1:
                        raise ValueError(
                            f"dimension {dim.name!r} is not one block on rank {t.rank}"
                        )
                    if r != held:  # a checkpoint-only split: a narrower block
                        cuts.append((tensor_dim, _local_runs(held, *r[0]) if r else ((0, 0),)))
                    shape.append(dim.size)
                    offsets.append(r[0][0] if r else 0)
                    sizes.append(ranges_len(r))
            runs = tuple(cuts) or None
            pieces.append(
                _Piece(
                    comp,
                    tuple(shape),
                    tuple(offsets),
                    tuple(sizes),
                    runs,
                    tuple(vstart),
                    fused,
                    squeeze,
                )
            )
        out.append(tuple(pieces))
    return tuple(out)


@lru_cache(maxsize=4096)
def replica_groups(layout: ParamLayout, mesh: Mesh) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """For every rank and each of its pieces: the ranks holding the identical chunk."""
    per_rank = rank_pieces(layout, mesh)
    groups: dict[tuple, list[int]] = {}
    keys = []
    for rank, pieces in enumerate(per_rank):
        row = []
        for p in pieces:
            k = (p.component, p.offsets, p.sizes, p.name_indexed_start)
            groups.setdefault(k, []).append(rank)
            row.append(k)
        keys.append(row)
    return tuple(tuple(tuple(groups[k]) for k in row) for row in keys)


def assign_writers(
    chunks: Iterable[tuple[tuple[str, tuple[int, ...]], tuple[int, ...], int]],
    world: int,
    base_load: list[int] | None = None,
) -> dict[tuple[str, tuple[int, ...]], int]:
    """Choose one writer per chunk: ``chunks`` are ``((key, offsets), replicas, nbytes)``.

    Chunks with one holder go to it; then replicated chunks, largest first, go to whichever
    replica has written the fewest bytes so far (lowest rank on ties). Deterministic, so every
    rank computes the same answer from the same state-dict structure without communication.
    """
    load = list(base_load) if base_load is not None else [0] * world
    out: dict[tuple[str, tuple[int, ...]], int] = {}
    shared = []
    for ident, replicas, nbytes in chunks:
        if ident in out:
            continue
        if len(replicas) == 1:
            out[ident] = replicas[0]
            load[replicas[0]] += nbytes
        else:
            shared.append((ident, replicas, nbytes))
    seen = set(out)
    shared.sort(key=lambda c: (-c[2], c[0]))
    for ident, replicas, nbytes in shared:
        if ident in seen:
            continue
        seen.add(ident)
        w = replicas[0]  # the replica with the fewest bytes, lowest rank on ties
        lw = load[w]
        for r in replicas:
            lr = load[r]
            if lr < lw or (lr == lw and r < w):
                w, lw = r, lr
        out[ident] = w
        load[w] = lw + nbytes
    return out


@lru_cache(maxsize=4096)
def chunk_table(
    layout: ParamLayout, mesh: Mesh
) -> tuple[tuple[str | None, tuple[int, ...], tuple[int, ...], int], ...]:
    """Every distinct non-empty chunk of a layout without name-indexed dimensions, once:
    ``(component, offsets, replicas, elements)``, in rank order of first holder. What the
    writer choice needs of a parameter, computed once per layout instead of once per
    parameter and rank."""
    if any(d.name_indexed for d in layout.dims):
        raise ValueError("name-indexed dimensions: each rank stores other keys")
    groups = replica_groups(layout, mesh)
    seen: set[tuple[str | None, tuple[int, ...]]] = set()
    out = []
    for r, row in enumerate(rank_pieces(layout, mesh)):
        for k, p in enumerate(row):
            ident = (p.component, p.offsets)
            if ident in seen or any(s == 0 for s in p.sizes):
                continue
            seen.add(ident)
            out.append((p.component, p.offsets, groups[r][k], math.prod(p.sizes)))
    return tuple(out)


def stage_writers(layout: ParamLayout, mesh: Mesh, replicas: tuple[int, ...]) -> tuple[int, ...]:
    """The replicas that may write a chunk. A weight tied across pipeline stages has
    replicas on each; only its lowest stage's write, so that every stage, balancing bytes
    over its own state dict, still agrees that the other stages' ranks do not."""
    if len(layout.stages) < 2 or layout.stage_axis is None:
        return replicas
    axis = mesh.names.index(layout.stage_axis)
    first = layout.stages[0]
    return tuple(r for r in replicas if mesh.coord_of(r)[axis] == first)


@lru_cache(maxsize=4096)
def unreplicated(layout: ParamLayout, mesh: Mesh) -> bool:
    """Whether every chunk of the layout has exactly one holder (nothing to choose)."""
    return all(len(g) == 1 for row in replica_groups(layout, mesh) for g in row)


@lru_cache(maxsize=4096)
def rank_elements(layout: ParamLayout, mesh: Mesh) -> tuple[int, ...]:
    """Elements each rank stores of a parameter with ``layout`` (its pieces, summed)."""
    return tuple(sum(math.prod(p.sizes) for p in row) for row in rank_pieces(layout, mesh))


def fingerprint(entries: Mapping[str, tuple], mesh: Mesh, extra: str = "") -> str:
    """A short hash of the state dict's structure (keys, shapes, dtypes, chunks) and mesh."""
    h = hashlib.sha256()
    h.update(repr((mesh.names, mesh.sizes, extra)).encode())
    if isinstance(mesh, Folded):  # every view's sizes (a spec with views)
        h.update(repr(mesh.views).encode())
    for key in sorted(entries):
        h.update(repr((key, entries[key])).encode())
    return h.hexdigest()[:16]
