"""A state dict cut into the spec's canonical storage units, for one rank.

Checkpoints (:mod:`shardspec.runtime.checkpoint`) and Hugging Face load/export
(:mod:`shardspec.runtime.hf`) both work on these units: every parameter-shaped entry (a
DTensor on the spec's layout, or a Megatron-style local shard) becomes the chunks it holds
of its stored tensors (``<fqn>``, ``<fqn>.<component>`` for a fused dimension, global
expert indices for name-indexed modules), with how to cut them from, and copy them back
into, the local tensor. Plans are cached per spec under the state dict's structure and the
mesh, so a repeated save or load only binds the current tensors.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardspec.core import keylayouts
from shardspec.core.layout import (
    Mesh,
    ParamLayout,
    dtensor_mesh,
    dtensor_placements,
    module_shape,
    same_layout,
    storage_units,
)
from shardspec.runtime.canonical import (
    CanonicalPlan,
    Unit,
    WholeFused,
    assign_writers,
    chunk_table,
    fingerprint,
    rank_elements,
    rank_pieces,
    replica_groups,
    stage_writers,
    stored_whole,
    unreplicated,
)
from shardspec.runtime.spec import CompiledSpec, SpecError


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked; names every key or file."""


@dataclasses.dataclass(frozen=True)
class KeyLayout:
    """The checkpoint keys of a trainer that stores what its model's ``state_dict()``
    returns (``keys=`` of ``save``/``load`` and the planners): a fused parameter whose
    module's state-dict hooks split it is stored as the hooks present it, each component
    under the key the hook writes; every other fused tensor (the model's entry of a fused
    parameter no hook splits, and optimizer state, which the trainer names by parameter) is
    stored whole under its own name. Everything else is as in shardspec's own layout.

    ``split``: the leaf name of a fused module -> the leaf names of the modules its
    components are presented as, in the spec's declared order (torchtitan:
    ``qkv_linear.wqkv.weight`` -> ``qkv_linear.wq.weight``, ``wk``, ``wv``)."""

    name: str
    split: tuple[tuple[str, tuple[str, ...]], ...]
    # Flat keys ending so that the trainer neither writes nor reads (torchtitan's flat
    # optimizer state has no ``param_groups.<fqn>.param_names``, which torch's has).
    skip: tuple[str, ...] = ()
    # (the leaf name of a fused parameter, its tensor's dimension count, the keys under its
    # module that the hook writes its squeezed components as): torchtitan's FusedSwiGLU
    # ``feed_forward.w13`` -> ``feed_forward.w1.weight``, ``feed_forward.w3.weight``.
    params: tuple[tuple[str, int, tuple[str, ...]], ...] = ()

    def component_keys(
        self, fqn: str, components: Sequence[str], ndim: int = 0, squeezed: bool = False
    ) -> tuple[str, ...] | None:
        """The names ``fqn``'s components (declared order) are stored under, or None where
        no hook splits it (stored whole). ``ndim``: the parameter's tensor dimensions;
        ``squeezed``: whether the spec declares its components squeezed (`fuse ...
        squeezed`), as a hook of :attr:`params` writes them."""
        module, _, leaf_param = fqn.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        keys = keylayouts.param_split_of(self.params, fqn, ndim)
        if keys is not None:
            if len(keys) != len(components) or not squeezed:
                raise CheckpointError(
                    f"{fqn}: keys={self.name!r} stores its components as "
                    f"{', '.join(keys)}, each one index of the fused dimension, squeezed (as "
                    f"the trainer's state-dict hook writes them), but the spec declares "
                    f"{len(components)} ({', '.join(components)})"
                    + (" squeezed" if squeezed else ", not squeezed")
                    + "; declare them `fuse DIM as "
                    + ", ".join(k.partition(".")[0] for k in keys)
                    + " squeezed`"
                )
            return tuple(f"{module}.{k}" if module else k for k in keys)
        names = dict(self.split).get(leaf)
        if names is None:
            return None
        if len(names) != len(components):
            raise CheckpointError(
                f"{fqn}: keys={self.name!r} stores the components of a fused `{leaf}` as "
                f"{', '.join(names)} (as the trainer's state-dict hook presents them), but the "
                f"spec declares {len(components)} ({', '.join(components)}); declare them in "
                "that order"
            )
        pre = f"{parent}." if parent else ""
        return tuple(f"{pre}{n}.{leaf_param}" for n in names)

    def sources(self, key: str) -> tuple[str, ...]:
        """The fused parameters whose component the trainer's hook would present as
        ``key`` (``...qkv_linear.wq.weight`` -> ``...qkv_linear.wqkv.weight``)."""
        module, _, leaf_param = key.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        pre = f"{parent}." if parent else ""
        out = [f"{pre}{fused}.{leaf_param}" for fused, names in self.split if leaf in names]
        for param, _, keys in self.params:  # a squeezed component: <module>.<its key>
            out.extend(
                key[: len(key) - len(k)] + param for k in keys if key == k or key.endswith("." + k)
            )
        return tuple(out)


