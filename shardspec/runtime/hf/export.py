"""export_hf: chunks sent once to balanced writers, written into a marked folder and
renamed into place."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardspec.core.hfmap import (
    BlockQuant,
    HFMap,
    Source,
    Split,
    model_indices,
)
from shardspec.core.jsontext import read_json
from shardspec.core.layout import Mesh
from shardspec.runtime.canonical import CanonicalPlan, Unit, rank_pieces, replica_groups
from shardspec.runtime.checkpoint.collectives import checkpoint_group
from shardspec.runtime.hf.common import (
    GlobalUnit,
    HFError,
    HFExportReport,
    ModelView,
    ParamInfo,
    global_units,
    hf_mesh_and_rank,
    manifest_entry,
    model_view,
    raise_problems,
    resolve_sources,
    torch_dtype,
)
from shardspec.runtime.hf.exchange import Messages, exchange, stage_messages
from shardspec.runtime.hf.folders import ExportSession, Gather, attempt, attempt_value, target
from shardspec.runtime.hf.fp8 import quantization_config, quantize, quantized_nbytes
from shardspec.runtime.spec import CompiledSpec, SpecError
from shardspec.runtime.units import (
    CheckpointError,
    Names,
    canonical_plan,
    unit_data,
)

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

    units: list[GlobalUnit]  # the units written, by name
    sources: dict[str, Source]  # unit name -> the Hugging Face tensor(s) it is written as
    writer: dict[str, int]  # unit name -> the rank that writes its tensor(s)
    chunks: dict[str, list[_Chunk]]  # unit name -> its stored chunks, each with its sender
    hfmap: HFMap


def _export_plan(
    spec: CompiledSpec,
    hfmap: HFMap,
    lm: Mesh,
    m: ModelView,
    sources: dict[str, Source],
    path: str,
    gather: Gather,
) -> _ExportPlan:
    """The writer of every unit (balanced by bytes, tie aliases with their sources) and the
    sender of every stored chunk (``gather``: the export's all-gather, for pipeline
    stages' dtypes)."""
    units = m.units
    plan_of: Callable[[str], CanonicalPlan] = lambda _fqn: m.plan  # noqa: E731
    if m.names.stages is not None:
        # Each rank's plan knows only its stage's senders: every rank computes every
        # stage's, from the stage's structure, with the dtypes every rank really holds.
        dtypes = _stage_dtypes(spec, m.names, m.local, m.dtypes, path, gather)
        units = global_units(m.params, dtypes)
        plan_of = _stage_plans(spec, lm, m.names, dtypes)
    chunks = _global_chunks(m.names, lm, m.params, plan_of)
    todo = [units[n] for n in sorted(sources)]
    writer = _colocate_ties(hfmap, sources, _assign(_bundles(todo, sources), lm.world))
    return _ExportPlan(todo, sources, writer, chunks, hfmap)


def _global_chunks(
    names: Names,
    lm: Mesh,
    params: Mapping[str, ParamInfo],
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
    gather: Gather,
) -> dict[str, torch.dtype]:
    """Pipeline stages: every parameter's real dtype (a stage model cast to bf16 is not what
    the manifest says), shared by every rank of each stage (``gather``: the export's
    all-gather). Every rank raises if any rank's stage model lacks a parameter of its stage
    or two ranks of a stage disagree."""
    sp = names.stages
    assert sp is not None and names.stage is not None
    held = {names.global_of(u.source): str(t.dtype) for u, t in local.values()}
    own = {f for f in sp.stored_of(names.stage) if not spec.is_ignored(f)}
    missing = sorted(own - set(held))
    error = None
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        error = (
            f"its model lacks {len(missing)} parameter(s) or buffer(s) of stage {names.stage}: "
            f"{', '.join(sp.local_name(m, names.stage) for m in missing[:3])}{more}"
        )
    every = gather((names.stage, sorted(held.items()), error))
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
            out[fqn] = torch_dtype(dt.removeprefix("torch."), fqn)
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
            sp.local_name(f, s): torch.empty(
                manifest_entry(spec, f)[0], dtype=dtypes[f], device="meta"
            )
            for f in sp.stored_of(s)
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
        tiled = None not in splits and _tile(
            [(src.rule, src.split) for _, src in found]  # type: ignore[misc]
        )
        if not tiled:
            names = " and ".join(n for n, _ in found)
            how = ", not as parts that tile it" if any(splits) else ""
            out.append(f"{key}: both {names} would be written under it{how}")
    return out


def _tile(parts: list[tuple[int, Split]]) -> bool:
    """Whether the parts of one line's split tensor tile its split dimension exactly (per
    group: one group is the whole dimension unless the line is ``grouped``)."""
    shared = {(rule, sp.dim, sp.total, sp.groups) for rule, sp in parts}
    if len(shared) != 1:
        return False
    (_, _, total, groups), *_ = shared
    blocks = sorted((sp.start, sp.size // groups) for _, sp in parts)
    return (
        all(a == b for (a, _), b in zip(blocks, _ends(blocks), strict=True))
        and sum(n for _, n in blocks) * groups == total
    )


def _ends(parts: list[tuple[int, int]]) -> list[int]:
    """Where each of the sorted ``(start, size)`` parts would start if they tiled from 0."""
    out, at = [], 0
    for start, size in parts:
        out.append(at)
        at = start + size
    return out


def _bundles(todo: Sequence[GlobalUnit], sources: Mapping[str, Source]) -> list[list[GlobalUnit]]:
    """Units that one rank must write together: the parts of one split HF tensor."""
    out: dict[tuple[str, ...], list[GlobalUnit]] = {}
    for u in todo:
        src = sources[u.name]
        out.setdefault(src.keys if src.split is not None else (u.name,), []).append(u)
    return list(out.values())


def _assign(bundles: Sequence[Sequence[GlobalUnit]], world: int) -> dict[str, int]:
    """Which rank writes each unit: bundles (the parts of one HF tensor go together)
    largest first, to the rank with the fewest bytes."""
    load = [0] * world
    out = {}

    def nbytes(b: Sequence[GlobalUnit]) -> int:
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
        data = read_json(src)  # readable: _check_config read it
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


def _gather_keys(keys: set[str], gather: Gather) -> list[str]:
    """The union of every rank's ``keys``, sorted."""
    return sorted(set().union(*gather(keys)))


def _to_hf(full: torch.Tensor, transforms: Sequence) -> torch.Tensor:
    per_dim, hf_dim_of = model_indices(transforms, tuple(full.shape))
    t = full
    for d, idx in enumerate(per_dim):
        if not isinstance(idx, range):
            t = t.index_select(d, torch.tensor(idx, dtype=torch.long))
        elif len(idx) != t.shape[d]:  # a padded dimension: its real indices only
            t = t.narrow(d, idx.start, len(idx))
    order = [hf_dim_of.index(k) for k in range(len(hf_dim_of))]
    if order != list(range(len(order))):
        t = t.permute(order)
    return t.contiguous()


def _write_config(config: Any, path: str, quant: BlockQuant | None = None) -> None:
    """``config.json`` in the folder ``path``, from ``config``; with ``quant`` (the
    export wrote block-scaled FP8 tensors), its ``quantization_config`` says so; without,
    an FP8 ``quantization_config`` (a config copied from an FP8 checkpoint) is removed,
    since transformers would read the export's tensors as FP8."""
    if config is None:
        return
    target = os.path.join(path, "config.json")
    _copy_config(config, target)
    data = read_json(target)
    if not isinstance(data, dict):
        if quant is None:
            return  # not a transformers config, but the caller's to give
        raise HFError(f"config: {target} is not a JSON object for the quantization_config")
    if quant is not None:
        data["quantization_config"] = quantization_config(quant)
    elif _is_fp8(data.get("quantization_config")):
        del data["quantization_config"]  # copied from an FP8 checkpoint: not this export
    else:
        return
    with open(target, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def _is_fp8(qc: Any) -> bool:
    return isinstance(qc, Mapping) and qc.get("quant_method") == "fp8"


def _copy_config(config: Any, target: str) -> None:
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
            read_json(src)
        except (OSError, ValueError) as e:
            raise HFError(f"config: {src} is not a readable config.json ({e})") from None
        return
    raise HFError(f"config must be a dict, a path or a transformers config, not {type(config)}")


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
    keep_dtype: str | Sequence[str] = (),
    process_group: Any = None,
) -> HFExportReport:
    """Write ``model`` as a Hugging Face checkpoint at ``path``: one safetensors file per
    writing rank, ``model.safetensors.index.json``, and ``config.json`` when ``config`` is
    given (a dict, a transformers config, or a path to copy it from).

    ``dtype`` (``torch.bfloat16`` for an fp32 model) casts every floating tensor,
    parameters and persistent buffers alike, as ``model.to(dtype)`` does before
    transformers' ``save_pretrained``; integer and bool tensors keep their dtype.
    ``keep_dtype``: glob patterns (``fnmatch``, case-sensitive) of Hugging Face keys that
    keep the model's own dtype, as transformers keeps a model's ``_keep_in_fp32_modules``
    in fp32 when it loads it in bf16 (DeepSeek-V3: ``["*.mlp.gate.weight",
    "*.e_score_correction_bias"]``); a pattern that matches no key of the export is an
    error. Without ``dtype`` every tensor keeps its dtype.

    Every rank calls it (with pipeline stages, each with its stage's model). Tensors go to
    writers balanced by bytes; every stored chunk is sent once, point to point, by the
    replica that the checkpoint writer balancing picks (staged through host memory:
    :mod:`~shardspec.runtime.hf.exchange`). The files are written into ``<path>.partial``
    and renamed to ``path`` when every rank has written its file, so a failed export leaves
    no half-written checkpoint at ``path``.

    ``process_group``: the group of every collective and every message of the export
    (every rank of the model's mesh in its rank order, with a gloo backend: the whole job,
    or the trainer's ranks of a job that also holds an inference engine); default
    :func:`~shardspec.runtime.checkpoint.checkpoint_group`, shardspec's own gloo group, as
    for ``save``. When a rank dies, a survivor whose collective failed destroys that group
    (never one of yours), so no survivor waits out a timeout for another that gave up;
    each raises an :class:`HFError` that names the rank that stopped where the job's store
    knows it, and says what ``path`` holds.

    A tie alias of the ``hf`` block (``tie lm_head.weight = model.embed_tokens.weight``) is
    written only when ``config`` says the weights are untied (``tie_word_embeddings:
    false``), or, with no config that says either, when the model's two tensors differ. A
    config that ties them while the model's tensors differ is an error (the export would
    lose the alias's values). The report's ``aliases_not_written`` lists the aliases left out.
    """
    path = target(path, HFError)
    error: HFError | None = None
    try:
        cast = _cast(dtype, keep_dtype)
        return _export_hf(spec, hfmap, model, path, mesh, config, overwrite, cast, process_group)
    except (HFError, CheckpointError, SpecError):
        raise
    except (RuntimeError, OSError) as e:  # a rank died or a link broke (gloo, NCCL)
        # Built here, raised below, out of the except clause: no context chained, so no
        # frame of the failed export (its tensors, the mesh) stays referenced.
        rank = dist.get_rank() if dist.is_initialized() else 0
        error = HFError(
            f"export to {path} failed on rank {rank} before anything was written: "
            f"{type(e).__name__}: {e}. Another rank probably stopped (its own error, if it "
            f"lives, names the cause). {path} is unchanged"
        )
    try:
        raise error
    finally:
        error = None


@dataclass(frozen=True)
class _Cast:
    """``export_hf``'s ``dtype`` and ``keep_dtype``: the dtype each key is written in."""

    dtype: torch.dtype | None
    keep: tuple[str, ...]

    def of(self, key: str, held: torch.dtype) -> torch.dtype:
        """The dtype ``key``'s tensor is written in, the model holding it as ``held``."""
        if self.dtype is None or not held.is_floating_point:
            return held
        if any(fnmatch.fnmatchcase(key, p) for p in self.keep):
            return held
        return self.dtype

    def check(self, keys: Sequence[str], hfmap: HFMap) -> None:
        """A pattern of ``keep_dtype`` that matches none of the export's ``keys`` is an
        error (a typo would write in ``dtype`` what was meant to be kept), and so is one
        that matches a key an fp8 line declares (the line says how that key is written:
        FP8 with its scale; keeping its dtype would be ignored)."""
        unused = [p for p in self.keep if not any(fnmatch.fnmatchcase(k, p) for k in keys)]
        if unused:
            raise HFError(
                f"keep_dtype: {', '.join(repr(p) for p in unused)} matches no Hugging Face "
                "key of the export (patterns are fnmatch globs over the keys the hf block "
                "writes, such as '*.mlp.gate.weight'); nothing was written"
            )
        for p in self.keep:
            key = next((k for k in keys if fnmatch.fnmatchcase(k, p) and hfmap.quant_of(k)), "")
            bq = hfmap.quant_of(key)
            if bq is not None:
                raise HFError(
                    f"keep_dtype: {p!r} matches {key}, which the hf block writes block-scaled "
                    f"in FP8 (line {bq.line}: {bq}), whatever the model's dtype; narrow the "
                    "pattern to keys no fp8 line covers, or narrow the fp8 line to write the "
                    "key in the model's dtype; nothing was written"
                )


def _cast(dtype: Any, keep: str | Sequence[str]) -> _Cast:
    """``dtype`` and ``keep_dtype`` checked (one pattern may be given as a string)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise HFError(f"dtype must be a torch.dtype (torch.bfloat16, say), not {dtype!r}")
    patterns = (keep,) if isinstance(keep, str) else tuple(keep)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise HFError(f"keep_dtype must be glob patterns of Hugging Face keys, not {bad[0]!r}")
    return _Cast(dtype, patterns)


def _export_group(process_group: Any, world: int, rank: int) -> Any:
    """The export's process group: the caller's (every rank of the model's mesh, ``world``
    of them, in the mesh's rank order: the whole job, or the trainer's ranks of a job that
    holds an inference engine too; a gloo backend), or shardspec's own checkpoint group (a
    collective on first use)."""
    if not dist.is_initialized():
        return None
    if process_group is None:
        return checkpoint_group()
    try:
        size = dist.get_world_size(process_group)  # -1 on a rank outside it
        backend = str(dist.get_backend(process_group)) if size > 0 else ""
        own = dist.get_rank(process_group) if size > 0 else -1
    except (ValueError, RuntimeError, AttributeError, TypeError) as e:
        raise HFError(f"process_group: not a process group of this job ({e})") from None
    if size != world or own != rank:
        raise HFError(
            f"process_group: export_hf needs a group of the model's {world} ranks, in the "
            f"mesh's order (this rank is mesh rank {rank}, so rank {rank} of the group); "
            f"this one has {'not this rank' if size < 0 else f'{size} ranks, this rank {own}'}"
            "; nothing was written"
        )
    if "gloo" not in backend:  # "gloo", or "cpu:gloo,cuda:nccl"
        raise HFError(
            f"process_group: export_hf sends its chunks through host memory and needs a "
            f"group with a gloo backend, not {backend!r}; leave process_group out to use "
            "shardspec's own gloo group; nothing was written"
        )
    return process_group


def _export_hf(
    spec: CompiledSpec,
    hfmap: HFMap,
    model: Any,
    path: str,
    mesh: Any,
    config: Any,
    overwrite: bool,
    cast: _Cast,
    process_group: Any,
) -> HFExportReport:
    lm, rank = hf_mesh_and_rank(spec, mesh, "export_hf")
    m = model_view(spec, lm, rank, model, saving=True)
    sources, problems = resolve_sources(hfmap, m.units, strict=True)
    raise_problems(problems + _written_twice(sources), path)
    cast.check([key for src in sources.values() for key in src.keys], hfmap)
    quant = _export_quant(hfmap, sources)
    session = ExportSession(path, rank, _export_group(process_group, lm.world, rank))
    return _export(session, spec, hfmap, lm, m, sources, config, cast, overwrite, quant)


def _export_quant(hfmap: HFMap, sources: Mapping[str, Source]) -> BlockQuant | None:
    """The FP8 declaration the export's block-scaled tensors share (transformers'
    ``quantization_config`` holds one block size and one FP8 format), or None when the
    export writes none; two that differ are an error, before anything is written."""
    used: dict[str, BlockQuant] = {}
    for src in sources.values():
        for key in src.keys:
            bq = hfmap.quant_of(key)
            if bq is not None:  # (the scale's dtype is no field of the config)
                used.setdefault(json.dumps(quantization_config(bq), sort_keys=True), bq)
    if len(used) > 1:
        lines = ", ".join(f"line {bq.line}: {bq} ({bq.dtype})" for bq in used.values())
        raise HFError(
            f"export_hf: the hf block's FP8 lines differ in block size, FP8 dtype or "
            f"power-of-two (ue8m0) scales ({lines}); transformers' quantization_config states "
            "one of each, so the export could not say how its tensors are stored; nothing "
            "was written"
        )
    return next(iter(used.values()), None)


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
    session: ExportSession,
    spec: CompiledSpec,
    hfmap: HFMap,
    lm: Mesh,
    m: ModelView,
    sources: dict[str, Source],
    config: Any,
    cast: _Cast,
    overwrite: bool,
    quant: BlockQuant | None,
) -> HFExportReport:
    """export_hf's collective part, in the folder protocol's steps
    (:class:`~shardspec.runtime.hf.folders.ExportSession`): a failed collective or message
    (a rank that died, or one that gave up) is an ``HFError`` that says what ``path``
    holds, raised once this rank has let go of the export's group (if it is shardspec's:
    then no rank waits on this one)."""
    error: HFError | None = None
    try:
        plan = _export_plan(spec, hfmap, lm, m, sources, session.path, session.gather)
        return _export_steps(session, hfmap, plan, m.local, config, cast, overwrite, quant)
    except HFError:
        raise
    except (RuntimeError, OSError) as e:  # a rank died or a link broke (gloo)
        error = session.lost(e)  # raised below, out of the except clause (see export_hf)
    finally:
        session.close()
    session.discard()
    try:
        raise error
    finally:
        error = None


def _export_steps(
    session: ExportSession,
    hfmap: HFMap,
    plan: _ExportPlan,
    local: Mapping[str, tuple[Unit, torch.Tensor]],
    config: Any,
    cast: _Cast,
    overwrite: bool,
    quant: BlockQuant | None,
) -> HFExportReport:
    """Every failure on one rank ends in an exchange of errors, so all ranks raise
    together instead of leaving the others waiting. ``quant``: the FP8 declaration the
    config states (:func:`_export_quant`)."""
    rank = session.rank
    transfers = _transfers(plan, local, rank)
    error, messages = attempt_value(lambda: _ready(config, transfers, rank))
    recovered = session.prepare(overwrite, error)
    report = HFExportReport(recovered=recovered)
    report.bytes_sent, report.bytes_received = messages.bytes_sent, messages.bytes_received
    received = exchange(messages, session.world, session.group)
    fulls = _assemble(plan, transfers, received, rank)
    out = _hf_tensors(plan, fulls, rank, cast)
    ties = _tie_decisions(hfmap, out.tensors, _config_ties(config))
    tie_error = ties.pop(None, None)
    # aliases not written, from every writer
    for key in _gather_keys({k for k in ties if k is not None}, session.gather):
        bq = hfmap.quant_of(key)
        for k in (key, bq.scale_key(key)) if bq is not None else (key,):
            out.tensors.pop(k, None)
            out.writer_of.pop(k, None)
        report.aliases_not_written.append(key)
    quant_error = _quantize_tensors(hfmap, out)
    writers = sorted(set(plan.writer.values()))
    file_of = {
        r: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, r in enumerate(writers)
    }
    tensors = out.tensors
    if tensors:
        report.file = file_of[rank]
        report.tensors = len(tensors)
        report.bytes_written = sum(t.numel() * t.element_size() for t in tensors.values())
    mine = (
        tie_error
        or quant_error
        or (attempt(lambda: session.write(tensors, file_of[rank])) if tensors else None)
    )
    session.written(mine)
    error = None
    if rank == 0:
        index = _index(plan, out.writer_of, file_of, set(report.aliases_not_written), cast)
        error = attempt(
            lambda: session.finish(index, lambda folder: _write_config(config, folder, quant))
        )
    session.finished_by_rank0(error)
    return report


def _ready(config: Any, transfers: _Transfers, rank: int) -> Messages:
    """This rank's part before step 1, whose error every rank raises with step 1's: the
    config readable here (a path may be missing on one node), the messages staged in host
    memory."""
    _check_config(config)
    incoming = {peer: sum(nb for _, _, nb in parts) for peer, parts in transfers.incoming.items()}
    return stage_messages(transfers.outgoing, incoming, rank)


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
        buf, pos = received[peer], 0
        for name, c, nb in parts:
            piece = buf[pos : pos + nb].view(dtype_of[name]).view(c.sizes)
            box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
            fulls[name][box] = piece
            pos += nb
    return fulls


def _hf_tensors(
    plan: _ExportPlan, fulls: Mapping[str, torch.Tensor], rank: int, cast: _Cast
) -> _RankTensors:
    """The Hugging Face tensors this rank writes (its units through the mapping's
    transforms, split parts placed in their tensor, each in its dtype: ``cast``; a
    block-scaled FP8 key in float32, quantized by :func:`_quantize_tensors`), and every
    key's writer."""
    out = _RankTensors()
    for u in plan.units:
        src, writer = plan.sources[u.name], plan.writer[u.name]
        for k, key in enumerate(src.keys):
            # Every rank records every key's writer (rank 0 writes the index from it),
            # the scales of FP8 keys included.
            out.writer_of[key] = writer
            bq = plan.hfmap.quant_of(key)
            if bq is not None:
                out.writer_of[bq.scale_key(key)] = writer
            if writer != rank:
                continue
            part = _to_hf(fulls[u.name][k] if src.stacked else fulls[u.name], src.transforms)
            part = part.to(torch.float32 if bq is not None else cast.of(key, part.dtype))
            if src.split is None:
                out.tensors[key] = part
                continue
            # A part of a split tensor: its place along the split dimension.
            whole = out.tensors.get(key)
            if whole is None:
                whole = out.tensors[key] = torch.empty(src.shape, dtype=part.dtype)
            _place_part(whole, part, src.split)
    return out


