"""What load_hf and export_hf share: errors, reports, the whole model's storage units, the
checkpoint folder's files, and the mapping's sources."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardspec.core.hfmap import (
    Fused,
    HFMap,
    Source,
    fused_of,
    unit_names,
)
from shardspec.core.jsontext import JSONTextError, read_json
from shardspec.core.layout import Mesh, ParamLayout
from shardspec.core.paths import Escape, escape
from shardspec.runtime.canonical import CanonicalPlan, Unit
from shardspec.runtime.spec import CompiledSpec
from shardspec.runtime.units import (
    Names,
    canonical_plan,
    count_name_indexed,
    mesh_and_rank,
)

INDEX = "model.safetensors.index.json"
# Marks a ``<path>.partial`` folder as an export in progress (shardspec.runtime.hf.folders):
# only a folder export_hf wrote it into is ever removed.
EXPORT_MARKER = ".shardspec-export-in-progress"
SINGLE = "model.safetensors"
_MAX_LISTED = 20
# Below this many bytes to read, rank 0 shows no progress bar unless asked to.
PROGRESS_BYTES = 256 << 20


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
    # what export_hf finished or undid of an interrupted export to the same path, one
    # sentence each (also warned as ExportRecoveryWarning; the same on every rank)
    recovered: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------- units


@dataclass(frozen=True)
class GlobalUnit:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fused: Fused | None = None  # the parameter's fused dimension, for a component


@dataclass(frozen=True)
class ParamInfo:
    """A parameter's layout, and where its name-indexed captures are in its name."""

    layout: ParamLayout
    spans: list[tuple[int, int]]


@dataclass
class ModelView:
    """One rank's model in the whole model's terms: its own units and tensors (``local``,
    under its save or load ``plan``), and every parameter of the whole model by global
    name, with its layout and dtype, and every storage unit (the same on every rank)."""

    plan: CanonicalPlan
    local: dict[str, tuple[Unit, torch.Tensor]]
    names: Names
    params: dict[str, ParamInfo]
    dtypes: dict[str, torch.dtype]
    units: dict[str, GlobalUnit]


def _model_state(model: Any) -> dict[str, Any]:
    if isinstance(model, Mapping):
        return dict(model)
    return dict(model.state_dict(keep_vars=True))


def hf_mesh_and_rank(spec: CompiledSpec, mesh: Any, caller: str) -> tuple[Mesh, int]:
    """The layout mesh and this rank, for ``caller`` (``load_hf``, ``export_hf``): its own
    error, naming its own ``mesh=`` argument, when there is no mesh."""
    mesh = mesh if mesh is not None else spec.last_mesh
    if mesh is None:
        raise HFError(
            f"{caller}: no mesh: pass mesh=... to {caller}, or build the model's mesh with "
            "build_mesh()/distribute() first"
        )
    return mesh_and_rank(spec, mesh)


def model_view(spec: CompiledSpec, lm: Mesh, rank: int, model: Any, *, saving: bool) -> ModelView:
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
    return ModelView(plan, local, names, params, dtypes, global_units(params, dtypes))


def _params(
    spec: CompiledSpec, names: Names, lm: Mesh, flat: Mapping[str, Any], keys: Iterable[str]
) -> dict[str, ParamInfo]:
    """The layout of each parameter in ``keys``, and where its name-indexed captures are."""
    counts = count_name_indexed(spec, names, flat)
    out = {}
    for key in sorted(keys):
        layout = spec.layout(key, lm, names.shape_for_layout(key, flat[key]), counts.get(key))
        out[key] = ParamInfo(layout, names.name_indexed_spans(key, layout))
    return out


def _stage_params(spec: CompiledSpec, names: Names, lm: Mesh) -> dict[str, ParamInfo]:
    """Pipeline stages: every parameter and persistent buffer of the whole model, from the
    manifest."""
    assert names.stages is not None
    if names.table is None:
        raise HFError(
            f"spec {spec.name!r} has pipeline stages, but its manifest does not describe the "
            f"model on mesh {dict(zip(lm.names, lm.sizes, strict=True))} (its local axes were "
            f"built at {spec.built_sizes}): load_hf/export_hf of a stage need the other "
            "stages' parameters from the manifest"
        )
    out = {}
    for fqn in sorted([*names.stages.stage, *names.stages.buffer_stages]):
        if spec.is_ignored(fqn):
            continue
        layout = spec.layout(fqn, lm)
        out[fqn] = ParamInfo(layout, names.name_indexed_spans(fqn, layout))
    return out


def manifest_entry(spec: CompiledSpec, fqn: str) -> tuple[tuple[int, ...], str]:
    """The module tensor shape and dtype the manifest gives parameter or buffer ``fqn``."""
    assert spec.params is not None
    entry = spec.params.get(fqn) or spec.buffers[fqn]
    if entry.shape is None:
        raise HFError(
            f"spec {spec.name!r} names buffer {fqn!r} without its shape (a table built by "
            "hand): other pipeline stages' buffers need the manifest's shapes; compile the "
            "spec with `shardspec compile`"
        )
    return entry.shape, entry.dtype


def _manifest_dtypes(
    names: Names, params: Iterable[str], held: Mapping[str, torch.dtype]
) -> dict[str, torch.dtype]:
    """The manifest's dtypes of the parameters and buffers this rank does not hold."""
    return {f: torch_dtype(manifest_entry(names.spec, f)[1], f) for f in params if f not in held}