# torchtitan (torchtitan/models/common/attention.py, FusedQKVLinear, and
# torchtitan/components/checkpointer/dcp.py, which saves model.state_dict(): read at
# commit b5bcd76 and in the torchtitan 0.3.0 wheel).
TORCHTITAN = KeyLayout(
    "torchtitan",
    keylayouts.SPLITS["torchtitan"],
    (".param_names",),
    keylayouts.PARAM_SPLITS["torchtitan"],
)
KEY_LAYOUTS = {"torchtitan": TORCHTITAN}


def key_layout(keys: str | KeyLayout | None, spec: CompiledSpec | None = None) -> KeyLayout | None:
    """``keys=`` as given: ``"shardspec"`` (shardspec's own layout), a name of
    :data:`KEY_LAYOUTS`, or a :class:`KeyLayout`; None: the spec's `checkpoint keys`
    statement (shardspec's own without one, or without ``spec``)."""
    if keys is None and spec is not None:
        keys = spec.checkpoint_keys
    if keys is None or keys == keylayouts.OWN or isinstance(keys, KeyLayout):
        return keys if isinstance(keys, KeyLayout) else None
    if isinstance(keys, str) and keys in KEY_LAYOUTS:
        return KEY_LAYOUTS[keys]
    known = ", ".join(repr(k) for k in ("shardspec", *KEY_LAYOUTS))
    raise CheckpointError(f"keys={keys!r} is no checkpoint key layout; known: {known}")


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


class Names:
    """Finds parameter names inside flat state-dict keys, and their canonical names."""

    def __init__(self, spec: CompiledSpec, mesh: Mesh, rank: int | None = None) -> None:
        self.spec = spec
        # The manifest's table (None where it does not describe the model on this mesh);
        # names are looked up in it directly, never listed.
        self.table = spec.table(mesh)
        # Pipeline stages: a rank's state dict holds its stage's parameters, under the stage
        # model's names (global, or numbered from 0 per stage with `split ... local`).
        self.stages = spec.stage_plan(mesh) if rank is not None else None
        self.stage: int | None = None
        if self.stages is not None:
            self.stage = spec.stage_of(mesh, mesh.coord_of(rank))  # type: ignore[arg-type]

    def global_of(self, name: str) -> str:
        """The whole model's name of a parameter name found in a key (itself without
        pipeline stages)."""
        if self.stages is None:
            return name
        g = self.stages.global_name(name, self.stage)  # type: ignore[arg-type]
        return name if g is None else g

    def other_stages(self) -> frozenset[str]:
        """Global names of the parameters and persistent buffers other pipeline stages hold
        (empty without)."""
        if self.stages is None:
            return frozenset()
        sp = self.stages
        out = {f for f in sp.stage if self.stage not in sp.stages_of(f)}
        out.update(b for b, held in sp.buffer_stages.items() if self.stage not in held)
        return frozenset(out)

    def foreign_buffer(self, key: str) -> str | None:
        """The persistent buffer of another pipeline stage that flat key ``key`` names, if
        any: the stage model holds what the pipeline block places elsewhere."""
        if self.stages is None or not self.stages.buffer_stages:
            return None
        held = self.stages.buffer_stages
        starts = _dot_starts(key)
        stops = [i for i, ch in enumerate(key) if ch == "."] + [len(key)]
        for a in starts:
            for b in stops:
                part = key[a:b]
                if b > a and part in held:
                    if self.stages.global_name(part, self.stage) is None:  # type: ignore[arg-type]
                        return part
        return None

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
        """Whether ``name`` is a parameter or a persistent buffer (stored as a unit of its
        own, as parameters are) of this rank's model."""
        if self.stages is not None:
            g = self.stages.global_name(name, self.stage)  # type: ignore[arg-type]
            if g is None:
                return False
            return self.spec.stores_buffer(g) or self.table is None or g in self.table
        if self.spec.stores_buffer(name):
            return True
        if self.table is not None:
            return name in self.table
        try:
            self.spec.match(name)
        except SpecError:
            return False
        return True

    def shape_for_layout(self, fqn: str, value: Any) -> tuple[int, ...] | None:
        """The shape :meth:`CompiledSpec.layout` needs for ``fqn`` holding ``value``: the
        tensor's where the manifest's table does not describe it (no table, or a buffer,
        which the table does not list), else None (the table's)."""
        if self.table is not None and not self.spec.stores_buffer(fqn):
            return None
        return tuple(value.shape) if isinstance(value, torch.Tensor) else None

    def name_indexed_spans(self, fqn: str, layout: ParamLayout) -> list[tuple[int, int]]:
        """Where, in ``fqn``, the captures behind the layout's name-indexed dims are (in
        dim order); empty for a parameter without such dims."""
        indexed = [d for d in layout.dims if d.name_indexed]
        if not indexed:
            return []
        p = self.table.get(fqn) if self.table is not None else None
        rule = p.rule if p is not None else self.spec.match(fqn)[0]
        m = self.spec.glob(rule).regex.match(fqn)
        assert m is not None
        return [m.span(d.name) for d in indexed]

    def canonical(
        self,
        fqn: str,
        layout: ParamLayout,
        name_indexed_start: tuple[int, ...],
        spans: list[tuple[int, int]] | None = None,
    ) -> str:
        """``fqn`` with each name-indexed capture replaced by its global index (``spans``:
        :meth:`name_indexed_spans`, when the caller has them)."""
        spans = self.name_indexed_spans(fqn, layout) if spans is None else spans
        if not spans:
            return fqn
        out, last = [], 0
        for (s, e), k in sorted((span, k) for k, span in enumerate(spans)):
            out += [fqn[last:s], str(name_indexed_start[k] + int(fqn[s:e]))]
            last = e
        out.append(fqn[last:])
        return "".join(out)


