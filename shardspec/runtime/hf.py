"""Hugging Face safetensors checkpoints in and out of a sharded model, from the spec's
``hf`` block (see :mod:`shardspec.core.hfmap`).

``load_hf`` reads, on each rank, exactly the bytes of that rank's shards: it cuts the
model's state into canonical storage units (the same units checkpoints use, see
:mod:`shardspec.runtime.canonical`), maps each unit's chunk through the declared
transforms to slices of Hugging Face tensors, and reads those slices with safetensors'
slicing. It calls no ``torch.distributed`` collective: every rank knows every rank's
shards from the spec. Everything is checked before the model changes (missing,
unexpected and mis-shaped keys, files outside the checkpoint directory, missing or
truncated files), and the slices are read into staging buffers that are copied into the
model only when every read succeeded.

``export_hf`` writes the model as sharded safetensors files with an index. Each stored
chunk is sent once, by the replica the checkpoint writer balancing chose, to the rank
that writes the tensor; tensors are spread over the ranks by bytes, so no rank gathers
the whole model.

Pipeline stages (a spec with a ``pipeline`` block): each rank's model is its stage's
model, under its stage's names (global, or numbered from 0 per stage with ``split ...
local``); Hugging Face keys and storage units always use the whole model's (global)
names. The whole model's units come from the manifest, so every rank validates the whole
checkpoint alike (a key missing for another stage fails every rank) while reading only
its own stage's bytes, still without a collective. ``export_hf`` on a pipeline first
shares each rank's parameter dtypes (one ``all_gather_object``), then every rank
computes every stage's chunk senders from a canonical plan of that stage's structure
(meta tensors), so all ranks agree on who sends what.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardspec.core.hfmap import (
    Fused,
    HFMap,
    Source,
    Split,
    fused_of,
    model_indices,
    runs,
    source_indices,
    unit_names,
)
from shardspec.core.layout import Mesh, ParamLayout
from shardspec.core.paths import inside
from shardspec.runtime.canonical import CanonicalPlan, Unit, rank_pieces, replica_groups
from shardspec.runtime.spec import CompiledSpec, SpecError
from shardspec.runtime.units import (
    CheckpointError,
    Names,
    canonical_plan,
    count_name_indexed,
    mesh_and_rank,
    unit_commit,
    unit_data,
)

INDEX = "model.safetensors.index.json"
# Marks a ``<path>.partial`` folder as export_hf's own: only such a folder is ever removed.
EXPORT_MARKER = ".shardspec-export-in-progress"
SINGLE = "model.safetensors"
_MAX_LISTED = 20
# Below this many bytes to read, rank 0 shows no progress bar unless asked to.
PROGRESS_BYTES = 256 << 20

__all__ = ["HFError", "HFExportReport", "HFLoadReport", "export_hf", "load_hf"]


class HFError(RuntimeError):
    """A Hugging Face checkpoint that does not fit the spec's mapping or the model. Raised
    before the model (or the target directory) is modified."""


@dataclass
class HFLoadReport:
    """What one rank's ``load_hf`` did."""

    files_opened: dict[str, int] = field(default_factory=dict)  # file -> times opened
    bytes_read: int = 0  # tensor bytes read from the files (in the files' dtypes)
    bytes_owned: int = 0  # bytes of the rank's storage-unit chunks (in the files' dtypes)
    reads: int = 0  # slices read
    units: int = 0  # storage-unit chunks filled


@dataclass
class HFExportReport:
    """What one rank's ``export_hf`` did."""

    file: str | None = None  # the file this rank wrote (None: it wrote none)
    tensors: int = 0
    bytes_written: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    # tie aliases (``tie A = B``) not written: the config ties them, or, without a config
    # that says, the model's tensors are equal (the same on every rank)
    aliases_not_written: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------- units


@dataclass(frozen=True)
class _GlobalUnit:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fused: Fused | None = None  # the parameter's fused dimension, for a component


@dataclass(frozen=True)
class _Param:
    """A parameter's layout, and where its name-indexed captures are in its name."""

    layout: ParamLayout
    spans: list[tuple[int, int]]


@dataclass
class _Model:
    """One rank's model in the whole model's terms: its own units and tensors (``local``,
    under its save or load ``plan``), and every parameter of the whole model by global
    name, with its layout and dtype, and every storage unit (the same on every rank)."""

    plan: CanonicalPlan
    local: dict[str, tuple[Unit, torch.Tensor]]
    names: Names
    params: dict[str, _Param]
    dtypes: dict[str, torch.dtype]
    units: dict[str, _GlobalUnit]


def _model_state(model: Any) -> dict[str, Any]:
    if isinstance(model, Mapping):
        return dict(model)
    return dict(model.state_dict(keep_vars=True))


def _mesh_and_rank(spec: CompiledSpec, mesh: Any, caller: str) -> tuple[Mesh, int]:
    """The layout mesh and this rank, for ``caller`` (``load_hf``, ``export_hf``): its own
    error, naming its own ``mesh=`` argument, when there is no mesh."""
    mesh = mesh if mesh is not None else spec.last_mesh
    if mesh is None:
        raise HFError(
            f"{caller}: no mesh: pass mesh=... to {caller}, or build the model's mesh with "
            "build_mesh()/distribute() first"
        )
    return mesh_and_rank(spec, mesh)


def _model(spec: CompiledSpec, lm: Mesh, rank: int, model: Any, *, saving: bool) -> _Model:
    """Cut the model into this rank's units and describe the whole model, the same on every
    rank. Without a pipeline the whole model's parameters are the model's own (every rank
    holds a part of each). With one, a rank's model holds only its stage's: the whole
    model's parameters come from the manifest, other stages' dtypes from its dtype strings."""
    flat = {k: v for k, v in _model_state(model).items() if isinstance(v, torch.Tensor)}
    plan, _rest, local = canonical_plan(spec, lm, rank, flat, saving=saving)
    names = Names(spec, lm, rank)
    dtypes = {names.global_of(u.source): t.dtype for u, t in local.values()}
    if names.stages is None:
        params = _params(spec, names, lm, flat, {u.source for u, _ in local.values()})
    else:
        params = _stage_params(spec, names, lm)
        dtypes |= _manifest_dtypes(names, params, dtypes)
    return _Model(plan, local, names, params, dtypes, _global_units(params, dtypes))