def global_units(
    params: Mapping[str, ParamInfo], dtypes: Mapping[str, torch.dtype]
) -> dict[str, GlobalUnit]:
    """Every storage unit of every rank (the same on every rank), by name."""
    out: dict[str, GlobalUnit] = {}
    for key, p in params.items():
        fused = fused_of(p.layout.dims)
        for name, shape in unit_names(key, p.layout.dims, p.spans):
            out.setdefault(name, GlobalUnit(name, shape, dtypes[key], fused))
    return out


def torch_dtype(name: str, fqn: str) -> torch.dtype:
    """The torch dtype a manifest names (``"float32"``, ``"torch.bfloat16"``)."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise HFError(f"{fqn}: the manifest's dtype {name!r} is not a torch dtype")
    return dt


# ----------------------------------------------------------------------------- the files


def weight_map_of(path: str, handles: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """``key -> file`` of the checkpoint at ``path`` and the problems found on the way
    (a single-file checkpoint is opened here, into ``handles``). Every file, the index
    included, must be inside the folder, links followed, except where Hugging Face's cache
    links a snapshot's files to its blobs (the rule of :mod:`shardspec.core.paths`); a file
    that is not is never opened."""
    if not os.path.isdir(path):
        raise HFError(f"{path}: not a directory (expected a Hugging Face checkpoint folder)")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        _refuse_outside(path, INDEX)
        wm = _read_index(index)
        problems = []
        # file -> why it escapes, or None, and whether it is a file: once per file, not
        # per key (a checkpoint has thousands of keys in a few files)
        seen: dict[str, tuple[Escape | None, bool]] = {}
        for key, rel in sorted(wm.items()):
            if rel not in seen:
                why = escape(path, rel)
                seen[rel] = why, why is None and os.path.isfile(os.path.join(path, rel))
            why, is_file = seen[rel]
            if why is not None:
                problems.append(
                    f"{key}: weight_map points to {rel!r}, outside the checkpoint directory "
                    f"{path} (the file {why.value})"
                )
            elif not is_file:
                problems.append(
                    f"{key}: weight_map points to {rel!r}, which does not exist in {path}"
                )
        return wm, problems
    single = os.path.join(path, SINGLE)
    if not os.path.isfile(single):
        raise HFError(f"{path}: neither {INDEX} nor {SINGLE} is there")
    return {key: SINGLE for key in open_file(path, SINGLE, handles).keys()}, []


def _refuse_outside(root: str, rel: str) -> None:
    """An ``HFError`` if ``root/rel`` is not a file of the folder (:mod:`shardspec.core.paths`)."""
    why = escape(root, rel)
    if why is not None:
        raise HFError(
            f"{os.path.join(root, rel)}: the file {why.value}; nothing was read (copy the "
            "checkpoint with `cp -rL` to read it)"
        )


def _read_index(index: str) -> dict[str, str]:
    """The ``weight_map`` of the index file ``index``."""
    try:
        data = read_json(index)
    except OSError as e:
        raise HFError(f"{index}: cannot be read ({e.strerror or e})") from None
    except JSONTextError as e:
        raise HFError(f"{index}: not readable JSON: {e}") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
    ):
        raise HFError(f"{index}: no 'weight_map' object of key -> file name")
    return dict(wm)


def open_file(root: str, rel: str, handles: dict[str, Any]) -> Any:
    """The file's safetensors handle, opened once and kept in ``handles``; a file outside
    the folder (:mod:`shardspec.core.paths`) is refused, never opened."""
    handle = handles.get(rel)
    if handle is None:
        from safetensors import safe_open

        _refuse_outside(root, rel)
        try:
            handle = safe_open(os.path.join(root, rel), framework="pt")
        except Exception as e:  # safetensors raises its own error type for bad files
            raise HFError(
                f"{os.path.join(root, rel)}: not a readable safetensors file ({e})"
            ) from None
        handles[rel] = handle
    return handle


def raise_problems(problems: list[str], path: str, hints: Iterable[str] = ()) -> None:
    """An :class:`HFError` listing ``problems`` (the first of them), then ``hints`` (what
    to do about a kind of problem, said once), unless there are none."""
    if not problems:
        return
    shown = problems[:_MAX_LISTED]
    more = len(problems) - len(shown)
    tail = f"\n  ... and {more} more" if more else ""
    tail += "".join(f"\n{h}" for h in hints)
    raise HFError(
        f"{path} does not fit the spec's hf mapping ({len(problems)} problem"
        f"{'s' if len(problems) != 1 else ''}); the model was not changed:\n  "
        + "\n  ".join(shown)
        + tail
    )


def resolve_sources(
    hfmap: HFMap, units: Mapping[str, GlobalUnit], strict: bool
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
                problems.append(
                    f"{name}: no rule of the hf mapping produces this parameter or buffer"
                )
        else:
            rules = ", ".join(f"line {hfmap.rules[s.rule].line}" for s in found)
            problems.append(f"{name}: produced by several rules of the hf mapping ({rules})")
    return sources, problems


def _split_problems(hfmap: HFMap, name: str, src: Source, fused: Fused | None) -> list[str]:
    """A split line whose `as` list names what is no component (lint: SS081)."""
    rule = hfmap.rules[src.rule]
    if src.split is None or rule.parts is None or fused is None:
        return []
    comps = {c for c, _ in fused.components}
    return [
        f"{name}: line {rule.line} splits its Hugging Face tensor into {p.name!r}, which is "
        f"no component of {name.rpartition('.')[0]} ({', '.join(c for c, _ in fused.components)})"
        for p in rule.parts
        if p.name not in comps
    ]