@dataclasses.dataclass(frozen=True)
class _Structural:
    """What :func:`canonical_plan` derives from a state dict's structure alone (no tensor
    data): reused while keys, tensor kinds, shapes and dtypes stay the same."""

    plan: CanonicalPlan
    rest: tuple[tuple[str, str], ...]  # (caller's key, stored key) for DCP's default handling
    # (caller's key, the spec's DTensor layout, ((stored key, unit), ...)) per parameter
    params: tuple[tuple[str, Expected, tuple[tuple[str, Unit], ...]], ...]


# Per spec (weakly held): structure key -> _Structural, most recently used last.
_PLANS: weakref.WeakKeyDictionary[CompiledSpec, OrderedDict[tuple, _Structural]] = (
    weakref.WeakKeyDictionary()
)
PLAN_CACHE_SIZE = 8  # structures remembered per spec (model, optimizer, both; save, load)


def _signature(flat: Mapping[str, Any]) -> tuple:
    """Everything of a flat state dict that the canonical plan depends on: keys in order,
    and per value whether it is a DTensor or another tensor, its shape and dtype, or else
    its type. Values themselves (tensor data, placements) are bound anew on every call."""
    out: list[tuple[Any, ...]] = []
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
    keys: KeyLayout | None = None,
    stored: bool = False,
) -> tuple[CanonicalPlan, dict[str, Any], dict[str, tuple[Unit, torch.Tensor]]]:
    """Cut ``flat`` (a flattened state dict) into canonical units for ``rank``.

    Saving applies the spec's checkpoint-only splits (each replica stores its own piece);
    loading does not: a rank reads every index it holds, whoever wrote it.

    ``keys``: a trainer's key layout (:class:`KeyLayout`; None: shardspec's own).
    ``stored``: honour `stored fused` (a checkpoint stores such a fused tensor whole; the
    Hugging Face paths read and write components).

    Returns the plan, the entries left for DCP's default handling (under their stored
    names; see ``plan.renamed``), and ``stored key -> (unit, local tensor)``. Ignored
    entries are dropped. Parameter-shaped entries must be on the spec's layout.

    The plan depends only on the state dict's structure (keys, shapes, dtypes, which
    values are DTensors), the mesh, the rank and ``saving``; it is cached under exactly
    those, so a repeated save or load binds only this call's tensors. The returned plan is
    shared between such calls: read it, do not change it.
    """
    shared = _shared_storage(flat)
    key = (mesh, rank, saving, keys, stored, _signature(flat), tuple(sorted(shared.items())))
    per_spec = _PLANS.get(spec)
    if per_spec is None:
        per_spec = _PLANS.setdefault(spec, OrderedDict())
    hit = per_spec.get(key)
    if hit is None:
        hit = _structural(
            spec, mesh, rank, flat, saving=saving, shared=shared, keys=keys, stored=stored
        )
        per_spec[key] = hit
        while len(per_spec) > PLAN_CACHE_SIZE:
            per_spec.popitem(last=False)
    else:
        per_spec.move_to_end(key)
    rest = {new: flat[old] for old, new in hit.rest}
    local: dict[str, tuple[Unit, torch.Tensor]] = {}
    for source, expected, units in hit.params:
        tensor = _local_of(flat[source], expected, source, spec)
        for skey, unit in units:
            local[skey] = (unit, tensor)
    return hit.plan, rest, local