def _params(
    spec: CompiledSpec, names: Names, lm: Mesh, flat: Mapping[str, Any], keys: Iterable[str]
) -> dict[str, _Param]:
    """The layout of each parameter in ``keys``, and where its name-indexed captures are."""
    counts = count_name_indexed(spec, names, flat)
    out = {}
    for key in sorted(keys):
        shape = tuple(flat[key].shape) if names.table is None else None
        layout = spec.layout(key, lm, shape, counts.get(key))
        out[key] = _Param(layout, names.name_indexed_spans(key, layout))
    return out


def _stage_params(spec: CompiledSpec, names: Names, lm: Mesh) -> dict[str, _Param]:
    """Pipeline stages: every parameter of the whole model, from the manifest."""
    assert names.stages is not None
    if names.table is None:
        raise HFError(
            f"spec {spec.name!r} has pipeline stages, but its manifest does not describe the "
            f"model on mesh {dict(zip(lm.names, lm.sizes, strict=True))} (its local axes were "
            f"built at {spec.built_sizes}): load_hf/export_hf of a stage need the other "
            "stages' parameters from the manifest"
        )
    out = {}
    for fqn in sorted(names.stages.stage):
        if spec.is_ignored(fqn):
            continue
        layout = spec.layout(fqn, lm)
        out[fqn] = _Param(layout, names.name_indexed_spans(fqn, layout))
    return out


def _manifest_dtypes(
    names: Names, params: Iterable[str], held: Mapping[str, torch.dtype]
) -> dict[str, torch.dtype]:
    """The manifest's dtypes of the parameters this rank does not hold."""
    assert names.table is not None
    return {f: _torch_dtype(names.table[f].dtype, f) for f in params if f not in held}


def _global_units(
    params: Mapping[str, _Param], dtypes: Mapping[str, torch.dtype]
) -> dict[str, _GlobalUnit]:
    """Every storage unit of every rank (the same on every rank), by name."""
    out: dict[str, _GlobalUnit] = {}
    for key, p in params.items():
        fused = fused_of(p.layout.dims)
        for name, shape in unit_names(key, p.layout.dims, p.spans):
            out.setdefault(name, _GlobalUnit(name, shape, dtypes[key], fused))
    return out


def _torch_dtype(name: str, fqn: str) -> torch.dtype:
    """The torch dtype a manifest names (``"float32"``, ``"torch.bfloat16"``)."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise HFError(f"{fqn}: the manifest's dtype {name!r} is not a torch dtype")
    return dt


# ----------------------------------------------------------------------------- the files


def _weight_map(path: str, handles: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """``key -> file`` of the checkpoint at ``path`` and the problems found on the way
    (a single-file checkpoint is opened here, into ``handles``). Every name must be a plain
    relative path whose folders stay inside the folder; the file itself may be a link to
    anywhere, as in Hugging Face's cache (:mod:`shardspec.core.paths`)."""
    if not os.path.isdir(path):
        raise HFError(f"{path}: not a directory (expected a Hugging Face checkpoint folder)")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        wm = _read_index(index)
        problems = []
        for key, rel in sorted(wm.items()):
            if not inside(path, rel):
                problems.append(
                    f"{key}: weight_map points to {rel!r}, outside the checkpoint directory {path}"
                )
            elif not os.path.isfile(os.path.join(path, rel)):
                problems.append(
                    f"{key}: weight_map points to {rel!r}, which does not exist in {path}"
                )
        return wm, problems
    single = os.path.join(path, SINGLE)
    if not os.path.isfile(single):
        raise HFError(f"{path}: neither {INDEX} nor {SINGLE} is there")
    return {key: SINGLE for key in _open(path, SINGLE, handles).keys()}, []


def _read_index(index: str) -> dict[str, str]:
    """The ``weight_map`` of the index file ``index``."""
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"{index}: not readable JSON ({e})") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
    ):
        raise HFError(f"{index}: no 'weight_map' object of key -> file name")
    return dict(wm)


def _open(root: str, rel: str, handles: dict[str, Any]) -> Any:
    """The file's safetensors handle, opened once and kept in ``handles``."""
    handle = handles.get(rel)
    if handle is None:
        from safetensors import safe_open

        try:
            handle = safe_open(os.path.join(root, rel), framework="pt")
        except Exception as e:  # safetensors raises its own error type for bad files
            raise HFError(
                f"{os.path.join(root, rel)}: not a readable safetensors file ({e})"
            ) from None
        handles[rel] = handle
    return handle


def _raise(problems: list[str], path: str) -> None:
    if not problems:
        return
    shown = problems[:_MAX_LISTED]
    more = len(problems) - len(shown)
    tail = f"\n  ... and {more} more" if more else ""
    raise HFError(
        f"{path} does not fit the spec's hf mapping ({len(problems)} problem"
        f"{'s' if len(problems) != 1 else ''}); the model was not changed:\n  "
        + "\n  ".join(shown)
        + tail
    )


def _resolve_sources(
    hfmap: HFMap, units: Mapping[str, _GlobalUnit], strict: bool
) -> tuple[dict[str, Source], list[str]]:
    sources: dict[str, Source] = {}
    problems: list[str] = []
    for name in sorted(units):
        if hfmap.kept(name):
            continue
        unit = units[name]
        found = hfmap.sources(name, unit.shape, unit.fused)
        if len(found) == 1:
            sources[name] = found[0]
            problems += _split_problems(hfmap, name, found[0], unit.fused)
        elif not found:
            if strict:
                problems.append(f"{name}: no rule of the hf mapping produces this parameter")
        else:
            rules = ", ".join(f"line {hfmap.rules[s.rule].line}" for s in found)
            problems.append(f"{name}: produced by several rules of the hf mapping ({rules})")
    return sources, problems