def _quantize_tensors(hfmap: HFMap, out: _RankTensors) -> str | None:
    """Replace each block-scaled FP8 key's float32 tensor in ``out`` by its FP8 tensor
    and add its scale (:func:`~shardspec.runtime.hf.fp8.quantize`: the writer holds the
    whole tensor, so each block has exactly one writer); an error as text for a tensor
    that cannot be quantized (every rank then raises it)."""
    for key in sorted(out.tensors):
        bq = hfmap.quant_of(key)
        if bq is None:
            continue
        try:
            out.tensors[key], out.tensors[bq.scale_key(key)] = quantize(out.tensors[key], bq)
        except ValueError as e:
            return f"HFError: {key}: {e}; its FP8 export (line {bq.line}: {bq}) is impossible"
    return None


def _place_part(whole: torch.Tensor, part: torch.Tensor, split: Split) -> None:
    """Copy ``part`` into its place in ``whole``: along ``split.dim``, ``groups`` blocks,
    in each block the part's rows of that group from ``split.start``."""
    g, d = split.groups, split.dim
    blocks = whole.unflatten(d, (g, split.total // g))
    per = split.size // g
    blocks.narrow(d + 1, split.start, per).copy_(part.unflatten(d, (g, per)))


def _index(
    plan: _ExportPlan,
    writer_of: Mapping[str, int],
    file_of: Mapping[int, str],
    skipped: set[str],
    cast: _Cast,
) -> dict[str, Any]:
    """The checkpoint's ``model.safetensors.index.json``."""
    size_of: dict[str, int] = {}  # every key written (a split one once), in bytes
    for u in plan.units:
        src = plan.sources[u.name]
        for key in src.keys:
            bq = plan.hfmap.quant_of(key)
            if bq is not None:
                size_of[key] = quantized_nbytes(bq, src.shape)
            else:
                size_of[key] = math.prod(src.shape) * cast.of(key, u.dtype).itemsize
    total = sum(n for key, n in size_of.items() if key not in skipped)
    return {
        "metadata": {"total_size": total},
        "weight_map": {k: file_of[r] for k, r in sorted(writer_of.items())},
    }