def _shared_storage(flat: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Keys whose tensors are one tensor (a tied weight under two names, each a detached
    view of the same storage): key -> the other keys of its group."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[str]] = {}
    for key in sorted(flat):
        value = flat[key]
        if not isinstance(value, torch.Tensor):
            continue
        t = value.to_local() if isinstance(value, DTensor) else value
        if t.device.type == "meta" or t.numel() == 0:
            continue
        ident = (
            str(t.device),
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
        )
        groups.setdefault(ident, []).append(key)
    return {
        k: tuple(o for o in keys if o != k)
        for keys in groups.values()
        if len(keys) > 1
        for k in keys
    }


def _structural(
    spec: CompiledSpec,
    mesh: Mesh,
    rank: int,
    flat: Mapping[str, Any],
    *,
    saving: bool,
    shared: Mapping[str, tuple[str, ...]] | None = None,
    keys: KeyLayout | None = None,
    stored: bool = False,
) -> _Structural:
    """Build :func:`canonical_plan`'s structural part (uncached)."""
    from shardspec.runtime.dtensor import to_torch

    names = Names(spec, mesh, rank)
    shared = shared or {}
    plan = CanonicalPlan(stage=names.stage, foreign=names.other_stages())
    rest: list[tuple[str, str]] = []
    params: list[tuple[str, Expected, tuple[tuple[str, Unit], ...]]] = []
    structure: dict[str, tuple] = {}
    chunks = []
    single: dict[tuple[ParamLayout, Mesh, int], int] = {}
    counts = count_name_indexed(spec, names, flat)
    unnamed: list[str] = []  # tensors that hold no parameter's name
    found: set[str] = set()  # the parameter names in the keys, as this rank's model has them
    for key in sorted(flat):
        value = flat[key]
        if keys is not None and key.endswith(keys.skip):
            continue  # neither saved nor loaded, as an ignored entry
        span = names.split(key)
        if span is None:
            if ignored_key(spec, key):
                continue
            foreign = names.foreign_buffer(key)
            if foreign is not None:
                raise CheckpointError(foreign_buffer_message(names, key, foreign))
            if any(names.split(o) is not None for o in shared.get(key, ())):
                # A tied weight's other name (state dicts list both): the same tensor as a
                # parameter stored under its own name; saving or loading that fills both.
                continue
            rest.append((key, key))
            structure[key] = _describe(value)
            if isinstance(value, torch.Tensor):
                unnamed.append(key)
            continue
        a, b = span
        found.add(key[a:b])
        fqn = names.global_of(key[a:b])
        if spec.is_ignored(fqn):
            continue
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        if spec.stores_buffer(fqn) and shape is None:
            rest.append((key, key))  # not the buffer's tensor: DCP stores it as it is
            structure[key] = _describe(value)
            continue
        layout = spec.layout(fqn, mesh, names.shape_for_layout(fqn, value), counts.get(fqn))
        # The mesh of the parameter's view (``mesh`` itself without views): rank numbers
        # are the same in every view, so its per-rank tables index this plan's ranks.
        pmesh = spec.mesh_of(fqn, mesh)
        # A trainer's key layout: the fused components under the hooks' keys (the model's
        # own entry, where a hook splits it), else the fused tensor whole.
        comps = [c for c, _ in storage_units(layout) if c is not None]
        split = keys is not None and bool(comps) and not key[b:]
        ndim = sum(1 for d in layout.dims if not d.name_indexed)
        squeezed = any(d.fusion is not None and d.fusion.squeezed for d in layout.dims)
        split = split and keys.component_keys(fqn, comps, ndim, squeezed) is not None  # type: ignore[union-attr]
        # Stored whole: a fused tensor no hook of the trainer's key layout splits, and one
        # whose `fuse` item says `stored fused` (its model entry and its optimizer state).
        whole = keys is not None or (stored and spec.stored_fused(fqn))
        if comps and not split and whole:
            layout = stored_whole(layout)
        declared = layout  # what the fingerprint describes, for saving and loading alike
        if not saving and layout.ckpt:
            layout = dataclasses.replace(layout, ckpt=())
        pieces = _pieces(layout, pmesh, key, keys if whole else None)
        spans = names.name_indexed_spans(fqn, layout)  # once per parameter, not per piece
        # components under the hooks' keys
        hooked = (keys, ndim, squeezed) if split and keys is not None else None

        if shape != module_shape(layout, pmesh):
            # Not parameter-shaped (an optimizer step, a scalar): stored whole, once.
            vstart = pieces[rank][0].name_indexed_start if pieces[rank] else ()
            new_key = key[:a] + names.canonical(fqn, layout, vstart, spans) + key[b:]
            rest.append((key, new_key))
            plan.renamed[key] = new_key
            for row in pieces:  # other ranks' names of the same entry (per-expert modules)
                if row:
                    other = names.canonical(fqn, layout, row[0].name_indexed_start, spans)
                    plan.keys.add(key[:a] + other + key[b:])
            structure[key] = _describe(value)  # the caller's key: the same on every rank
            continue
        expected = Expected(
            tuple(to_torch(p) for p in dtensor_placements(layout, pmesh)),
            dtensor_placements(layout, pmesh),
            dtensor_mesh(layout, pmesh),
            shape,
        )
        tensor = _local_of(value, expected, key, spec)
        groups = replica_groups(layout, pmesh)
        itemsize = tensor.element_size()
        # The same on every rank: the layout fixes every rank's chunk offsets.
        structure[key] = ("param", shape, str(tensor.dtype), declared)
        mine: list[tuple[str, Unit]] = []
        for k, piece in enumerate(pieces[rank]):
            name = names.canonical(fqn, layout, piece.name_indexed_start, spans)
            name = _stored_name(spec, hooked, comps, name, piece.component)
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
                piece.squeeze,
            )
            plan.units.append(unit)
            plan.paths[skey] = (a, b, name)
            plan.dtypes[skey] = tensor.dtype
            mine.append((skey, unit))
        params.append((key, expected, tuple(mine)))
        if any(d.name_indexed for d in layout.dims):
            # Name-indexed modules: every rank stores other keys; visit them all.
            for r, row in enumerate(pieces):
                for k, piece in enumerate(row):
                    name = names.canonical(fqn, layout, piece.name_indexed_start, spans)
                    name = _stored_name(spec, hooked, comps, name, piece.component)
                    skey = key[:a] + name + key[b:]
                    plan.keys.add(skey)
                    if saving and not any(s == 0 for s in piece.sizes):
                        nbytes = math.prod(piece.sizes) * itemsize
                        replicas = stage_writers(layout, pmesh, groups[r][k])
                        chunks.append(((skey, piece.offsets), replicas, nbytes))
            continue
        # Every rank of the stage stores the same keys: the parameter's name, or one per
        # component (under its global name).
        for piece in next((row for row in pieces if row), ()):
            comp = piece.component
            plan.keys.add(key[:a] + _stored_name(spec, hooked, comps, fqn, comp) + key[b:])
        if not saving:
            continue  # a load reads every chunk it holds: no writers to choose
        if unreplicated(layout, pmesh):
            # One holder per chunk: no writer to choose. Count its bytes per rank by
            # layout (O(world) per distinct layout, not per parameter).
            single[(layout, pmesh, itemsize)] = single.get((layout, pmesh, itemsize), 0) + 1
            continue
        # Replicated chunks: the layout's distinct chunks, each once (a table per layout).
        for comp, offsets, replicas, n in chunk_table(layout, pmesh):
            skey = key[:a] + _stored_name(spec, hooked, comps, fqn, comp) + key[b:]
            chunks.append(((skey, offsets), stage_writers(layout, pmesh, replicas), n * itemsize))
    if saving:
        base = [0] * mesh.world
        for (layout, lm, itemsize), count in single.items():
            for r, n in enumerate(rank_elements(layout, lm)):
                base[r] += n * itemsize * count
        plan.writer = assign_writers(chunks, mesh.world, base)
    plan.fingerprint = fingerprint(
        structure, mesh, extra=spec.name if keys is None else f"{spec.name}:{keys!r}"
    )
    plan.uncovered = uncovered(spec, unnamed, found, keys)
    return _Structural(plan, tuple(rest), tuple(params))


