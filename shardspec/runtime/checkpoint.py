"""DCP planners generated modules expose, and ``save``/``load`` helpers around them.

``SavePlanner`` and ``LoadPlanner`` subclass DCP's default planners. They replace every
parameter-shaped entry of the state dict (parameters, and optimizer states that follow them)
by its canonical units (see :mod:`shardspec.runtime.canonical`); everything else (scalars,
param groups, other objects) goes through DCP's default handling.

* Writers are chosen statically, balanced by bytes: a replicated chunk is written once.
* Plans are cached under a fingerprint of the structure and the mesh, in a cache key of
  their own (per spec, planner role and fingerprint), so a new item, a dtype change or a
  new mesh re-plans, and model and optimizer planners never share a cache.
* Loading validates the whole checkpoint before a byte is read and reports every missing,
  unexpected or mismatched key in one error. ``load`` reads into staging buffers and
  changes the live tensors only after every rank's reads succeeded.
* The canonical plan (units, writers, fingerprint) is cached per spec under the state
  dict's structure, the mesh and the rank, so repeated saves and loads only bind tensors;
  the coordinator checks the global plan in linear time (shardspec's chunks form a grid),
  where DCP's own check is quadratic for FSDP x TP layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import math
import os
import shutil
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from shardspec.layout import Mesh, ParamLayout, dtensor_placements, module_shape
from shardspec.runtime.canonical import (
    CanonicalPlan,
    Unit,
    assign_writers,
    chunk_table,
    fingerprint,
    rank_elements,
    rank_pieces,
    replica_groups,
    unreplicated,
)
from shardspec.runtime.spec import CompiledSpec, SpecError

MARKER = ".shardspec.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked; names every key or file."""


# ----------------------------------------------------------------------------- mapping


def _flat(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state_dict)  # type: ignore[arg-type]


def _dot_starts(key: str) -> list[int]:
    return [0] + [i + 1 for i, ch in enumerate(key) if ch == "."]


def ignored_key(spec: CompiledSpec, key: str) -> bool:
    """Whether a flat key lies inside an ignored entry: an ignore pattern matches some
    dot-bounded part of it (``model.x._extra_state.scale`` is inside ``x._extra_state``)."""
    starts = _dot_starts(key)
    stops = [i for i, ch in enumerate(key) if ch == "."] + [len(key)]
    return any(spec.is_ignored(key[a:b]) for a in starts for b in stops if b > a)