def _split_problems(hfmap: HFMap, name: str, src: Source, fused: Fused | None) -> list[str]:
    """A split line whose `as` list names what is no component (lint: SS081)."""
    rule = hfmap.rules[src.rule]
    if src.split is None or rule.parts is None or fused is None:
        return []
    comps = {c for c, _ in fused[1]}
    return [
        f"{name}: line {rule.line} splits its Hugging Face tensor into {p.name!r}, which is "
        f"no component of {name.rpartition('.')[0]} ({', '.join(c for c, _ in fused[1])})"
        for p in rule.parts
        if p.name not in comps
    ]


# ---------------------------------------------------------------------------------- load


def _read_runs(
    sl: Any, dim_runs: list[list[tuple[int, int]]], d: int, prefix: tuple
) -> torch.Tensor:
    """Every combination of the per-dim runs, read and concatenated in order. (Module
    level: a closure naming itself would be a reference cycle holding the slice, and the
    file's memory map, until the next garbage collection.)"""
    if d == len(dim_runs):
        return sl[prefix]
    parts = [_read_runs(sl, dim_runs, d + 1, (*prefix, slice(a, b))) for a, b in dim_runs[d]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)


def _read_box(
    handle: Any,
    key: str,
    transforms: Sequence,
    offsets: Sequence[int],
    sizes: Sequence[int],
    split: Split | None = None,
) -> torch.Tensor:
    """The model's box ``offsets``/``sizes`` of the tensor that HF key ``key`` maps to (of
    its part ``split``), read with safetensors slicing (only the box's bytes)."""
    per_dim, model_dim_of = source_indices(transforms, offsets, sizes, split)
    sl = handle.get_slice(key)
    if not per_dim:
        return handle.get_tensor(key)
    dim_runs = [runs(idx) for idx in per_dim]

    if any(not r for r in dim_runs):
        shape = [len(i) for i in per_dim]
        t = torch.empty(shape, dtype=sl[tuple(slice(0, 0) for _ in per_dim)].dtype)
    else:
        t = _read_runs(sl, dim_runs, 0, ())
    for d, idx in enumerate(per_dim):
        if isinstance(idx, range):
            continue
        # Positions of the requested indices inside the concatenated runs.
        pos, base = {}, 0
        for a, b in dim_runs[d]:
            for i in range(a, b):
                pos[i] = base + i - a
            base += b - a
        t = t.index_select(d, torch.tensor([pos[i] for i in idx], dtype=torch.long))
    order = [model_dim_of.index(d) for d in range(len(model_dim_of))]
    return t.permute(order) if order != list(range(len(order))) else t


def _progress(total: int, enabled: bool | None, rank: int) -> Any:
    show = rank == 0 and (enabled if enabled is not None else total >= PROGRESS_BYTES)
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a nicety: no tqdm, no bar
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="load_hf")


@dataclass
class _Checkpoint:
    """The checkpoint folder: which file holds each key, and its files' safetensors
    handles (each opened once)."""

    path: str
    weight_map: dict[str, str]
    handles: dict[str, Any]

    def handle(self, key: str) -> Any:
        return self.handles[self.weight_map[key]]