def _pieces(layout: ParamLayout, mesh: Mesh, key: str, keys: KeyLayout | None) -> tuple:
    """:func:`rank_pieces`, with a fused tensor stored whole that a rank does not hold in
    one block reported for people (``keys``: the key layout that stores it whole, None for
    `stored fused`)."""
    try:
        return rank_pieces(layout, mesh)
    except ValueError as e:
        if not isinstance(layout, WholeFused):
            raise
        why = (
            "its `fuse` item says `stored fused`"
            if keys is None
            else f"keys={keys.name!r} stores this fused tensor whole (as the trainer's state "
            "dict names it)"
        )
        raise CheckpointError(
            f"{key}: {why}, but {e}: a rank's part of it must be one block. Shard the fused "
            "dimension by whole groups (`fuse ... as N groups of ...`) or not at all"
        ) from None


def _stored_name(
    spec: CompiledSpec,
    hooked: tuple[KeyLayout, int, bool] | None,
    comps: list[str],
    name: str,
    comp: str | None,
) -> str:
    """The stored name of component ``comp`` of parameter ``name`` (``name`` itself for
    None): ``<name>.<comp>``, or with ``hooked`` (a key layout, the parameter's tensor
    dimensions, whether its components are squeezed) the key the trainer's hook writes for
    it (where the manifest records the model's state-dict hooks, one of the keys they
    write)."""
    if comp is None:
        return name
    if hooked is None:
        return f"{name}.{comp}"
    keys = hooked[0]
    out = keys.component_keys(name, comps, *hooked[1:])[comps.index(comp)]  # type: ignore[index]
    if len(spec.hook_keys) and out not in spec.hook_keys:
        raise CheckpointError(
            f"{name}: keys={keys.name!r} stores component {comp!r} as {out}, but the model's "
            "state-dict hooks (the manifest's state_dict section) write no such key; the "
            "model does not present this parameter as that trainer does"
        )
    return out