def _describe(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    return ("object", type(value).__name__)


def rename_path(path: tuple, key: str, start: int, stop: int, new: str) -> tuple:
    """The object path of ``key`` with the characters ``key[start:stop]`` (a parameter
    name inside one path element) replaced by ``new``."""
    out, pos = [], 0
    for element in path:
        text = str(element)
        lo, hi = pos, pos + len(text)
        if lo <= start and stop <= hi:
            text = text[: start - lo] + new + text[stop - lo :]
            out.append(text)
        else:
            out.append(element)
        pos = hi + 1
    return tuple(out)


class _Names:
    """Finds parameter names inside flat state-dict keys, and their canonical names."""

    def __init__(self, spec: CompiledSpec, mesh: Mesh) -> None:
        self.spec = spec
        self.table = spec.table(mesh)
        self.names = set(self.table) if self.table is not None else None

    def split(self, key: str) -> tuple[int, int] | None:
        """``(start, stop)`` of the parameter name inside a flat key (leftmost, longest)."""
        starts = _dot_starts(key)
        stops = [i for i, ch in enumerate(key) if ch == "."] + [len(key)]
        for a in starts:
            for b in reversed(stops):
                if b > a and self._is_param(key[a:b]):
                    return a, b
        return None

    def _is_param(self, name: str) -> bool:
        if self.names is not None:
            return name in self.names
        try:
            self.spec.match(name)
        except SpecError:
            return False
        return True

    def canonical(self, fqn: str, layout: ParamLayout, virtual_start: tuple[int, ...]) -> str:
        """``fqn`` with each name-indexed capture replaced by its global index."""
        virtual = [d for d in layout.dims if d.virtual]
        if not virtual:
            return fqn
        if self.table is not None and fqn in self.table:
            rule = self.table[fqn].rule
        else:
            rule, _ = self.spec.match(fqn)
        m = self.spec.glob(rule).regex.match(fqn)
        assert m is not None
        out, last = [], 0
        for (s, e), k in sorted((m.span(d.name), k) for k, d in enumerate(virtual)):
            out += [fqn[last:s], str(virtual_start[k] + int(fqn[s:e]))]
            last = e
        out.append(fqn[last:])
        return "".join(out)


@dataclasses.dataclass(frozen=True)
class _Structural:
    """What :func:`canonical_plan` derives from a state dict's structure alone (no tensor
    data): reused while keys, tensor kinds, shapes and dtypes stay the same."""

    plan: CanonicalPlan
    rest: tuple[tuple[str, str], ...]  # (caller's key, stored key) for DCP's default handling
    # (caller's key, the spec's DTensor placements, ((stored key, unit), ...)) per parameter
    params: tuple[tuple[str, tuple, tuple[tuple[str, Unit], ...]], ...]


# Per spec (weakly held): structure key -> _Structural, most recently used last.
_PLANS: weakref.WeakKeyDictionary[CompiledSpec, OrderedDict[tuple, _Structural]] = (
    weakref.WeakKeyDictionary()
)
PLAN_CACHE_SIZE = 8  # structures remembered per spec (model, optimizer, both; save, load)


def _signature(flat: Mapping[str, Any]) -> tuple:
    """Everything of a flat state dict that the canonical plan depends on: keys in order,
    and per value whether it is a DTensor or another tensor, its shape and dtype, or else
    its type. Values themselves (tensor data, placements) are bound anew on every call."""
    out = []
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            out.append((key, isinstance(value, DTensor), tuple(value.shape), value.dtype))
        else:
            out.append((key, type(value)))
    return tuple(out)


def clear_plan_cache() -> None:
    """Forget every cached canonical plan (they are rebuilt on the next call)."""
    _PLANS.clear()


def canonical_plan(
    spec: CompiledSpec,
    mesh: Mesh,
    rank: int,
    flat: Mapping[str, Any],
    *,
    saving: bool = True,
) -> tuple[CanonicalPlan, dict[str, Any], dict[str, tuple[Unit, torch.Tensor]]]:
    """Cut ``flat`` (a flattened state dict) into canonical units for ``rank``.

    Saving applies the spec's checkpoint-only splits (each replica stores its own piece);
    loading does not: a rank reads every index it holds, whoever wrote it.

    Returns the plan, the entries left for DCP's default handling (under their stored
    names; see ``plan.renamed``), and ``stored key -> (unit, local tensor)``. Ignored
    entries are dropped. Parameter-shaped entries must be on the spec's layout.

    The plan depends only on the state dict's structure (keys, shapes, dtypes, which
    values are DTensors), the mesh, the rank and ``saving``; it is cached under exactly
    those, so a repeated save or load binds only this call's tensors. The returned plan is
    shared between such calls: read it, do not change it.
    """
    key = (mesh, rank, saving, _signature(flat))
    per_spec = _PLANS.get(spec)
    if per_spec is None:
        per_spec = _PLANS.setdefault(spec, OrderedDict())
    hit = per_spec.get(key)
    if hit is None:
        hit = _structural(spec, mesh, rank, flat, saving=saving)
        per_spec[key] = hit
        while len(per_spec) > PLAN_CACHE_SIZE:
            per_spec.popitem(last=False)
    else:
        per_spec.move_to_end(key)
    rest = {new: flat[old] for old, new in hit.rest}
    local: dict[str, tuple[Unit, torch.Tensor]] = {}
    for source, placements, units in hit.params:
        tensor = _local_of(flat[source], placements, source)
        for skey, unit in units:
            local[skey] = (unit, tensor)
    return hit.plan, rest, local


def _structural(
    spec: CompiledSpec, mesh: Mesh, rank: int, flat: Mapping[str, Any], *, saving: bool
) -> _Structural:
    """Build :func:`canonical_plan`'s structural part (uncached)."""
    from shardspec.runtime.dtensor import to_torch

    names = _Names(spec, mesh)
    plan = CanonicalPlan()
    rest: list[tuple[str, str]] = []
    params: list[tuple[str, tuple, tuple[tuple[str, Unit], ...]]] = []
    structure: dict[str, tuple] = {}
    chunks = []
    single: dict[tuple[ParamLayout, int], int] = {}
    counts = _virtual_counts(spec, names, flat)
    for key in sorted(flat):
        value = flat[key]
        span = names.split(key)
        if span is None:
            if ignored_key(spec, key):
                continue
            rest.append((key, key))
            structure[key] = _describe(value)
            continue
        a, b = span
        fqn = key[a:b]
        if spec.is_ignored(fqn):
            continue
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        layout = spec.layout(fqn, mesh, shape if names.table is None else None, counts.get(fqn))
        declared = layout  # what the fingerprint describes, for saving and loading alike
        if not saving and layout.ckpt:
            layout = dataclasses.replace(layout, ckpt=())
        pieces = rank_pieces(layout, mesh)
        if shape != module_shape(layout, mesh):
            # Not parameter-shaped (an optimizer step, a scalar): stored whole, once.
            vstart = pieces[rank][0].virtual_start if pieces[rank] else ()
            new_key = key[:a] + names.canonical(fqn, layout, vstart) + key[b:]
            rest.append((key, new_key))
            plan.renamed[key] = new_key
            for row in pieces:  # other ranks' names of the same entry (per-expert modules)
                if row:
                    other = names.canonical(fqn, layout, row[0].virtual_start)
                    plan.keys.add(key[:a] + other + key[b:])
            structure[key] = _describe(value)  # the caller's key: the same on every rank
            continue
        placements = tuple(to_torch(p) for p in dtensor_placements(layout, mesh))
        tensor = _local_of(value, placements, key)
        groups = replica_groups(layout, mesh)
        itemsize = tensor.element_size()
        # The same on every rank: the layout fixes every rank's chunk offsets.
        structure[key] = ("param", shape, str(tensor.dtype), declared)
        mine: list[tuple[str, Unit]] = []
        for k, piece in enumerate(pieces[rank]):
            name = names.canonical(fqn, layout, piece.virtual_start)
            if piece.component is not None:
                name = f"{name}.{piece.component}"
            skey = key[:a] + name + key[b:]
            unit = Unit(
                skey,
                key,
                piece.shape,
                piece.offsets,
                piece.sizes,
                piece.runs,
                groups[rank][k],
                itemsize,
                piece.fused,
            )
            plan.units.append(unit)
            plan.paths[skey] = (a, b, name)
            plan.dtypes[skey] = tensor.dtype
            mine.append((skey, unit))
        params.append((key, placements, tuple(mine)))
        if any(d.virtual for d in layout.dims):
            # Name-indexed modules: every rank stores other keys; visit them all.
            for r, row in enumerate(pieces):
                for k, piece in enumerate(row):
                    name = names.canonical(fqn, layout, piece.virtual_start)
                    if piece.component is not None:
                        name = f"{name}.{piece.component}"
                    skey = key[:a] + name + key[b:]
                    plan.keys.add(skey)
                    if not any(s == 0 for s in piece.sizes):
                        nbytes = math.prod(piece.sizes) * itemsize
                        chunks.append(((skey, piece.offsets), groups[r][k], nbytes))
            continue
        # Every rank stores the same keys: the parameter's name, or one per component.
        for piece in pieces[0] if pieces else ():
            comp = piece.component
            plan.keys.add(key if comp is None else key[:b] + f".{comp}" + key[b:])
        if unreplicated(layout, mesh):
            # One holder per chunk: no writer to choose. Count its bytes per rank by
            # layout (O(world) per distinct layout, not per parameter).
            single[(layout, itemsize)] = single.get((layout, itemsize), 0) + 1
            continue
        # Replicated chunks: the layout's distinct chunks, each once (a table per layout).
        for comp, offsets, replicas, n in chunk_table(layout, mesh):
            skey = key if comp is None else key[:b] + f".{comp}" + key[b:]
            chunks.append(((skey, offsets), replicas, n * itemsize))
    base = [0] * mesh.world
    for (layout, itemsize), count in single.items():
        for r, n in enumerate(rank_elements(layout, mesh)):
            base[r] += n * itemsize * count
    plan.writer = assign_writers(chunks, mesh.world, base)
    plan.fingerprint = fingerprint(structure, mesh, extra=spec.name)
    return _Structural(plan, tuple(rest), tuple(params))


def _virtual_counts(spec: CompiledSpec, names: _Names, flat: Mapping[str, Any]):
    """Where the manifest's table does not apply: modules per name-indexed dim, counted
    from the state dict."""
    if names.table is not None:
        return {}
    fqns = set()
    for key in flat:
        span = names.split(key)
        if span is not None:
            fqns.add(key[span[0] : span[1]])
    return spec.virtual_counts_of(sorted(fqns))


def _local_of(value: Any, placements: tuple, key: str) -> torch.Tensor:
    if isinstance(value, DTensor):
        got = tuple(value.placements)
        if got != placements:
            raise CheckpointError(
                f"{key}: its DTensor placements {got} differ from the spec's {placements}; "
                "the model is not on the spec's layout (was it distributed with this spec?)"
            )
        return value.to_local()
    if isinstance(value, torch.Tensor):
        return value
    raise CheckpointError(f"{key}: expected a tensor, got {type(value).__name__}")


def unit_data(unit: Unit, tensor: torch.Tensor) -> torch.Tensor:
    """The unit's chunk cut from the local tensor (a view when it is one block)."""
    if unit.runs is None:
        return tensor
    out = tensor
    for dim, runs in unit.runs:
        if len(runs) == 1:
            out = out.narrow(dim, runs[0][0], runs[0][1])
        else:
            out = torch.cat([out.narrow(dim, s, n) for s, n in runs], dim=dim)
    return out


def unit_commit(unit: Unit, tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Copy a unit's chunk back into the local tensor."""
    if unit.runs is None:
        if data.data_ptr() != tensor.data_ptr():
            tensor.copy_(data)
        return
    _commit_cuts(list(unit.runs), tensor, data)


def _commit_cuts(cuts: list, target: torch.Tensor, data: torch.Tensor) -> None:
    if not cuts:
        target.copy_(data)
        return
    (dim, runs), rest = cuts[0], cuts[1:]
    pos = 0
    for s, n in runs:
        _commit_cuts(rest, target.narrow(dim, s, n), data.narrow(dim, pos, n))
        pos += n


def unit_commit_box(
    unit: Unit,
    tensor: torch.Tensor,
    offsets: Sequence[int],
    lengths: Sequence[int],
    data: torch.Tensor,
) -> None:
    """Copy ``data``, the box ``offsets``/``lengths`` of a unit's chunk (in the chunk's own
    coordinates, as a read item's ``dest_offsets``/``lengths``), into the local tensor."""
    _commit_box(dict(unit.runs or ()), 0, tensor, data, tuple(offsets), tuple(lengths))


def _commit_box(
    cuts: dict[int, tuple[tuple[int, int], ...]],
    d: int,
    target: torch.Tensor,
    data: torch.Tensor,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
) -> None:
    if d == len(offsets):
        target.copy_(data)
        return
    o, n = offsets[d], lengths[d]
    runs = cuts.get(d)
    if runs is None:  # not cut: the chunk spans the local tensor's whole dimension
        _commit_box(cuts, d + 1, target.narrow(d, o, n), data, offsets, lengths)
        return
    pos = 0  # where each run starts in the chunk
    for start, m in runs:
        lo, hi = max(pos, o), min(pos + m, o + n)
        if lo < hi:
            _commit_box(
                cuts,
                d + 1,
                target.narrow(d, start + lo - pos, hi - lo),
                data.narrow(d, lo - o, hi - lo),
                offsets,
                lengths,
            )
        pos += m


class _Sink(torch.Tensor):
    """A staging tensor without storage. ``FileSystemReader`` copies each chunk it read
    into the tensor ``resolve_tensor`` returns, then calls ``commit_tensor`` with it; a
    sink keeps a reference to the chunk instead of copying it, so the chunk as read is the
    staged copy (one copy of every byte less, and no separate buffer to fault in). Any
    other use raises: only readers known to do just that get sinks."""

    source: torch.Tensor | None

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype) -> _Sink:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")
        t.source = None
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        if func is torch.ops.aten.copy_.default and isinstance(args[1], torch.Tensor):
            args[0].source = args[1]
            return args[0]
        raise CheckpointError(f"staging sink: unexpected {func} from the storage reader")


def reader_fills_sinks(reader: Any) -> bool:
    """Whether ``reader`` reads tensors the way :class:`_Sink` relies on: DCP's own
    ``FileSystemReader.read_data`` (``resolve_tensor(...).detach().copy_(chunk)``, then
    ``commit_tensor``), not overridden."""
    own = getattr(dcp.FileSystemReader, "read_data", None)
    return own is not None and getattr(type(reader), "read_data", None) is own


def _mesh_and_rank(spec: CompiledSpec, mesh: Any) -> tuple[Mesh, int]:
    mesh = mesh if mesh is not None else spec.last_mesh
    if mesh is None:
        raise CheckpointError(
            "no mesh: pass mesh=... to the planner, or build it with build_mesh()/distribute()"
        )
    lm = spec.layout_mesh(mesh)
    coord = mesh.get_coordinate() if hasattr(mesh, "get_coordinate") else None
    rank = lm.rank_of(coord) if coord is not None else dist.get_rank()
    return lm, rank


# ----------------------------------------------------------------------------- save


def _stored_mappings(plan: CanonicalPlan, mappings: dict[str, tuple]) -> dict[str, tuple]:
    """DCP's flat-key -> object-path mappings for the stored (canonical) keys."""
    out = dict(mappings)
    for old, new in plan.renamed.items():
        if old in out:
            out[new] = out.pop(old)
    for unit in plan.units:
        path = mappings.get(unit.source)
        if path is not None:
            a, b, name = plan.paths[unit.key]
            out[unit.key] = rename_path(path, unit.source, a, b, name)
    stored = {u.key for u in plan.units}
    for unit in plan.units:
        if unit.source not in stored:  # a source stored under its own name keeps its path
            out.pop(unit.source, None)
    return out


def _same_structure_everywhere(plan: CanonicalPlan) -> None:
    """Refuse to save when ranks' state dicts differ in structure: they would choose
    writers differently and some chunks would be written by nobody. One small all_gather,
    independent of any plan cache."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    import hashlib

    mine = (
        plan.fingerprint
        + ":"
        + hashlib.sha256(repr(sorted(plan.writer.items())).encode()).hexdigest()[:16]
    )
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if len(set(every)) > 1:
        odd = [r for r, d in enumerate(every) if d != every[0]]
        raise CheckpointError(
            "ranks disagree on the checkpoint's structure (different keys, shapes or dtypes "
            f"in their state dicts; rank(s) {odd} differ from rank 0), so they would choose "
            "different writers; nothing was saved"
        )


@functools.lru_cache(maxsize=1)
def _dcp_caches_pending_plans() -> bool:
    """Whether the installed DCP caches local plans the way this planner relies on."""
    import inspect

    cache = getattr(SavePlanner, "_cached_save_plan", None)
    try:
        promotes = "_pending_local_plan" in inspect.getsource(DefaultSavePlanner.finish_plan)
    except (OSError, TypeError):
        promotes = False
    return isinstance(cache, dict) and promotes


def _grid_overlaps(
    chunks: list[ChunkStorageMetadata],
) -> tuple[list[tuple[Any, Any]], list[dict[int, int]]] | None:
    """Overlapping chunk pairs, found in linear time where the chunks form a grid: in every
    dimension, the distinct intervals the chunks span are pairwise disjoint. Then two chunks
    overlap exactly when they span the same interval in every dimension, that is, when they
    are the same box. Also returns those intervals (``offset -> size`` per dimension).
    Returns None where the chunks are not such a grid (or one is empty): the caller then
    runs DCP's general check."""
    ndim = len(chunks[0].offsets)
    spans: list[dict[int, int]] = [{} for _ in range(ndim)]
    boxes: dict[tuple, Any] = {}
    overlaps = []
    for c in chunks:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        if len(offsets) != ndim or len(sizes) != ndim or min(sizes, default=1) <= 0:
            return None
        first = boxes.setdefault((offsets, sizes), c)
        if first is not c:
            overlaps.append((c, first))
            continue
        for d in range(ndim):
            if spans[d].setdefault(offsets[d], sizes[d]) != sizes[d]:
                return None  # two different intervals start at the same offset
    for per_dim in spans:
        starts = sorted(per_dim.items())
        for (o, n), (o2, _) in itertools.pairwise(starts):
            if o + n > o2:
                return None
    return overlaps, spans


def _dcp_validate(global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
    """DCP's own global-plan check, as a list of errors (older DCPs return a bool)."""
    from torch.distributed.checkpoint import default_planner

    check = getattr(default_planner, "_validate_global_plan", None)
    if check is None:  # not in any DCP this supports; nothing to add
        return []
    got = check(global_plan, metadata)
    if isinstance(got, bool):
        return [] if got else [f"{sorted(metadata.state_dict_metadata)}: DCP's check failed"]
    return list(got)


def validate_global_plan(global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
    """The checks of DCP's ``_validate_global_plan`` (chunks inside the tensor, no two
    overlapping, their volumes summing to the tensor's), in time linear in the number of
    chunks wherever a tensor's chunks form a grid, as shardspec's canonical chunks do. DCP's
    own sweep is quadratic for FSDP x TP grids (every FSDP chunk of a TP column overlaps
    every other on its sweep dimension). Tensors whose chunks are not a grid go through
    DCP's own check, so a plan is rejected exactly when DCP would reject it."""
    errors: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        if not isinstance(value, TensorStorageMetadata) or len(value.size) == 0:
            continue
        chunks = value.chunks
        grid = _grid_overlaps(chunks) if chunks else None
        size = tuple(value.size)
        if grid is None or len(size) != len(grid[1]):
            errors += _dcp_validate(global_plan, Metadata({key: value}))
            continue
        overlaps, spans = grid
        # A chunk is inside the tensor when its interval in every dimension is.
        outside = [
            (d, o)
            for d, per_dim in enumerate(spans)
            for o, n in per_dim.items()
            if o < 0 or o + n > size[d]
        ]
        for d, o in outside:
            bad = next(c for c in chunks if c.offsets[d] == o)
            errors.append(f"key:{key} has out of bounds chunk: tensor-size:{size} chunk: {bad}")
        volume = sum(math.prod(c.sizes) for c in chunks)
        errors += [f"key:{key} has overlapping chunks: {a} {b}" for a, b in overlaps]
        if len(global_plan) > 1 and volume != math.prod(size):
            errors.append(
                f"key:{key} invalid fill tensor-volume: {math.prod(size)} chunks-volume: {volume}"
            )
    return errors


class ShardspecSavePlanner(DefaultSavePlanner):
    """Saves a state dict in the spec's canonical, topology-independent layout.

    ``role`` names the cache: give the model and the optimizer planners different roles
    if they are used for separate saves (their fingerprints differ anyway).
    """

    def __init__(
        self,
        spec: CompiledSpec,
        mesh: Any = None,
        *,
        role: str = "state",
        enable_plan_caching: bool = True,
    ) -> None:
        # Plan caching needs DCP's cache protocol (a class-level cache of local plans that
        # finish_plan fills from a pending plan, as in torch 2.13). Where the installed DCP
        # differs, plans are simply never reused: slower to plan, never stale.
        caching = enable_plan_caching and _dcp_caches_pending_plans()
        try:
            super().__init__(enable_plan_caching=caching)
        except TypeError:  # a DCP without plan caching at all
            super().__init__()
            self._enable_plan_caching = False
        self.spec = spec
        self.role = role
        self._mesh_arg = mesh

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        flat, mappings = _flat(state_dict)
        self.lmesh, self.rank = _mesh_and_rank(self.spec, self._mesh_arg)
        self.canon, rest, self.local = canonical_plan(self.spec, self.lmesh, self.rank, flat)
        self.mappings = _stored_mappings(self.canon, mappings)
        self.state_dict = rest
        self.is_coordinator = is_coordinator
        _same_structure_everywhere(self.canon)
        # A cache of its own: spec, role and structure fingerprint (keys, shapes, dtypes,
        # chunk offsets, mesh). DCP's default key is the class name, shared by every
        # instance, and its plan comparison ignores dtypes.
        self._cached_plans_key = f"shardspec:{self.spec.name}:{self.role}:{self.canon.fingerprint}"

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for unit in self.canon.units:
            if unit.empty or self.canon.writer_of(unit.key, unit.offsets, unit.replicas) != (
                self.rank
            ):
                continue
            _, tensor = self.local[unit.key]
            items.append(
                WriteItem(
                    index=MetadataIndex(unit.key, torch.Size(unit.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=torch.Size(unit.offsets), sizes=torch.Size(unit.sizes)
                        ),
                        properties=TensorProperties(dtype=tensor.dtype),
                        size=torch.Size(unit.shape),
                    ),
                )
            )
        rest = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        plan = SavePlan(items + list(rest.items), planner_data=self.mappings)
        self.plan = plan
        if self._enable_plan_caching:
            from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)  # type: ignore[attr-defined]
            if cached is not None and _compare_save_plans(plan, cached):
                return SavePlan([], usable=False)
            self._pending_local_plan = plan
        return plan

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """The coordinator's step, as DCP's (dedup, metadata, merged object paths), with
        :func:`validate_global_plan` in place of DCP's quadratic check. DCPs without this
        method (their ``create_global_plan`` does it inline) keep their own code."""
        from collections import ChainMap

        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        dedup = getattr(self, "_dedup_save_plans", None)
        with _no_gc():  # a million small objects at scale: no full collections meanwhile
            if dedup is None:  # DCPs with _create_global_plan have it
                from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

                deduped = dedup_save_plans(all_plans)
            else:
                deduped = dedup(all_plans)
            global_plan, metadata = create_default_global_save_plan(deduped)
            if getattr(self, "flatten_state_dict", True):
                merged = dict(ChainMap(*(p.planner_data for p in global_plan)))
                metadata = dataclasses.replace(metadata, planner_data=merged)
            errors = validate_global_plan(global_plan, metadata)
        if errors:
            summary = "; ".join(errors)
            if len(summary) > 500:
                summary = summary[:500] + "... (truncated)"
            raise ValueError(f"Failed to validate global plan: {summary}")
        return global_plan, metadata

    def resolve_data(self, write_item: WriteItem):
        hit = self.local.get(write_item.index.fqn)
        if hit is not None:
            unit, tensor = hit
            return unit_data(unit, tensor)
        return super().resolve_data(write_item)

    def bytes_written(self) -> int:
        """Bytes of tensor data this rank writes under the current plan."""
        return sum(
            u.nbytes
            for u in self.canon.units
            if not u.empty and self.canon.writer_of(u.key, u.offsets, u.replicas) == self.rank
        )


# ----------------------------------------------------------------------------- load


class ShardspecLoadPlanner(DefaultLoadPlanner):
    """Loads a canonical checkpoint into any mesh the spec allows, validating first.

    ``partial=True`` allows keys missing from the checkpoint (they keep their values; see
    ``skipped``) and keys the state dict does not ask for. ``staging=True`` reads every
    chunk into a separate buffer, and ``commit()`` then copies them into the live tensors
    (``load`` does this once every rank's reads succeeded). With ``capture`` (set by
    ``load`` where the reader is DCP's ``FileSystemReader``) the chunks as read are those
    buffers (see :class:`_Sink`). With ``staging=False`` (a plain
    ``dcp.load(..., planner=LoadPlanner())``) chunks land in the live tensors as they arrive
    (units cut in several runs through a short-lived buffer per read).
    """

    def __init__(
        self,
        spec: CompiledSpec,
        mesh: Any = None,
        *,
        partial: bool = False,
        staging: bool = False,
    ) -> None:
        super().__init__(allow_partial_load=partial)
        self.spec = spec
        self._mesh_arg = mesh
        self.partial = partial
        self.staging = staging
        # Set by load() where the reader fills sinks: staged chunks are the tensors as read.
        self.capture = False
        self._buffers: dict[str, torch.Tensor] = {}
        self._rest_buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # Captured chunks: (stored key, dest_offsets, lengths) -> data, in read order.
        self._pieces: dict[tuple[str, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        self.skipped: list[str] = []

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator=False):
        if metadata is None:
            raise CheckpointError("the checkpoint has no metadata")
        self.original_state_dict = state_dict
        flat, self.flat_mappings = _flat(state_dict)
        self.lmesh, self.rank = _mesh_and_rank(self.spec, self._mesh_arg)
        self.canon, rest, self.local = canonical_plan(
            self.spec, self.lmesh, self.rank, flat, saving=False
        )
        self.stored_to_own = {new: old for old, new in self.canon.renamed.items()}
        self.state_dict = rest  # keyed by stored names
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._legacy, self.skipped = validate(
            self.canon, rest, metadata, self.spec, partial=self.partial
        )

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        md = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        skipped = set(self.skipped)
        for unit in self.canon.units:
            if unit.empty or unit.key in skipped:
                continue
            chunk = ChunkStorageMetadata(torch.Size(unit.offsets), torch.Size(unit.sizes))
            if unit.key in md:
                items.extend(create_read_items_for_chunk_list(unit.key, md[unit.key], [chunk]))
            else:
                items.extend(self._legacy_reads(unit))
        present = {k: v for k, v in self.state_dict.items() if k in md}
        rest_plan = create_default_local_load_plan(present, self.metadata, False)
        return LoadPlan(items + list(rest_plan.items))

    def _legacy_reads(self, unit: Unit) -> list[ReadItem]:
        """Read a component out of a fused tensor that DCP's default planner saved whole
        under the parameter's own key: one read per group the chunk touches."""
        assert unit.fused is not None and self.metadata is not None
        source = self._legacy[unit.key]
        md = self.metadata.state_dict_metadata[source]
        dim, where, _ = unit.fused
        items = []
        pos = 0  # position in the component's own numbering
        for start, length in where:
            lo = max(unit.offsets[dim], pos)
            hi = min(unit.offsets[dim] + unit.sizes[dim], pos + length)
            if lo < hi:
                offs, sizes = list(unit.offsets), list(unit.sizes)
                offs[dim], sizes[dim] = start + lo - pos, hi - lo
                chunk = ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes))
                for it in create_read_items_for_chunk_list(source, md, [chunk]):
                    dest = list(it.dest_offsets)
                    dest[dim] += lo - unit.offsets[dim]
                    items.append(
                        dataclasses.replace(
                            it,
                            dest_index=MetadataIndex(unit.key, torch.Size(unit.offsets)),
                            dest_offsets=torch.Size(dest),
                        )
                    )
            pos += length
        return items

    def _buffer(self, key: str) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None:
            unit, tensor = self.local[key]
            if self.staging or unit.runs is not None:
                buf = torch.empty(unit.sizes, dtype=tensor.dtype, device=tensor.device)
            else:
                buf = tensor
            self._buffers[key] = buf
        return buf

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.local:
            return self._buffer(index.fqn)
        from torch.distributed.checkpoint.utils import find_state_dict_object

        target = find_state_dict_object(self.state_dict, index)
        if not self.staging:
            return target
        hit = self._rest_buffers.get(index.fqn)
        if hit is None:
            hit = (torch.empty_like(target), target)
            self._rest_buffers[index.fqn] = hit
        return hit[0]

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        key = read_item.dest_index.fqn
        hit = self.local.get(key)
        if hit is not None:
            unit, live = hit
            if self.staging and self.capture:
                return _Sink(tuple(read_item.lengths), live.dtype)
            if not self.staging and unit.runs is not None:
                # A unit cut in runs: a buffer for this one read, committed and dropped
                # in commit_tensor (short-lived, so the allocator reuses its memory).
                return torch.empty(tuple(read_item.lengths), dtype=live.dtype, device=live.device)
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        key = read_item.dest_index.fqn
        if isinstance(tensor, _Sink):
            data = tensor.source
            if data is None:
                raise CheckpointError(f"{key}: the storage reader left a chunk unread")
            if 2 * data.numel() * data.element_size() < data.untyped_storage().nbytes():
                data = data.clone()  # a small part of a large stored chunk: hold only it
            self._pieces[(key, tuple(read_item.dest_offsets), tuple(read_item.lengths))] = data
            return
        if key in self.local and not self.staging:
            unit, live = self.local[key]
            if unit.runs is not None:  # the read's buffer, into the unit's runs
                unit_commit_box(unit, live, read_item.dest_offsets, read_item.lengths, tensor)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        from torch.distributed.checkpoint._nested_dict import set_element

        stored = read_item.dest_index.fqn
        own = self.stored_to_own.get(stored, stored)
        obj = torch.load(value, weights_only=False)
        path = self.flat_mappings.get(own)
        if path is None:
            self.state_dict[stored] = obj
        else:
            set_element(self.original_state_dict, path, obj)

    def commit(self) -> None:
        """Copy staged chunks into the live tensors (after every rank's reads succeeded)."""
        for key, buf in self._buffers.items():
            unit, live = self.local[key]
            unit_commit(unit, live, buf)
        for (key, offsets, lengths), data in self._pieces.items():
            unit, live = self.local[key]
            unit_commit_box(unit, live, offsets, lengths, data)
        for buf, target in self._rest_buffers.values():
            target.copy_(buf)
        self._buffers.clear()
        self._pieces.clear()
        self._rest_buffers.clear()


def validate(
    canon: CanonicalPlan,
    rest: Mapping[str, Any],
    metadata: Metadata,
    spec: CompiledSpec,
    *,
    partial: bool,
) -> tuple[dict[str, str], list[str]]:
    """Compare what the state dict asks for with the checkpoint's metadata, before any
    read. Returns fused-tensor fallbacks (stored key -> key saved whole) and the keys that
    a partial load skips. Raises one :class:`CheckpointError` naming every problem."""
    md = metadata.state_dict_metadata
    problems: list[str] = []
    legacy: dict[str, str] = {}
    skipped: list[str] = []
    expected: set[str] = set()
    seen: set[str] = set()
    for unit in canon.units:
        if unit.key in seen:
            continue
        seen.add(unit.key)
        have = md.get(unit.key)
        if have is None and unit.fused is not None:
            whole = md.get(unit.source)
            if isinstance(whole, TensorStorageMetadata) and tuple(whole.size) == unit.fused[2]:
                legacy[unit.key] = unit.source
                expected.add(unit.source)
                have = whole
        else:
            expected.add(unit.key)
        if have is None:
            (skipped if partial else problems).append(
                unit.key if partial else f"missing: {unit.key} (global shape {list(unit.shape)})"
            )
            continue
        if not isinstance(have, TensorStorageMetadata):
            problems.append(f"{unit.key}: stored as bytes, but the state dict has a tensor")
            continue
        want_shape = unit.fused[2] if unit.key in legacy and unit.fused else unit.shape
        if tuple(have.size) != tuple(want_shape):
            problems.append(
                f"{unit.key}: global shape {list(have.size)} in the checkpoint, "
                f"{list(want_shape)} in the state dict"
            )
        dtype = canon.dtypes.get(unit.key)
        if dtype is not None and have.properties.dtype != dtype:
            problems.append(
                f"{unit.key}: dtype {have.properties.dtype} in the checkpoint, "
                f"{dtype} in the state dict"
            )
    for key, value in rest.items():
        expected.add(key)
        have = md.get(key)
        if have is None:
            if not partial:
                problems.append(f"missing: {key}")
            continue
        if isinstance(value, torch.Tensor) and isinstance(have, TensorStorageMetadata):
            if tuple(have.size) != tuple(value.shape):
                problems.append(
                    f"{key}: shape {list(have.size)} in the checkpoint, "
                    f"{list(value.shape)} in the state dict"
                )
            elif have.properties.dtype != value.dtype:
                problems.append(
                    f"{key}: dtype {have.properties.dtype} in the checkpoint, "
                    f"{value.dtype} in the state dict"
                )
    if not partial:
        for key in sorted(md):
            if key in expected or key in canon.keys or ignored_key(spec, key):
                continue
            problems.append(f"unexpected: {key} (in the checkpoint, not in the state dict)")
    if problems:
        raise CheckpointError(
            f"the checkpoint does not match the state dict ({len(problems)} problem(s)); "
            "nothing was read:\n  " + "\n  ".join(problems)
        )
    return legacy, skipped


# ----------------------------------------------------------------------------- helpers


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(
    spec: CompiledSpec,
    state: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    mesh: Any = None,
    planner: ShardspecSavePlanner | None = None,
) -> ShardspecSavePlanner:
    """Save ``state`` to ``path`` atomically: written to ``<path>.partial`` first, marked
    complete (``.shardspec.json``), then moved into place. A save that fails on any rank
    leaves ``path`` as it was, and the partial directory unmarked."""
    path = os.fspath(path)
    tmp = path + ".partial"
    if _rank0() and os.path.exists(tmp):
        shutil.rmtree(tmp)
    _barrier()
    planner = planner or ShardspecSavePlanner(spec, mesh)
    try:
        with _no_gc():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=planner)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        found = _first_checkpoint_error(e)
        if found is not None:
            raise found from None
        ranks = sorted(getattr(e, "failures", {}) or [])
        where = f" on rank(s) {ranks}" if ranks else ""
        raise CheckpointError(
            f"saving {path} failed{where}: {path} is unchanged, and {tmp} is not marked "
            f"complete:\n{e}"
        ) from e
    _barrier()
    if _rank0():
        marker = {
            "format": "shardspec-checkpoint/1",
            "spec": spec.name,
            "fingerprint": planner.canon.fingerprint,
            "mesh": dict(zip(planner.lmesh.names, planner.lmesh.sizes, strict=True)),
        }
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=1, sort_keys=True)
        old = path + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    _barrier()
    return planner