@dataclass
class _Keys:
    """The Hugging Face keys the mapping reads, against the checkpoint's index."""

    # needed key -> the key read for it (itself, or the source of the tie it aliases)
    read_from: dict[str, str] = field(default_factory=dict)
    # needed key -> its shape by the mapping (read or missing)
    expected: dict[str, tuple[int, ...]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # missing and unexpected keys


@dataclass(frozen=True)
class _Box:
    """One slice read: the box ``offsets``/``sizes`` (in the model's coordinates) of the
    tensor that the Hugging Face key ``key`` maps to."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class _UnitRead:
    """What fills one of this rank's storage-unit chunks: one box, or with a stacked
    source one box per stacked entry (stacked along the unit's first dimension)."""

    unit: Unit
    tensor: torch.Tensor
    source: Source
    boxes: tuple[_Box, ...]


@dataclass(frozen=True)
class _Staged:
    """A chunk read, cast to its tensor's dtype and device, not yet in the model."""

    unit: Unit
    tensor: torch.Tensor
    data: torch.Tensor


def load_hf(
    spec: CompiledSpec,
    hfmap: HFMap,
    model: Any,
    path: str | os.PathLike,
    mesh: Any = None,
    *,
    progress: bool | None = None,
    strict: bool = True,
) -> HFLoadReport:
    """Load the Hugging Face checkpoint at ``path`` into ``model`` (its DTensor or
    Megatron-style local-shard parameters, as the spec lays them out), in place.

    Every rank reads only its own shards' bytes and calls no collective. The whole
    checkpoint is checked first (every rank checks the same things, so every rank raises
    the same :class:`HFError`): missing and unexpected keys, shapes against the mapping,
    ``weight_map`` entries outside the directory or naming missing files, truncated
    files. With pipeline stages ``model`` is this rank's stage model (keyed by the stage's
    names): the whole model's parameters come from the manifest, so keys of other stages
    are expected and checked on every rank, but only this stage's bytes are read. The
    slices are read into staging buffers and copied into the model only when every read
    succeeded. Values are cast to the parameters' dtypes. ``strict=False`` leaves
    parameters that no rule produces as they are (with ``strict``, that is an error).
    ``progress``: a bar on rank 0 (default: for loads of 256 MiB or more).
    """
    path = os.fspath(path)
    lm, rank = _mesh_and_rank(spec, mesh, "load_hf")
    m = _model(spec, lm, rank, model, saving=False)
    sources, problems = _resolve_sources(hfmap, m.units, strict)
    handles: dict[str, Any] = {}
    weight_map, file_problems = _weight_map(path, handles)
    keys = _needed_keys(hfmap, sources, weight_map)
    _raise(problems + file_problems + keys.problems, path)

    ckpt = _Checkpoint(path, weight_map, handles)
    report = HFLoadReport()
    _open_files(ckpt, report)
    _raise(_shape_problems(ckpt, keys), path)
    reads = _rank_reads(m.local, sources, keys.read_from)
    _place(_stage(ckpt, reads, report, _progress(_nbytes(reads), progress, rank)))
    return report


def _needed_keys(
    hfmap: HFMap, sources: Mapping[str, Source], weight_map: Mapping[str, str]
) -> _Keys:
    """Which key each needed Hugging Face key is read from, the shape it must have, and
    the index's missing and unexpected keys."""
    out = _Keys()
    for name, src in sources.items():
        for key in src.keys:
            out.expected[key] = src.shape
            if key in weight_map:
                out.read_from[key] = key
            elif (tied := hfmap.tie_of(key)) is not None and tied in weight_map:
                out.read_from[key] = tied
            else:
                out.problems.append(f"{key}: missing from the checkpoint (needed for {name})")
    aliases = {a for a, _ in hfmap.ties}
    for key in sorted(weight_map):
        if key not in out.expected and key not in aliases and not hfmap.dropped(key):
            out.problems.append(
                f"{key}: unexpected key (the hf mapping neither reads nor drops it)"
            )
    return out


def _open_files(ckpt: _Checkpoint, report: HFLoadReport) -> None:
    """Open every file of the index once, on every rank, so all ranks agree on whether the
    checkpoint is good without talking to each other."""
    bad_files = []
    for rel in sorted(set(ckpt.weight_map.values())):
        try:
            _open(ckpt.path, rel, ckpt.handles)
        except HFError as e:
            bad_files.append(str(e))
    report.files_opened = {rel: 1 for rel in ckpt.handles}
    _raise(bad_files, ckpt.path)


def _shape_problems(ckpt: _Checkpoint, keys: _Keys) -> list[str]:
    """Every needed key's presence and shape in the file the index puts it in."""
    file_keys = {rel: set(h.keys()) for rel, h in ckpt.handles.items()}
    problems = []
    for key, source_key in sorted(keys.read_from.items()):
        rel = ckpt.weight_map[source_key]
        if source_key not in file_keys[rel]:
            problems.append(f"{source_key}: the index puts it in {rel}, which does not hold it")
            continue
        got = tuple(ckpt.handles[rel].get_slice(source_key).get_shape())
        if got != keys.expected[key]:
            problems.append(
                f"{source_key}: shape {list(got)} in {rel}, the mapping expects "
                f"{list(keys.expected[key])}"
            )
    return problems


def _rank_reads(
    local: Mapping[str, tuple[Unit, torch.Tensor]],
    sources: Mapping[str, Source],
    read_from: Mapping[str, str],
) -> list[_UnitRead]:
    """The slices that fill this rank's (non-empty, mapped) storage-unit chunks."""
    out = []
    for unit, tensor in local.values():
        src = sources.get(unit.key)
        if src is None or unit.empty:
            continue
        if src.stacked:
            first, count = unit.offsets[0], unit.sizes[0]
            boxes = tuple(
                _Box(read_from[src.keys[e]], unit.offsets[1:], unit.sizes[1:])
                for e in range(first, first + count)
            )
        else:
            boxes = (_Box(read_from[src.keys[0]], unit.offsets, unit.sizes),)
        out.append(_UnitRead(unit, tensor, src, boxes))
    return out


def _nbytes(reads: Sequence[_UnitRead]) -> int:
    """The bytes the reads fill, in the model's dtypes."""
    return sum(math.prod(r.unit.sizes) * r.tensor.element_size() for r in reads)


def _stage(
    ckpt: _Checkpoint, reads: Sequence[_UnitRead], report: HFLoadReport, bar: Any
) -> list[_Staged]:
    """Read every chunk into a staging buffer (the model is not touched); any failure is
    an :class:`HFError` that says so."""
    staged = []
    try:
        for r in reads:
            box = _read_unit(ckpt, r)
            report.reads += len(r.boxes)
            report.bytes_read += box.numel() * box.element_size()
            report.bytes_owned += math.prod(r.unit.sizes) * box.element_size()
            data = box.to(dtype=r.tensor.dtype, device=r.tensor.device)
            staged.append(_Staged(r.unit, r.tensor, data))
            report.units += 1
            if bar is not None:
                bar.update(math.prod(r.unit.sizes) * r.tensor.element_size())
    except HFError:
        raise
    except Exception as e:
        raise HFError(f"reading {ckpt.path} failed; the model was not changed: {e}") from e
    finally:
        if bar is not None:
            bar.close()
    return staged


def _read_unit(ckpt: _Checkpoint, r: _UnitRead) -> torch.Tensor:
    """One chunk's boxes, read (and stacked for a stacked source)."""
    src = r.source
    parts = [
        _read_box(ckpt.handle(b.key), b.key, src.transforms, b.offsets, b.sizes, src.split)
        for b in r.boxes
    ]
    return torch.stack(parts) if src.stacked else parts[0]


def _place(staged: Sequence[_Staged]) -> None:
    """Copy the staged chunks into the model."""
    with torch.no_grad():
        for s in staged:
            data = s.data.reshape(s.unit.sizes) if s.data.shape != s.unit.sizes else s.data
            unit_commit(s.unit, s.tensor, data)


# -------------------------------------------------------------------------------- export


@dataclass
class _Chunk:
    """A stored chunk of a unit, and the one rank that sends it to the unit's writer."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    sender: int


@dataclass
class _ExportPlan:
    """Who sends and who writes what, the same on every rank."""

    units: list[_GlobalUnit]  # the units written, by name
    sources: dict[str, Source]  # unit name -> the Hugging Face tensor(s) it is written as
    writer: dict[str, int]  # unit name -> the rank that writes its tensor(s)
    chunks: dict[str, list[_Chunk]]  # unit name -> its stored chunks, each with its sender


def _export_plan(
    spec: CompiledSpec,
    hfmap: HFMap,
    lm: Mesh,
    m: _Model,
    sources: dict[str, Source],
    path: str,
) -> _ExportPlan:
    """The writer of every unit (balanced by bytes, tie aliases with their sources) and the
    sender of every stored chunk."""
    units = m.units
    plan_of: Callable[[str], CanonicalPlan] = lambda _fqn: m.plan  # noqa: E731
    if m.names.stages is not None:
        # Each rank's plan knows only its stage's senders: every rank computes every
        # stage's, from the stage's structure, with the dtypes every rank really holds.
        dtypes = _stage_dtypes(spec, m.names, m.local, m.dtypes, path)
        units = _global_units(m.params, dtypes)
        plan_of = _stage_plans(spec, lm, m.names, dtypes)
    chunks = _global_chunks(m.names, lm, m.params, plan_of)
    todo = [units[n] for n in sorted(sources)]
    writer = _colocate_ties(hfmap, sources, _assign(_bundles(todo, sources), lm.world))
    return _ExportPlan(todo, sources, writer, chunks)


def _global_chunks(
    names: Names,
    lm: Mesh,
    params: Mapping[str, _Param],
    plan_of: Callable[[str], CanonicalPlan],
) -> dict[str, list[_Chunk]]:
    """Every stored chunk of every unit, with the one rank that sends it (``plan_of``: the
    save plan whose writer choice holds for a parameter, by global name)."""
    out: dict[str, list[_Chunk]] = {}
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for key, p in params.items():
        pieces = rank_pieces(p.layout, lm)
        groups = replica_groups(p.layout, lm)
        for r, row in enumerate(pieces):
            for k, piece in enumerate(row):
                name = names.canonical(key, p.layout, piece.name_indexed_start, p.spans)
                if piece.component is not None:
                    name = f"{name}.{piece.component}"
                if any(s == 0 for s in piece.sizes) or (name, piece.offsets) in seen:
                    continue
                seen.add((name, piece.offsets))
                sender = plan_of(key).writer_of(name, piece.offsets, groups[r][k])
                out.setdefault(name, []).append(_Chunk(piece.offsets, piece.sizes, sender))
    return out


def _stage_dtypes(
    spec: CompiledSpec,
    names: Names,
    local: Mapping[str, tuple[Unit, torch.Tensor]],
    dtypes: Mapping[str, torch.dtype],
    path: str,
) -> dict[str, torch.dtype]:
    """Pipeline stages: every parameter's real dtype (a stage model cast to bf16 is not what
    the manifest says), shared by every rank of each stage. Every rank raises if any rank's
    stage model lacks a parameter of its stage or two ranks of a stage disagree."""
    sp = names.stages
    assert sp is not None and names.stage is not None
    held = {names.global_of(u.source): str(t.dtype) for u, t in local.values()}
    own = {f for f in sp.params_of(names.stage) if not spec.is_ignored(f)}
    missing = sorted(own - set(held))
    error = None
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        error = (
            f"its model lacks {len(missing)} parameter(s) of stage {names.stage}: "
            f"{', '.join(sp.local_name(m, names.stage) for m in missing[:3])}{more}"
        )
    mine = (names.stage, sorted(held.items()), error)
    every: list[Any] = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    out = dict(dtypes)
    first: dict[int, tuple[int, list]] = {}
    failed = []
    for r, (stage, items, err) in enumerate(every):
        if err is not None:
            failed.append(f"rank {r}: {err}")
            continue
        lead = first.setdefault(stage, (r, items))
        if lead[1] != items:
            failed.append(
                f"rank {r}: its stage {stage} model's parameters or dtypes differ from rank "
                f"{lead[0]}'s"
            )
    if failed:
        lines = "\n  ".join(failed)
        raise HFError(f"export to {path} failed; nothing was written there:\n  {lines}")
    for _r, items in first.values():
        for fqn, dt in items:
            out[fqn] = _torch_dtype(dt.removeprefix("torch."), fqn)
    return out


def _stage_plans(
    spec: CompiledSpec, lm: Mesh, names: Names, dtypes: Mapping[str, torch.dtype]
) -> Callable[[str], CanonicalPlan]:
    """Pipeline stages: for each stage, the save plan its ranks would compute, built on
    every rank from the stage's structure (meta tensors under the stage's own names, at its
    first rank), so every rank knows every stage's chunk writers (balanced by bytes as
    checkpoints balance them). Returns global name -> its stage's plan."""
    sp = names.stages
    assert sp is not None and names.table is not None
    axis = lm.names.index(spec.pipeline.axis)  # type: ignore[union-attr]
    plans = []
    for s in range(sp.n_stages):
        coord = [0] * len(lm.names)
        coord[axis] = s
        flat = {
            sp.local_name(f, s): torch.empty(names.table[f].shape, dtype=dtypes[f], device="meta")
            for f in sp.params_of(s)
            if not spec.is_ignored(f)
        }
        plans.append(canonical_plan(spec, lm, lm.rank_of(coord), flat, saving=True)[0])
    # A tied weight is written by its lowest stage (canonical.stage_writers).
    return lambda fqn: plans[sp.stages_of(fqn)[0]]