def foreign_buffer_message(names: Names, key: str, buffer: str) -> str:
    """Why a stage model may not hold ``buffer``, another stage's (flat key ``key``)."""
    sp = names.stages
    assert sp is not None
    held = ", ".join(map(str, sp.buffer_stages[buffer]))
    return (
        f"{key}: this rank's model (pipeline stage {names.stage} of {sp.n_stages}) holds the "
        f"persistent buffer {buffer}, which the spec's pipeline block places on stage {held} "
        "(with its module); a checkpoint stores it once, from that stage, so this copy would "
        "be neither saved nor loaded. Drop its module from this stage's model (split_stage "
        "does), or place the module on this stage with `first` or `last`"
    )


def uncovered(
    spec: CompiledSpec, keys: Sequence[str], found: set[str], layout: KeyLayout | None = None
) -> tuple[str, ...]:
    """Of ``keys`` (flat keys of tensors that name no parameter and match no ignore), those
    that are the model's state but that nothing in the spec covers, each described: a key
    a state-dict hook writes (the manifest lists it), or a tensor inside one of the model's
    modules (around the manifest's parameters, or the parameters ``found`` in the state
    dict) that is no buffer the manifest lists. Other tensors (a step counter, an RNG
    state, entries of the caller's own) are not the model's: DCP stores them as ever.

    With a trainer's key ``layout``, a key its hooks write for a parameter in the state
    dict (torchtitan's ``wq.weight`` in ``model.state_dict()``) is covered: it is the name
    the layout stores that component under."""
    if not keys:
        return ()
    held = sorted(found)

    def is_module(name: str) -> bool:  # a module around the manifest's or the found parameters
        i = bisect.bisect_left(held, name + ".")
        return (i < len(held) and held[i].startswith(name + ".")) or spec.is_module(name)

    out = []
    for key in keys:
        starts = _dot_starts(key)
        stops = [i for i, ch in enumerate(key) if ch == "."] + [len(key)]
        parts = [key[a:b] for a in starts for b in stops if b > a]
        if layout is not None and any(
            f in found or (spec.params is not None and f in spec.params)
            for p in parts
            for f in layout.sources(p)
        ):
            continue
        hook = next((p for p in parts if p in spec.hook_keys), None)
        if hook is not None:
            module, sources = spec.hook_keys[hook]
            by = f"a state-dict hook of {module}" if module else "the model's state_dict()"
            origin = f" in place of {', '.join(sources)}" if sources else ""
            out.append(f"{key} (written by {by}{origin})")
        elif not any(p in spec.buffers for p in parts) and any(
            is_module(key[a:b]) for a in starts for b in stops[:-1] if b > a
        ):
            out.append(f"{key} (no parameter, no buffer of the manifest, no ignore)")
    return tuple(out)