def load(
    spec: CompiledSpec,
    state: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    mesh: Any = None,
    partial: bool = False,
    locality: bool = True,
    storage_reader: Any = None,
    atomic: bool = True,
) -> ShardspecLoadPlanner:
    """Load ``path`` into ``state`` in place. Validates everything before reading, reads
    into staging buffers, and changes the live tensors only after every rank's reads
    succeeded: a failed load leaves the model as it was.

    With ``locality`` (the default), a checkpoint saved on this very mesh with this very
    structure is read file-locally: each rank opens only the files it wrote, and replicas
    receive their copies from the writer (see :mod:`shardspec.runtime.locality`).

    ``atomic=False`` trades the guarantee for speed: after the same validation, DCP reads
    straight into the live tensors (no staging memory, no file locality), as fast as the
    planner alone. A read that fails then (a file truncated or removed after validation, an
    I/O error) leaves the tensors it had reached loaded and the others as they were."""
    path = os.fspath(path)
    meta = os.path.join(path, ".metadata")
    if not os.path.isfile(meta):
        partial_dir = os.path.exists(path + ".partial")
        more = f" ({path}.partial is an unfinished save)" if partial_dir else ""
        raise CheckpointError(f"{meta} is missing: {path} is not a complete DCP checkpoint{more}")
    marker = _read_marker(path) if locality and atomic else None
    planner: ShardspecLoadPlanner
    if not atomic:
        planner = ShardspecLoadPlanner(spec, mesh, partial=partial, staging=False)
    elif marker is not None:
        from shardspec.runtime.locality import LocalityLoadPlanner

        planner = LocalityLoadPlanner(spec, mesh, marker=marker, partial=partial)
    else:
        planner = ShardspecLoadPlanner(spec, mesh, partial=partial, staging=True)
    reader = storage_reader if storage_reader is not None else dcp.FileSystemReader(path)
    planner.capture = reader_fills_sinks(reader)
    try:
        with _no_gc():
            dcp.load(state, storage_reader=reader, planner=planner)
        exchange = getattr(planner, "exchange", None)
        if exchange is not None:
            exchange()
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException: name it all
        found = _first_checkpoint_error(e)
        if found is not None:
            raise found from None
        state_of = "the model was not changed" if atomic else "the model may be partly loaded"
        raise CheckpointError(f"reading {path} failed; {state_of}:\n{e}") from e
    planner.commit()
    return planner


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """No cyclic garbage collection during a save or load: planning allocates many small
    objects, and a full collection on one rank (often the coordinator) stalls every rank."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read_marker(path: str) -> dict | None:
    """The checkpoint's ``.shardspec.json``, or None (a default-planner checkpoint)."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _first_checkpoint_error(e: BaseException) -> CheckpointError | None:
    """DCP re-raises rank failures wrapped; find our own validation error inside."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for wrapped in failures.values():
            # DCP keeps each rank's failure as (exception, traceback summary).
            exc = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            if isinstance(exc, CheckpointError):
                return exc
    if isinstance(e.__cause__, CheckpointError):
        return e.__cause__
    return None
