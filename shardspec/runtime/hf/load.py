"""load_hf: each rank reads only its own shards' bytes, with no collective."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardspec.core.hfmap import (
    FP8_SAFETENSORS,
    SCALE_ITEMSIZE,
    BlockQuant,
    HFMap,
    Source,
    Split,
    dtype_kind,
    scale_format_hint,
    source_indices,
    strided_runs,
)
from shardspec.runtime.canonical import Unit
from shardspec.runtime.hf.common import (
    PROGRESS_BYTES,
    GlobalUnit,
    HFError,
    HFLoadReport,
    hf_mesh_and_rank,
    model_view,
    open_file,
    raise_problems,
    resolve_sources,
    weight_map_of,
)
from shardspec.runtime.hf.fp8 import DequantSlice
from shardspec.runtime.spec import CompiledSpec
from shardspec.runtime.units import (
    unit_commit,
)

# ---------------------------------------------------------------------------------- load


def _read_runs(
    sl: Any, dim_runs: list[list[tuple[int, int, int]]], d: int, prefix: tuple
) -> torch.Tensor:
    """Every combination of the per-dim (strided) runs, read and concatenated in order.
    (Module level: a closure naming itself would be a reference cycle holding the slice,
    and the file's memory map, until the next garbage collection.)"""
    if d == len(dim_runs):
        return sl[prefix]
    parts = [
        _read_runs(sl, dim_runs, d + 1, (*prefix, slice(a, b, step))) for a, b, step in dim_runs[d]
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)


def _read_box(
    handle: Any,
    key: str,
    transforms: Sequence,
    offsets: Sequence[int],
    sizes: Sequence[int],
    split: Split | None = None,
    sl: Any = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's box ``offsets``/``sizes`` of the tensor that HF key ``key`` maps to (of
    its part ``split``), read with safetensors slicing (only the box's bytes; a grouped
    part's strided indices as strided slices); ``sl``: the slice to read instead of the
    file's own (an FP8 tensor's :class:`~shardspec.runtime.hf.fp8.DequantSlice`), and
    ``into`` the tensor it reads into where the box is one slice in the model's order
    (the result is then ``into`` itself)."""
    per_dim, model_dim_of = source_indices(transforms, offsets, sizes, split)
    sl = handle.get_slice(key) if sl is None else sl
    if not per_dim:
        return handle.get_tensor(key)
    dim_runs = [strided_runs(idx) for idx in per_dim]
    in_order = list(model_dim_of) == sorted(model_dim_of) and all(map(_ascending, per_dim))
    if into is not None and in_order and all(len(r) == 1 for r in dim_runs):
        sl.into = into

    if any(not r for r in dim_runs):
        shape = [len(i) for i in per_dim]
        t = torch.empty(shape, dtype=sl[tuple(slice(0, 0) for _ in per_dim)].dtype)
    else:
        t = _read_runs(sl, dim_runs, 0, ())
    for d, idx in enumerate(per_dim):
        if _ascending(idx):
            continue  # the runs hold the indices in order
        # Positions of the requested indices inside the concatenated runs.
        pos: dict[int, int] = {}
        for a, b, step in dim_runs[d]:
            for i in range(a, b, step):
                pos[i] = len(pos)
        t = t.index_select(d, torch.tensor([pos[i] for i in idx], dtype=torch.long))
    order = [model_dim_of.index(d) for d in range(len(model_dim_of))]
    return t.permute(order) if order != list(range(len(order))) else t


def _ascending(idx: Any) -> bool:
    return isinstance(idx, range) or all(a < b for a, b in itertools.pairwise(idx))


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
    # needed key -> (the unit it fills, the map line's index, the unit's dtype)
    unit_of: dict[str, tuple[str, int, torch.dtype]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # missing and unexpected keys


@dataclass(frozen=True)
class _Box:
    """One slice read: the box ``offsets``/``sizes`` (in the model's coordinates) of the
    tensor that the Hugging Face key ``key`` maps to."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    quant: BlockQuant | None = None  # block-scaled FP8 in the file: dequantized as read


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
    other_dtypes: bool = False,
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

    Each file's dtype must be the one the spec's HF manifest recorded for the key (the map
    line's ``dtypes``; a relabelled header, F32 bytes called I32, is refused), unless
    ``other_dtypes`` accepts another dtype of the same kind (a bf16 copy of an fp32
    checkpoint). Integer or bool data into a floating parameter, or the reverse, is
    refused whatever the options: a cast between kinds is never a load.
    """
    path = os.fspath(path)
    lm, rank = hf_mesh_and_rank(spec, mesh, "load_hf")
    m = model_view(spec, lm, rank, model, saving=False)
    sources, problems = resolve_sources(hfmap, m.units, strict)
    handles: dict[str, Any] = {}
    weight_map, file_problems = weight_map_of(path, handles)
    keys = _needed_keys(hfmap, sources, weight_map, m.units)
    raise_problems(problems + file_problems + keys.problems, path)

    ckpt = _Checkpoint(path, weight_map, handles)
    report = HFLoadReport()
    _open_files(ckpt, report)
    problems, hints = _tensor_problems(ckpt, keys, hfmap, other_dtypes)
    raise_problems(problems, path, hints)
    reads = _rank_reads(m.local, sources, keys.read_from, hfmap)
    _place(_stage(ckpt, reads, report, _progress(_nbytes(reads), progress, rank)))
    return report


def _needed_keys(
    hfmap: HFMap,
    sources: Mapping[str, Source],
    weight_map: Mapping[str, str],
    units: Mapping[str, GlobalUnit],
) -> _Keys:
    """Which key each needed Hugging Face key is read from, the shape it must have, the
    unit it fills, and the index's missing and unexpected keys."""
    out = _Keys()
    for name, src in sources.items():
        for key in src.keys:
            out.expected[key] = src.shape
            out.unit_of[key] = (name, src.rule, units[name].dtype)
            if key in weight_map:
                out.read_from[key] = key
            elif (tied := hfmap.tie_of(key)) is not None and tied in weight_map:
                out.read_from[key] = tied
            else:
                out.problems.append(f"{key}: missing from the checkpoint (needed for {name})")
    aliases = {a for a, _ in hfmap.ties}
    for key in sorted(weight_map):
        if (
            key not in out.expected
            and key not in aliases
            and not hfmap.dropped(key)
            and not hfmap.is_scale(key)
        ):
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
            open_file(ckpt.path, rel, ckpt.handles)
        except HFError as e:
            bad_files.append(str(e))
    report.files_opened = {rel: 1 for rel in ckpt.handles}
    raise_problems(bad_files, ckpt.path)


def _tensor_problems(
    ckpt: _Checkpoint, keys: _Keys, hfmap: HFMap, other_dtypes: bool
) -> tuple[list[str], list[str]]:
    """Every needed key's presence, shape and dtype in the file the index puts it in; and
    a hint per kind of dtype problem found."""
    file_keys = {rel: set(h.keys()) for rel, h in ckpt.handles.items()}
    problems = []
    hints: dict[str, None] = {}
    for key, source_key in sorted(keys.read_from.items()):
        rel = ckpt.weight_map[source_key]
        if source_key not in file_keys[rel]:
            problems.append(f"{source_key}: the index puts it in {rel}, which does not hold it")
            continue
        sl = ckpt.handles[rel].get_slice(source_key)
        got = tuple(sl.get_shape())
        if got != keys.expected[key]:
            problems.append(
                f"{source_key}: shape {list(got)} in {rel}, the mapping expects "
                f"{list(keys.expected[key])}"
            )
        name, rule, dtype = keys.unit_of[key]
        bq = hfmap.quant_of(source_key)
        if bq is not None:
            problems += _quant_problems(ckpt, file_keys, source_key, got, sl.get_dtype(), bq)
            if not dtype.is_floating_point:
                problems.append(f"{source_key}: FP8 data for a {dtype} tensor ({name})")
            continue
        found = _dtype_problem(sl.get_dtype(), dtype, hfmap.rules[rule], other_dtypes)
        if sl.get_dtype() in FP8_SAFETENSORS.values():
            found = f"the file stores {sl.get_dtype()}, which no fp8 line declares", _UNSCALED
        if found is not None:
            problems.append(f"{source_key}: {found[0]} (in {rel}, for {name})")
            hints[found[1]] = None
    return problems, list(hints)


def _quant_problems(
    ckpt: _Checkpoint,
    file_keys: Mapping[str, set[str]],
    key: str,
    shape: tuple[int, ...],
    got: str,
    bq: BlockQuant,
) -> list[str]:
    """A block-scaled FP8 key's problems: its dtype is the declared FP8 dtype, and its
    scale is in the checkpoint with the shape and a dtype of its format (its values are
    checked where a rank reads them)."""
    out = []
    want = FP8_SAFETENSORS[bq.dtype]
    if got != want:
        out.append(
            f"{key}: the file stores {got}, the hf block declares it {bq.dtype} ({want}) "
            f"stored block-scaled (line {bq.line}: {bq})"
        )
    skey = bq.scale_key(key)
    rel = ckpt.weight_map.get(skey)
    if rel is None or skey not in file_keys[rel]:
        where = "from the checkpoint" if rel is None else f"from {rel}, where the index puts it"
        return [*out, f"{skey}: missing {where} (the scale of {key}, line {bq.line}: {bq})"]
    ssl = ckpt.handles[rel].get_slice(skey)
    sshape, sdtype = tuple(ssl.get_shape()), ssl.get_dtype()
    if len(shape) < 2 or sshape != bq.scale_shape(shape):
        blocks = f"{bq.block[0]} x {bq.block[1]}"
        want_shape = list(bq.scale_shape(shape)) if len(shape) >= 2 else "none (not 2-D)"
        out.append(
            f"{skey}: shape {list(sshape)}, the scale of {key} {list(shape)} in blocks of "
            f"{blocks} has shape {want_shape}"
        )
    if sdtype not in bq.scale_dtypes:
        out.append(
            f"{skey}: the file stores {sdtype}, a {bq.scale_format} scale is "
            f"{' or '.join(bq.scale_dtypes)}{scale_format_hint(sdtype)}"
        )
    return out


_CROSS_KIND = (
    "load_hf never casts between integer, bool and floating data: the header may have been "
    "relabelled (F32 bytes called I32), or the checkpoint needs a conversion of its own "
    "(a quantized one)"
)
_UNSCALED = (
    "FP8 weights are stored with block scales (DeepSeek-V3's weight_scale_inv): cast "
    "without them, their values are wrong. Declare them in the hf block (fp8 GLOB scale "
    "{key}_scale_inv block 128 x 128), and load_hf dequantizes them"
)
_NOT_MANIFEST = (
    "A dtype other than the HF manifest's: a relabelled header, or another checkpoint than "
    "the one the HF manifest describes. Rebuild the HF manifest from this checkpoint "
    "(shardspec hf-manifest DIR -o FILE) and recompile the spec, or pass "
    "other_dtypes=True to cast it to the model's dtypes"
)


def _dtype_problem(
    got: str, dtype: torch.dtype, rule: Any, other_dtypes: bool
) -> tuple[str, str] | None:
    """Why a file tensor of safetensors dtype ``got`` may not fill a tensor of ``dtype``
    through map line ``rule``, and the hint for that kind of problem; or None."""
    kind, want = dtype_kind(got), dtype_kind(str(dtype))
    if kind != want:
        shown = str(dtype).removeprefix("torch.")
        return f"the file stores {got} ({kind or 'unknown'} values) for a {shown} tensor", (
            _CROSS_KIND
        )
    if rule.dtypes and got not in rule.dtypes and not other_dtypes:
        said = " or ".join(rule.dtypes)
        return (
            f"the file stores {got}, the spec's HF manifest says {said} (line {rule.line})",
            _NOT_MANIFEST,
        )
    return None


def _rank_reads(
    local: Mapping[str, tuple[Unit, torch.Tensor]],
    sources: Mapping[str, Source],
    read_from: Mapping[str, str],
    hfmap: HFMap,
) -> list[_UnitRead]:
    """The slices that fill this rank's (non-empty, mapped) storage-unit chunks."""
    out = []

    def box(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> _Box:
        key = read_from[key]
        return _Box(key, offsets, sizes, hfmap.quant_of(key))

    for unit, tensor in local.values():
        src = sources.get(unit.key)
        if src is None or unit.empty:
            continue
        if src.stacked:
            first, count = unit.offsets[0], unit.sizes[0]
            boxes = tuple(
                box(src.keys[e], unit.offsets[1:], unit.sizes[1:])
                for e in range(first, first + count)
            )
        else:
            boxes = (box(src.keys[0], unit.offsets, unit.sizes),)
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
            box, read, owned = _read_unit(ckpt, r)
            report.reads += len(r.boxes)
            report.bytes_read += read
            report.bytes_owned += owned
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


def _read_unit(ckpt: _Checkpoint, r: _UnitRead) -> tuple[torch.Tensor, int, int]:
    """One chunk's boxes, read (and stacked for a stacked source), with the bytes read
    and the bytes the chunk owns, in the files' dtypes (an FP8 box owns its FP8 bytes and
    its share of its tensor's scale bytes: the scale's element size per block of ``R x C``
    elements)."""
    src = r.source
    # a stacked source's boxes go straight into their slot of one buffer in the model's
    # dtype (no torch.stack of the parts, no second cast)
    stack = torch.empty(r.unit.sizes, dtype=r.tensor.dtype) if src.stacked else None
    parts, read, owned = [], 0, 0
    for i, b in enumerate(r.boxes):
        n = math.prod(b.sizes)
        into = None if stack is None else stack[i]
        if b.quant is None:
            part = _read_box(
                ckpt.handle(b.key), b.key, src.transforms, b.offsets, b.sizes, src.split
            )
            read += part.numel() * part.element_size()
            owned += part.numel() * part.element_size()  # real elements: padding owns none
        else:
            skey = b.quant.scale_key(b.key)
            scales = ckpt.handle(skey).get_slice(skey)
            sl = DequantSlice(
                ckpt.handle(b.key).get_slice(b.key),
                scales,
                b.quant,
                skey,
                r.tensor.dtype,  # dequantized straight into the model's dtype
            )
            part = _read_box(
                ckpt.handle(b.key), b.key, src.transforms, b.offsets, b.sizes, src.split, sl, into
            )
            read += sl.bytes_read
            itemsize = SCALE_ITEMSIZE[scales.get_dtype()]
            owned += n + n * itemsize // math.prod(b.quant.block)
        part = _zero_padded(part, b.sizes)
        if stack is None:
            parts.append(part)
        elif part is not into:  # not already read into its slot
            stack[i].copy_(part)
    return (parts[0] if stack is None else stack), read, owned


def _zero_padded(part: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """A box read through a ``pad`` (its real, leading part: see ``source_indices``) as the
    whole box, the padding zero-filled (as vLLM fills a padded vocabulary's rows)."""
    if tuple(part.shape) == tuple(sizes):
        return part
    out = part.new_zeros(tuple(sizes))
    out[tuple(slice(0, n) for n in part.shape)] = part
    return out


def _place(staged: Sequence[_Staged]) -> None:
    """Copy the staged chunks into the model."""
    with torch.no_grad():
        for s in staged:
            data = s.data.reshape(s.unit.sizes) if s.data.shape != s.unit.sizes else s.data
            unit_commit(s.unit, s.tensor, data)