def count_name_indexed(spec: CompiledSpec, names: Names, flat: Mapping[str, Any]):
    """Where the manifest's table does not apply: modules per name-indexed dim, counted
    from the state dict."""
    if names.table is not None:
        return {}
    fqns = set()
    for key in flat:
        span = names.split(key)
        if span is not None:
            fqns.add(key[span[0] : span[1]])
    return spec.name_indexed_counts_of(sorted(fqns))


@dataclasses.dataclass(frozen=True)
class Expected:
    """The spec's DTensor layout of one parameter: torch placements, the same as layout
    tuples, the DTensor's mesh and the module tensor's shape."""

    placements: tuple
    abstract: tuple
    mesh: Mesh
    shape: tuple[int, ...]


def _local_of(value: Any, expected: Expected, key: str, spec: CompiledSpec) -> torch.Tensor:
    """The local tensor of ``value``, which must hold the spec's layout. Layouts are
    compared, not spellings: FSDP2's ``Shard(0)`` on a 1-D ``dp_shard`` mesh is the spec's
    ``(Shard(0), Replicate())`` on ``(dp_shard, tp)`` (see ``layout.same_layout``), and a
    mesh axis called by one of the spec's aliases is that axis."""
    if isinstance(value, DTensor):
        got = tuple(value.placements)
        names = spec.axis_names(value.device_mesh.mesh_dim_names or ())
        if got != expected.placements or names != expected.mesh.names:
            from shardspec.runtime.dtensor import layout_of

            own, abstract = layout_of(value)
            names = spec.axis_names(own)
            same = (
                abstract is not None
                and set(names) <= set(expected.mesh.names)
                and same_layout(expected.shape, expected.mesh, expected.abstract, names, abstract)
                is None
            )
            if not same:
                raise CheckpointError(
                    f"{key}: its DTensor placements {got} on mesh axes {names} are not the "
                    f"spec's layout {expected.placements} on {expected.mesh.names}; the model "
                    "is not on the spec's layout (check it with verify(model, mesh))"
                )
        # A parameter (named_parameters()) detached, the same storage: a load writes into
        # it in place, which autograd refuses on a view of it.
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.detach() if value.requires_grad else value
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
    return out if unit.squeeze is None else out.squeeze(unit.squeeze)


def unit_commit(unit: Unit, tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Copy a unit's chunk back into the local tensor."""
    if unit.runs is None:
        if data.data_ptr() != tensor.data_ptr():
            tensor.copy_(data)
        return
    if unit.squeeze is not None:
        data = data.unsqueeze(unit.squeeze)
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
    box = [tuple(offsets), tuple(lengths)]
    if unit.squeeze is not None:  # the chunk's one index of the squeezed dimension
        d = unit.squeeze
        box = [(*t[:d], i, *t[d:]) for t, i in zip(box, (0, 1), strict=True)]
        data = data.unsqueeze(d)
    _commit_box(dict(unit.runs or ()), 0, tensor, data, *box)


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


def mesh_and_rank(spec: CompiledSpec, mesh: Any) -> tuple[Mesh, int]:
    mesh = mesh if mesh is not None else spec.last_mesh
    if mesh is None:
        raise CheckpointError(
            "no mesh: pass mesh=... to the planner, or build it with build_mesh()/distribute()"
        )
    lm = spec.layout_mesh(mesh)
    coord = mesh.get_coordinate() if hasattr(mesh, "get_coordinate") else None
    rank = lm.rank_of(coord) if coord is not None else dist.get_rank()
    return lm, rank