def _written_twice(sources: Mapping[str, Source]) -> list[str]:
    """HF keys that two units would be written under (lint's SS080 catches the lines),
    unless they are the parts of one split line that tile the tensor exactly."""
    writers: dict[str, list[tuple[str, Source]]] = {}
    for name, src in sorted(sources.items()):
        for key in src.keys:
            writers.setdefault(key, []).append((name, src))
    out = []
    for key, found in sorted(writers.items()):
        if len(found) == 1 and found[0][1].split is None:
            continue
        splits = [src.split for _, src in found]
        parts = sorted((sp.start, sp.size) for sp in splits if sp is not None)
        tiled = (
            None not in splits
            and len({(src.rule, src.split.dim, src.split.total) for _, src in found}) == 1  # type: ignore[union-attr]
            and all(a == b for (a, _), b in zip(parts, _ends(parts), strict=True))
            and sum(n for _, n in parts) == found[0][1].split.total  # type: ignore[union-attr]
        )
        if not tiled:
            names = " and ".join(n for n, _ in found)
            how = ", not as parts that tile it" if any(splits) else ""
            out.append(f"{key}: both {names} would be written under it{how}")
    return out


def _ends(parts: list[tuple[int, int]]) -> list[int]:
    """Where each of the sorted ``(start, size)`` parts would start if they tiled from 0."""
    out, at = [], 0
    for start, size in parts:
        out.append(at)
        at = start + size
    return out


def _bundles(todo: Sequence[_GlobalUnit], sources: Mapping[str, Source]) -> list[list[_GlobalUnit]]:
    """Units that one rank must write together: the parts of one split HF tensor."""
    out: dict[tuple[str, ...], list[_GlobalUnit]] = {}
    for u in todo:
        src = sources[u.name]
        out.setdefault(src.keys if src.split is not None else (u.name,), []).append(u)
    return list(out.values())


def _assign(bundles: Sequence[Sequence[_GlobalUnit]], world: int) -> dict[str, int]:
    """Which rank writes each unit: bundles (the parts of one HF tensor go together)
    largest first, to the rank with the fewest bytes."""
    load = [0] * world
    out = {}

    def nbytes(b: Sequence[_GlobalUnit]) -> int:
        return sum(math.prod(u.shape) * u.dtype.itemsize for u in b)

    for b in sorted(bundles, key=lambda b: (-nbytes(b), b[0].name)):
        r = min(range(world), key=lambda i: (load[i], i))
        for u in b:
            out[u.name] = r
        load[r] += nbytes(b)
    return out


def _colocate_ties(
    hfmap: HFMap, sources: Mapping[str, Any], dest: dict[str, int]
) -> dict[str, int]:
    """``dest`` with each tie alias's unit written by its source's writer, which then
    holds both tensors and can tell whether they are equal (:func:`_tie_decisions`)."""
    units_of: dict[str, list[str]] = {}
    for name, src in sources.items():
        for key in src.keys:
            units_of.setdefault(key, []).append(name)
    for alias, source in hfmap.ties:
        if alias in units_of and source in units_of:
            for name in units_of[alias]:  # every part of a split alias
                dest[name] = dest[units_of[source][0]]
    return dest


def _config_ties(config: Any) -> bool | None:
    """The config's ``tie_word_embeddings``: True, False, or None when there is no config
    or it does not say."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        value = config.get("tie_word_embeddings")
    elif isinstance(config, (str, os.PathLike)):
        src = os.fspath(config)
        src = os.path.join(src, "config.json") if os.path.isdir(src) else src
        with open(src, encoding="utf-8") as f:  # readable: _check_config opened it
            data = json.load(f)
        value = data.get("tie_word_embeddings") if isinstance(data, dict) else None
    else:
        value = getattr(config, "tie_word_embeddings", None)
    return value if isinstance(value, bool) else None


def _tie_decisions(
    hfmap: HFMap, tensors: Mapping[str, torch.Tensor], tied: bool | None
) -> dict[str | None, str]:
    """Which tie aliases this rank does not write, each with why; under the key None, an
    error. An alias (``tie lm_head.weight = model.embed_tokens.weight``) is written only
    when the config says the weights are untied (``tie_word_embeddings: false``), or, with
    no config saying either, when the model's two tensors differ. A config that ties them
    while the model's tensors differ is an error: writing only the source would lose the
    alias's values, and writing both would contradict the config."""
    out: dict[str | None, str] = {}
    if tied is False:
        return out
    for alias, source in hfmap.ties:
        if alias not in tensors or source not in tensors:
            continue  # not exported, or on another rank (never: _colocate_ties)
        a, b = tensors[alias], tensors[source]
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        if same:
            out[alias] = f"equal to {source}"
        elif tied:
            out[None] = (
                f"HFError: the config ties {alias} to {source} (tie_word_embeddings: true), "
                f"but the model's tensors for them differ: the export would lose {alias}'s "
                "values. Pass a config with tie_word_embeddings false to write both, or tie "
                "the model's weights"
            )
    return out


def _gather_keys(keys: set[str]) -> list[str]:
    """The union of every rank's ``keys``, sorted."""
    every = [keys]
    if dist.is_initialized():
        every = [set()] * dist.get_world_size()
        dist.all_gather_object(every, keys)
    return sorted(set().union(*every))


def _to_hf(full: torch.Tensor, transforms: Sequence) -> torch.Tensor:
    per_dim, hf_dim_of = model_indices(transforms, tuple(full.shape))
    t = full
    for d, idx in enumerate(per_dim):
        if not isinstance(idx, range):
            t = t.index_select(d, torch.tensor(idx, dtype=torch.long))
    order = [hf_dim_of.index(k) for k in range(len(hf_dim_of))]
    if order != list(range(len(order))):
        t = t.permute(order)
    return t.contiguous()


def _write_config(config: Any, path: str) -> None:
    target = os.path.join(path, "config.json")
    if isinstance(config, (str, os.PathLike)):
        src = os.fspath(config)
        if os.path.isdir(src):
            src = os.path.join(src, "config.json")
        shutil.copyfile(src, target)
    elif isinstance(config, Mapping):
        with open(target, "w", encoding="utf-8") as f:
            json.dump(dict(config), f, indent=2, sort_keys=True)
    elif hasattr(config, "to_json_file"):  # a transformers PretrainedConfig
        config.to_json_file(target)
    else:
        raise HFError(f"config must be a dict, a path or a transformers config, not {type(config)}")


def _check_config(config: Any) -> None:
    """Refuse a config that cannot be written, before any rank writes anything."""
    if config is None or isinstance(config, Mapping) or hasattr(config, "to_json_file"):
        return
    if isinstance(config, (str, os.PathLike)):
        src = os.fspath(config)
        src = os.path.join(src, "config.json") if os.path.isdir(src) else src
        try:
            with open(src, encoding="utf-8") as f:
                json.load(f)
        except (OSError, ValueError) as e:
            raise HFError(f"config: {src} is not a readable config.json ({e})") from None
        return
    raise HFError(f"config must be a dict, a path or a transformers config, not {type(config)}")


def _attempt(step: Any) -> str | None:
    """Run ``step()``; its error as text, or None."""
    try:
        step()
    except Exception as e:  # reported to every rank by _agree
        return f"{type(e).__name__}: {e}"
    return None


def _agree(error: str | None, path: str, partial: str | None = None) -> None:
    """Share every rank's error; if any rank failed, all raise (rank 0 removes
    ``partial`` first), so no rank waits for one that gave up."""
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if partial is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        _remove_own(partial)
    lines = "\n  ".join(f"rank {r}: {e}" for r, e in failed)
    raise HFError(f"export to {path} failed; nothing was written there:\n  {lines}")


def _remove_own(partial: str) -> None:
    """Remove ``partial`` if export_hf made it (its marker is there), else leave it."""
    if os.path.isfile(os.path.join(partial, EXPORT_MARKER)):
        shutil.rmtree(partial, ignore_errors=True)


def _fresh_dir(partial: str) -> None:
    """Make ``partial`` with export_hf's marker. A leftover of an export that did not
    finish (marked) is replaced; a folder of that name that export_hf did not make is
    refused, never deleted."""
    if os.path.lexists(partial):
        if not os.path.isfile(os.path.join(partial, EXPORT_MARKER)):
            raise HFError(
                f"{partial} exists and was not made by export_hf (no {EXPORT_MARKER} in it); "
                "export_hf writes there before renaming: move or delete it"
            )
        shutil.rmtree(partial)
    os.makedirs(partial)
    with open(os.path.join(partial, EXPORT_MARKER), "w", encoding="utf-8") as f:
        f.write("export_hf writes this folder; it is renamed into place when complete\n")


def _write_file(tensors: dict[str, torch.Tensor], partial: str, name: str | None) -> None:
    from safetensors.torch import save_file

    assert name is not None
    tmp = os.path.join(partial, name + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(partial, name))


def _finish(partial: str, path: str, index: dict, config: Any) -> None:
    with open(os.path.join(partial, INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    if config is not None:
        _write_config(config, partial)
    os.remove(os.path.join(partial, EXPORT_MARKER))
    if os.path.lexists(path):
        # Moved aside, not deleted first: a crash between the renames leaves the old
        # export at ``<path>.replaced`` and the new one complete at ``<path>.partial``.
        aside = path + ".replaced"
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        os.rename(path, aside)
        os.replace(partial, path)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(partial, path)


def export_hf(
    spec: CompiledSpec,
    hfmap: HFMap,
    model: Any,
    path: str | os.PathLike,
    mesh: Any = None,
    *,
    config: Any = None,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
) -> HFExportReport:
    """Write ``model`` as a Hugging Face checkpoint at ``path``: one safetensors file per
    writing rank, ``model.safetensors.index.json``, and ``config.json`` when ``config`` is
    given (a dict, a transformers config, or a path to copy it from). Tensors keep the
    parameters' dtypes unless ``dtype`` is given (``torch.bfloat16`` for an fp32 model).

    Every rank calls it (with pipeline stages, each with its stage's model). Tensors go to
    writers balanced by bytes; every stored chunk is sent once, point to point, by the
    replica that the checkpoint writer balancing picks. The files are written into
    ``<path>.partial`` and renamed to ``path`` when every rank has written its file, so a
    failed export leaves no half-written checkpoint at ``path``.

    A tie alias of the ``hf`` block (``tie lm_head.weight = model.embed_tokens.weight``) is
    written only when ``config`` says the weights are untied (``tie_word_embeddings:
    false``), or, with no config that says either, when the model's two tensors differ. A
    config that ties them while the model's tensors differ is an error (the export would
    lose the alias's values). The report's ``aliases_not_written`` lists the aliases left out.
    """
    path = os.fspath(path).rstrip("/") or "/"
    error: HFError | None = None
    try:
        return _export_hf(spec, hfmap, model, path, mesh, config, overwrite, dtype)
    except (HFError, CheckpointError, SpecError):
        raise
    except (RuntimeError, OSError) as e:  # a rank died or a link broke (gloo, NCCL)
        # Built here, raised below, out of the except clause: no context chained, so no
        # frame of the failed export (its tensors, the mesh) stays referenced.
        rank = dist.get_rank() if dist.is_initialized() else 0
        partial = path + ".partial"
        if rank == 0:
            _remove_own(partial)
        error = HFError(
            f"export to {path} failed on rank {rank}: {type(e).__name__}: {e}. Another rank "
            f"probably stopped (its own error, if it lives, names the cause). {path} is "
            "unchanged"
            + ("" if rank == 0 else f"; a leftover {partial} is removed by the next export_hf")
        )
    try:
        raise error
    finally:
        error = None


def _export_hf(
    spec: CompiledSpec,
    hfmap: HFMap,
    model: Any,
    path: str,
    mesh: Any,
    config: Any,
    overwrite: bool,
    dtype: torch.dtype | None,
) -> HFExportReport:
    lm, rank = _mesh_and_rank(spec, mesh, "export_hf")
    m = _model(spec, lm, rank, model, saving=True)
    sources, problems = _resolve_sources(hfmap, m.units, strict=True)
    _raise(problems + _written_twice(sources), path)
    if os.path.exists(path) and not overwrite:
        raise HFError(f"{path} exists; pass overwrite=True to replace it")
    _check_config(config)
    plan = _export_plan(spec, hfmap, lm, m, sources, path)
    return _export(hfmap, plan, m.local, rank, path, config, dtype)


@dataclass
class _Transfers:
    """This rank's part of the chunk exchange: what it sends to each writer, and what it
    receives (unit name, chunk, bytes, in order) from each sender."""

    outgoing: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    incoming: dict[int, list[tuple[str, _Chunk, int]]] = field(default_factory=dict)


@dataclass
class _RankTensors:
    """The Hugging Face tensors this rank writes, and which rank writes every key."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    writer_of: dict[str, int] = field(default_factory=dict)


def _export(
    hfmap: HFMap,
    plan: _ExportPlan,
    local: Mapping[str, tuple[Unit, torch.Tensor]],
    rank: int,
    path: str,
    config: Any,
    dtype: torch.dtype | None,
) -> HFExportReport:
    """export_hf's collective part: every failure on one rank ends in an exchange of
    errors, so all ranks raise together instead of leaving the others waiting."""
    partial = path + ".partial"
    _agree(_attempt(lambda: _fresh_dir(partial)) if rank == 0 else None, path)
    report = HFExportReport()
    transfers = _transfers(plan, local, rank)
    device = next((t.device for _, t in local.values()), torch.device("cpu"))
    received = _exchange(transfers, rank, device, report)
    fulls = _assemble(plan, transfers, received, rank)
    out = _hf_tensors(plan, fulls, rank, dtype)
    ties = _tie_decisions(hfmap, out.tensors, _config_ties(config))
    tie_error = ties.pop(None, None)
    for key in _gather_keys(
        {k for k in ties if k is not None}
    ):  # aliases not written, from every writer
        out.tensors.pop(key, None)
        out.writer_of.pop(key, None)
        report.aliases_not_written.append(key)
    writers = sorted(set(plan.writer.values()))
    file_of = {
        r: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, r in enumerate(writers)
    }
    tensors = out.tensors
    if tensors:
        report.file = file_of[rank]
        report.tensors = len(tensors)
        report.bytes_written = sum(t.numel() * t.element_size() for t in tensors.values())
    mine = tie_error or (
        _attempt(lambda: _write_file(tensors, partial, file_of.get(rank))) if tensors else None
    )
    _agree(mine, path, partial)
    error = None
    if rank == 0:
        index = _index(plan, out.writer_of, file_of, set(report.aliases_not_written), dtype)
        error = _attempt(lambda: _finish(partial, path, index, config))
    _agree(error, path, partial)
    return report


def _transfers(
    plan: _ExportPlan, local: Mapping[str, tuple[Unit, torch.Tensor]], rank: int
) -> _Transfers:
    """Every chunk this rank sends (its bytes, by writer) and receives (by sender): one
    message per (sender, writer) pair."""
    mine = {(u.key, u.offsets): (u, t) for u, t in local.values()}
    out = _Transfers()
    for u in plan.units:
        writer = plan.writer[u.name]
        for c in plan.chunks.get(u.name, []):
            nbytes = math.prod(c.sizes) * u.dtype.itemsize
            if c.sender == rank:
                unit, tensor = mine[(u.name, c.offsets)]
                data = unit_data(unit, tensor).contiguous()
                out.outgoing.setdefault(writer, []).append(data.reshape(-1).view(torch.uint8))
            if writer == rank:
                out.incoming.setdefault(c.sender, []).append((u.name, c, nbytes))
    return out


def _exchange(
    transfers: _Transfers, rank: int, device: torch.device, report: HFExportReport
) -> dict[int, torch.Tensor]:
    """Send and receive every message in one batch; the bytes received, by sender (this
    rank's own chunks included, not sent)."""
    received: dict[int, torch.Tensor] = {}
    ops = []
    for peer, parts in sorted(transfers.outgoing.items()):
        buf = torch.cat(parts) if len(parts) > 1 else parts[0]
        if peer == rank:
            received[rank] = buf
            continue
        report.bytes_sent += buf.numel()
        ops.append(dist.P2POp(dist.isend, buf, peer))
    for peer, expected in sorted(transfers.incoming.items()):
        if peer == rank:
            continue
        n = sum(nb for _, _, nb in expected)
        buf = torch.empty(n, dtype=torch.uint8, device=device)
        report.bytes_received += n
        received[peer] = buf
        ops.append(dist.P2POp(dist.irecv, buf, peer))
    # One batch: NCCL would deadlock on separate sends and receives between two ranks
    # that both send first. (The collective in _agree before it makes this not the group's
    # first communication, as NCCL requires of a batch that not every rank joins.)
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return received


def _assemble(
    plan: _ExportPlan, transfers: _Transfers, received: Mapping[int, torch.Tensor], rank: int
) -> dict[str, torch.Tensor]:
    """The whole tensor of every unit this rank writes, from the chunks received."""
    dtype_of = {u.name: u.dtype for u in plan.units}
    fulls = {
        u.name: torch.empty(u.shape, dtype=u.dtype)
        for u in plan.units
        if plan.writer[u.name] == rank
    }
    for peer, parts in transfers.incoming.items():
        buf, pos = received[peer].cpu(), 0
        for name, c, nb in parts:
            piece = buf[pos : pos + nb].view(dtype_of[name]).view(c.sizes)
            box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
            fulls[name][box] = piece
            pos += nb
    return fulls


def _hf_tensors(
    plan: _ExportPlan, fulls: Mapping[str, torch.Tensor], rank: int, dtype: torch.dtype | None
) -> _RankTensors:
    """The Hugging Face tensors this rank writes (its units through the mapping's
    transforms, split parts placed in their tensor), and every key's writer."""
    out = _RankTensors()
    for u in plan.units:
        src, writer = plan.sources[u.name], plan.writer[u.name]
        for k, key in enumerate(src.keys):
            out.writer_of[key] = writer
            if writer != rank:
                continue
            part = _to_hf(fulls[u.name][k] if src.stacked else fulls[u.name], src.transforms)
            if dtype is not None:
                part = part.to(dtype)
            if src.split is None:
                out.tensors[key] = part
                continue
            # A part of a split tensor: its place along the split dimension.
            whole = out.tensors.get(key)
            if whole is None:
                whole = out.tensors[key] = torch.empty(src.shape, dtype=part.dtype)
            whole.narrow(src.split.dim, src.split.start, src.split.size).copy_(part)
    return out


def _index(
    plan: _ExportPlan,
    writer_of: Mapping[str, int],
    file_of: Mapping[int, str],
    skipped: set[str],
    dtype: torch.dtype | None,
) -> dict[str, Any]:
    """The checkpoint's ``model.safetensors.index.json``."""
    total = sum(
        math.prod(u.shape) // len(plan.sources[u.name].keys) * (dtype or u.dtype).itemsize
        for u in plan.units
        for key in plan.sources[u.name].keys
        if key not in skipped
    )
    return {
        "metadata": {"total_size": total},
        "weight_map": {k: file_of[r] for k, r in sorted(writer_of.items())},
    }
