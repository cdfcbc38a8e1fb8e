"""Hugging Face name mapping: templates, transforms and slice arithmetic, in pure Python.

A spec's ``hf { ... }`` block says how a Hugging Face checkpoint's tensors map onto the
model's *storage units*: the same canonical names and shapes that checkpoints use
(``<fqn>`` for a plain parameter, ``<fqn>.<component>`` for a component of a fused
dimension, the global expert index for a name-indexed module). A rule reads::

    model.layers.{i}.self_attn.q_proj.weight -> layers.{i}.attention.wqkv.weight.q rope 16
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight -> layers.{i}.moe.experts.w1[e]

``{name}`` captures one dot-free segment; both sides use the same captures (so the mapping
inverts). ``[e]`` stacks: the HF tensor is index ``e`` of the unit's first dimension.
A target that names a parameter with a fused dimension (no component suffix) *splits*:
the HF tensor is that parameter's components one after another along the fused
dimension, in declared order, or in the order of an ``as`` list (``as k, q, v``, each
part with transforms of its own: ``as q rope 16, k rope 16, v``); export joins them.
A ``grouped`` split line says that the HF tensor stores the model's own grouped layout
(``fuse ffn as 32 groups of gate 1, up 1``): group after group, each group the parts'
rows of that group, so a component's rows are strided in the HF tensor (gpt-oss's
interleaved ``gate_up_proj``, Megatron's per-group q|k|v).
Transforms apply in the order written, from the HF tensor to the model's:

* ``transpose``: swap the two dimensions of a 2-D tensor;
* ``rope N``: the RoPE row permutation from Hugging Face's rotate-half layout to the
  Meta/torchtitan interleaved layout, per head of ``N`` rows, on dimension 0. Row
  ``h*N + 2j + t`` of the model's tensor is row ``h*N + t*N/2 + j`` of the HF tensor.
* ``pad D to M [x AXIS ...]``: dimension ``D`` grows from the HF tensor's ``size`` (the HF
  manifest's, recorded when the spec is compiled) to ``ceil(size / M') * M'``, ``M'`` the
  multiple times the named mesh axes' sizes (vLLM's vocabulary padded to 64; Megatron's to
  ``make_vocab_size_divisible_by x tp``). Index ``i < size`` is HF index ``i``; the
  indices from ``size`` on are padding, with no HF source: :func:`source_indices` leaves
  them out (they are the tail of the model's box along that dimension), load fills them
  with zeros and export writes only the real ones. Only ``transpose`` (or another ``pad``)
  may follow a ``pad``, so the padding stays a tail of the model's dimension.

The compiler (lint) and the runtime (``load_hf``/``export_hf``) both use this module, so
the names and slices they compute cannot disagree. No torch here.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter
from typing import NamedTuple

__all__ = [
    "Fused",
    "HFMap",
    "MapRule",
    "Part",
    "Source",
    "Split",
    "Transform",
    "dtype_kind",
    "fused_of",
    "hf_dim",
    "hf_shape",
    "model_indices",
    "padded_dims",
    "padded_size",
    "rope_row",
    "source_indices",
    "template_captures",
]

_CAPTURE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def template_captures(template: str) -> tuple[str, ...]:
    """The capture names of a template, in order of appearance."""
    return tuple(m.group(1) for m in _CAPTURE.finditer(template))


def _template_regex(template: str, numeric: frozenset[str] = frozenset()) -> re.Pattern[str]:
    out, last, seen = [], 0, set()
    for m in _CAPTURE.finditer(template):
        out.append(re.escape(template[last : m.start()]))
        name = m.group(1)
        if name in seen:
            out.append(f"(?P={name})")
        else:
            seen.add(name)
            out.append(f"(?P<{name}>{'[0-9]+' if name in numeric else '[^.]+'})")
        last = m.end()
    out.append(re.escape(template[last:]))
    return re.compile("".join(out) + r"\Z")


def _fill(template: str, values: dict[str, str]) -> str:
    def value(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in values:
            raise ValueError(
                f"{template}: capture {{{name}}} is not on the other side of the rule "
                "(lint reports this as SS070)"
            )
        return values[name]

    return _CAPTURE.sub(value, template)


def _glob_regex(glob: str) -> re.Pattern[str]:
    """``*`` one segment or part of one, ``**`` any number of segments (as in rules)."""
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**", i):
            out.append(r".*")
            i += 2
        elif glob[i] == "*":
            out.append(r"[^.]*")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _segment_key(positions: Sequence[int]) -> Callable[[Sequence[str]], object]:
    if not positions:
        return lambda segs: ()
    return itemgetter(*positions)


class _RuleIndex:
    """Which rules' templates can match a name, by the name's literal segments.

    A capture matches one dot-free segment or part of one, so a template with ``n`` dots
    matches only names with ``n`` dots, and each of its segments without a capture must
    equal the name's segment at that position. Rules are grouped by segment count and by
    the positions of their literal segments; a name then needs one dict lookup per group
    to find the rules whose literal segments all agree. The rules' regexes decide the
    rest (partial segments such as ``w{n}``, repeated captures), so the result is the same
    as trying every regex, only cheaper.
    """

    def __init__(self, templates: Sequence[str]) -> None:
        by_count: dict[int, dict[tuple[int, ...], dict[object, list[int]]]] = {}
        for i, template in enumerate(templates):
            segs = template.split(".")
            positions = tuple(k for k, seg in enumerate(segs) if not _CAPTURE.search(seg))
            key = _segment_key(positions)(segs)
            tables = by_count.setdefault(len(segs), {})
            tables.setdefault(positions, {}).setdefault(key, []).append(i)
        self._groups: dict[int, list[tuple[Callable[[Sequence[str]], object], dict]]] = {
            n: [(_segment_key(pos), table) for pos, table in tables.items()]
            for n, tables in by_count.items()
        }

    def candidates(self, name: str) -> list[int]:
        """Rule indices, ascending, whose literal segments agree with ``name``."""
        segs = name.split(".")
        groups = self._groups.get(len(segs))
        if not groups:
            return []
        if len(groups) == 1:
            key, table = groups[0]
            return table.get(key(segs), [])
        out: list[int] = []
        for key, table in groups:
            hit = table.get(key(segs))
            if hit:
                out += hit
        out.sort()
        return out


@dataclass(frozen=True)
class Transform:
    """One step from the HF tensor towards the model's: ``transpose``, ``rope`` or ``pad``.
    A ``pad`` grows dimension ``dim`` (of the tensor at its place in the chain) from the
    HF tensor's ``size`` to a multiple of ``multiple`` times the sizes of mesh axes
    ``axes``; only ``dim`` and ``size`` enter the index arithmetic (the multiple is what
    lint checks the model's size against)."""

    kind: str
    head_dim: int = 0  # rope only
    dim: int = 0  # pad only, with the fields below
    multiple: int = 0
    axes: tuple[str, ...] = ()
    size: int = 0  # the HF size along `dim`; 0: unknown (no HF manifest)

    def __str__(self) -> str:
        if self.kind == "pad":
            return f"pad {self.dim} to {' x '.join([str(self.multiple), *self.axes])}"
        return f"rope {self.head_dim}" if self.kind == "rope" else self.kind


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple`` (vLLM's ``pad_vocab_size``)."""
    return -(-size // multiple) * multiple if multiple > 0 else size


def padded_dims(ndim: int, transforms: Sequence[Transform]) -> list[tuple[int, Transform]]:
    """Each ``pad`` of the chain with the model dimension it pads (later transposes move
    it): ``(model dim, pad)``, in chain order."""
    out: list[tuple[int, Transform]] = []
    for i, t in enumerate(transforms):
        if t.kind == "pad":
            out.append((hf_dim(ndim, transforms[i + 1 :], t.dim), t))
    return out


@dataclass(frozen=True)
class Part:
    """One entry of a split line's ``as`` list: fused component ``name``, with transforms
    of its own, applied after the line's (``q rope 16``)."""

    name: str
    transforms: tuple[Transform, ...] = ()

    def __str__(self) -> str:
        return "".join([self.name, *(f" {t}" for t in self.transforms)])


@dataclass(frozen=True)
class MapRule:
    """``hf -> target[stack] transforms... [grouped] [as part, ...]``; ``line`` points back
    into the spec. ``parts`` is None without an ``as`` list; the target then names a unit,
    or a parameter with a fused dimension whose components all come from the HF tensor, in
    declared order. ``grouped``: the split HF tensor holds the parts group by group, as the
    model's fused dimension does (see :class:`Split`). ``dtypes``: the safetensors dtypes
    (``"F32"``) of the HF tensors the line reads, as the spec's HF manifest recorded them
    when the spec was compiled (empty without an HF manifest); load_hf checks the files
    against them."""

    hf: str
    target: str
    stack: str | None = None
    transforms: tuple[Transform, ...] = ()
    line: int = 0
    parts: tuple[Part, ...] | None = None
    grouped: bool = False
    dtypes: tuple[str, ...] = ()

    @cached_property
    def target_regex(self) -> re.Pattern[str]:
        return _template_regex(self.target)

    @cached_property
    def hf_regex(self) -> re.Pattern[str]:
        numeric = frozenset((self.stack,)) if self.stack else frozenset()
        return _template_regex(self.hf, numeric)

    def __str__(self) -> str:
        stack = f"[{self.stack}]" if self.stack else ""
        tail = "".join(f" {t}" for t in self.transforms)
        grouped = " grouped" if self.grouped else ""
        parts = "" if self.parts is None else " as " + ", ".join(map(str, self.parts))
        return f"{self.hf} -> {self.target}{stack}{tail}{grouped}{parts}"


@dataclass(frozen=True)
class Split:
    """Where a split line's unit lies in its HF tensor, along HF dimension ``dim`` (of each
    stacked slice): the unit has ``size`` indices there, ``total`` is that dimension's size
    (every part). The dimension is ``groups`` blocks of ``total // groups`` indices, and in
    each block the unit's ``size // groups`` indices start at ``start`` (one block, the
    whole dimension, unless the line is ``grouped``): the unit's index ``i`` is the HF
    index :meth:`hf_index` gives."""

    dim: int
    start: int
    size: int
    total: int
    groups: int = 1

    def hf_index(self, i: int) -> int:
        """The HF index (along ``dim``) of the unit's index ``i``."""
        if self.groups == 1:
            return self.start + i
        g, j = divmod(i, self.size // self.groups)
        return g * (self.total // self.groups) + self.start + j


class Fused(NamedTuple):
    """A fused dimension, as the split lines need it: its position in the unit's shape,
    the components in declared order with their global sizes (all groups), and the number
    of groups."""

    at: int
    components: tuple[tuple[str, int], ...]
    groups: int = 1


@dataclass(frozen=True)
class Source:
    """Where one storage unit comes from: one HF tensor, or one per index of a stack; with
    ``split``, a part of it."""

    rule: int  # index into HFMap.rules
    keys: tuple[str, ...]  # one key, or one per index of the stacked first dimension
    shape: tuple[int, ...]  # each HF tensor's shape (the whole tensor for a split)
    stacked: bool
    transforms: tuple[Transform, ...] = ()  # from the HF part to the unit (or its slice)
    split: Split | None = None


def fused_of(dims: Sequence) -> Fused | None:
    """The fused dimension of a parameter's layout dims (``layout.dims``), positioned in
    its storage units' shape (name-indexed dims are not in it), or None."""
    at = 0
    for d in dims:
        if d.name_indexed:
            continue
        if d.fusion is not None:
            comps = tuple((name, size * d.fusion.groups) for name, size in d.fusion.components)
            return Fused(at, comps, d.fusion.groups)
        at += 1
    return None


def hf_dim(ndim: int, transforms: Sequence[Transform], dim: int) -> int:
    """The HF dimension that the model's dimension ``dim`` comes from (transposes move it)."""
    for t in transforms:
        if t.kind == "transpose" and ndim == 2:
            dim = 1 - dim
    return dim


def hf_shape(model_shape: Sequence[int], transforms: Sequence[Transform]) -> tuple[int, ...]:
    """The HF tensor's shape for a model tensor of ``model_shape`` (inverting the chain)."""
    shape = tuple(model_shape)
    for t in reversed(transforms):
        if t.kind == "transpose":
            shape = shape[::-1]
        elif t.kind == "pad" and t.dim < len(shape):
            shape = (*shape[: t.dim], t.size, *shape[t.dim + 1 :])
    return shape


def transform_problem(model_shape: Sequence[int], transforms: Sequence[Transform]) -> str | None:
    """Why the chain cannot apply (and so cannot be inverted) on this shape, or None."""
    shape = hf_shape(model_shape, transforms)
    for i, t in enumerate(transforms):
        if t.kind == "transpose":
            if len(shape) != 2:
                return f"transpose needs a 2-D tensor, this one has shape {list(shape)}"
            shape = shape[::-1]
        elif t.kind == "pad":
            if t.dim >= len(shape):
                return f"{t}: the tensor has {len(shape)} dimensions, shape {list(shape)}"
            later = model_shape[hf_dim(len(shape), transforms[i + 1 :], t.dim)]
            shape = (*shape[: t.dim], later, *shape[t.dim + 1 :])
        elif t.kind == "rope":
            if t.head_dim < 2 or t.head_dim % 2:
                return f"rope needs an even head size, got {t.head_dim}"
            if not shape or shape[0] % t.head_dim:
                return (
                    f"rope {t.head_dim}: dimension 0 has {shape[0] if shape else 0} rows, "
                    f"not a whole number of heads of {t.head_dim}"
                )
        else:
            return f"unknown transform {t.kind!r}"
    return None


def rope_row(m: int, head_dim: int) -> int:
    """The HF row (rotate-half layout) that holds the model's row ``m`` (interleaved)."""
    h, w = divmod(m, head_dim)
    j, t = divmod(w, 2)
    return h * head_dim + t * (head_dim // 2) + j


def _model_row(r: int, head_dim: int) -> int:
    h, w = divmod(r, head_dim)
    t, j = divmod(w, head_dim // 2)
    return h * head_dim + 2 * j + t


Index = range | tuple[int, ...]


def source_indices(
    transforms: Sequence[Transform],
    offsets: Sequence[int],
    sizes: Sequence[int],
    split: Split | None = None,
) -> tuple[tuple[Index, ...], tuple[int, ...]]:
    """Which HF indices a box of the model's tensor needs.

    Returns ``(per_hf_dim, model_dim_of)``: for each HF dimension, the HF indices listed in
    the order of the model box's positions along model dimension ``model_dim_of[k]``. The
    box is then ``hf[ix_(*per_hf_dim)]`` with its dimensions permuted so that HF dimension
    ``k`` lands on ``model_dim_of[k]``. With ``split``, the unit is the part of the HF
    tensor from ``split.start`` along ``split.dim``. A ``pad`` leaves out the box's
    padding indices, which have no HF source: the indices then fill the *leading* part of
    the box along that dimension (the padding is its tail), and the rest is padding.
    """
    cur: list[tuple[int, Index]] = [
        (d, range(o, o + s)) for d, (o, s) in enumerate(zip(offsets, sizes, strict=True))
    ]
    for t in reversed(transforms):
        if t.kind == "transpose":
            cur.reverse()
        elif t.kind == "rope":
            d, idx = cur[0]
            cur[0] = (d, tuple(rope_row(m, t.head_dim) for m in idx))
        elif t.kind == "pad":
            d, idx = cur[t.dim]
            cur[t.dim] = (d, _unpadded(idx, t.size))
    if split is not None and (split.start or split.groups > 1):
        d, idx = cur[split.dim]
        cur[split.dim] = (d, _in_split(idx, split))
    return tuple(i for _, i in cur), tuple(d for d, _ in cur)


def _unpadded(idx: Index, size: int) -> Index:
    """The indices of ``idx`` below ``size`` (a pad's real ones; a range stays one)."""
    if isinstance(idx, range):
        return range(min(idx.start, size), min(idx.stop, size))
    return tuple(i for i in idx if i < size)


def _in_split(idx: Index, split: Split) -> Index:
    """The HF indices of the unit's indices ``idx`` (a range stays a range where it can)."""
    if isinstance(idx, range) and split.groups == 1:
        return range(idx.start + split.start, idx.stop + split.start)
    if isinstance(idx, range) and len(idx) and split.size:
        per = split.size // split.groups
        if idx.start // per == (idx.stop - 1) // per:  # within one group
            first = split.hf_index(idx.start)
            return range(first, first + len(idx))
    return tuple(split.hf_index(i) for i in idx)


def model_indices(
    transforms: Sequence[Transform], shape: Sequence[int]
) -> tuple[tuple[Index, ...], tuple[int, ...]]:
    """For export: the same as :func:`source_indices` for the whole model tensor, but
    from the HF side: which model index fills each HF position, per model dimension.

    Returns ``(per_model_dim, hf_dim_of)``: ``model[ix_(*per_model_dim)]`` permuted so
    that model dimension ``k`` lands on ``hf_dim_of[k]`` is the HF tensor (a padded
    dimension's indices are its real ones, ``range(size)``: the padding is not exported).
    """
    hshape = hf_shape(shape, transforms)
    # Walk forward from HF positions: position p of HF dim k reads model index f(p).
    cur: list[tuple[int, Index]] = [(k, range(n)) for k, n in enumerate(hshape)]
    for t in transforms:
        if t.kind == "transpose":
            cur.reverse()
        elif t.kind == "rope":
            k, idx = cur[0]
            cur[0] = (k, tuple(_model_row(r, t.head_dim) for r in idx))
    return tuple(i for _, i in cur), tuple(k for k, _ in cur)


def runs(idx: Index) -> list[tuple[int, int]]:
    """``[start, stop)`` runs covering the sorted, distinct indices of ``idx``."""
    if isinstance(idx, range):
        return [(idx.start, idx.stop)] if len(idx) else []
    out: list[tuple[int, int]] = []
    for i in sorted(set(idx)):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def strided_runs(idx: Index) -> list[tuple[int, int, int]]:
    """``(start, stop, step)`` slices covering the sorted, distinct indices of ``idx``
    exactly: the :func:`runs`, with consecutive single indices an equal step apart read
    as one strided slice (gate/up interleaved: every second column is one slice, not one
    slice per column)."""
    out: list[tuple[int, int, int]] = []
    for a, b in runs(idx):
        if b - a == 1 and out:
            start, stop, step = out[-1]
            count = len(range(start, stop, step))
            last = start + (count - 1) * step
            if count == 1 or (step > 1 and a - last == step):
                out[-1] = (start, a + 1, a - last if count == 1 else step)
                continue
        out.append((a, b, 1))
    return out


def dtype_kind(name: str) -> str | None:
    """``"float"``, ``"int"``, ``"bool"`` or ``"complex"`` for a safetensors dtype name
    (``"F32"``, ``"BF16"``, ``"I64"``, ``"U8"``, ``"BOOL"``, ``"F8_E4M3"``) or a torch dtype
    name (``"float32"``, ``"torch.bfloat16"``, ``"int64"``); None for a name that is
    neither. Load never casts between kinds: integers are no floats' bit patterns."""
    if name in _SAFETENSORS_KINDS:
        return _SAFETENSORS_KINDS[name]
    name = name.removeprefix("torch.")
    for kind, pattern in _TORCH_KINDS:
        if pattern.fullmatch(name):
            return kind
    return None


_SAFETENSORS_KINDS = {
    "BOOL": "bool",
    **dict.fromkeys(("U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"), "int"),
    **dict.fromkeys(("F4", "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3", "F8_E8M0"), "float"),
    **dict.fromkeys(("F16", "BF16", "F32", "F64"), "float"),
    "C64": "complex",
}
_TORCH_KINDS = (
    ("float", re.compile(r"b?float[0-9]+(?:_[a-z0-9]+)*|half|double|float")),
    ("int", re.compile(r"u?int[0-9]*|long|short")),
    ("bool", re.compile(r"bool")),
    ("complex", re.compile(r"complex[0-9]+|c(?:half|float|double)")),
)


FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}  # the largest finite value
# An fp8 line's scale formats: the scale's dtype as stored (``float32``, DeepSeek's;
# ``bfloat16``, Qwen3's FP8 releases'; ``float16``), or ``ue8m0`` (powers of two).
SCALE_FORMATS = ("float32", "bfloat16", "float16", "ue8m0")
# The safetensors dtype of each FP8 dtype, and the safetensors dtypes a scale may be stored
# in, per scale format (the first: the one export writes): one table for lint
# (checks/fp8.py), load_hf and export_hf (runtime/hf/).
FP8_SAFETENSORS = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
SCALE_DTYPES = {
    "float32": ("F32",),
    "bfloat16": ("BF16",),
    "float16": ("F16",),
    "ue8m0": ("F32", "F8_E8M0"),
}
# The bytes per element of each safetensors dtype a scale may be stored in.
SCALE_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E8M0": 1}


def scale_format_hint(stored: str) -> str:
    """For a scale stored as safetensors dtype ``stored`` that its line refuses: the fp8
    line's word that reads it (``; write `bfloat16` on the fp8 line``), or ``""``."""
    for fmt, dtypes in SCALE_DTYPES.items():
        if stored in dtypes:
            return f"; write `{fmt}` on the fp8 line for {stored} scales"
    return ""


@dataclass(frozen=True)
class BlockQuant:
    """An ``hf`` block's block-scaled FP8 declaration (DeepSeek-V3's format): every HF
    key matching ``glob`` (``drop``'s glob syntax) is stored as
    ``dtype`` with a dequantization scale per ``block`` of its last two dimensions (a 3-D
    tensor ``[E, R, C]`` has one per expert), in the HF tensor named ``scale`` with ``{key}``
    replaced by the weight's key: ``w[r, c] = float32(q[r, c]) * scale[r // R, c // C]``,
    the scale's shape ``(..., ceil(rows / R), ceil(cols / C))``. ``scale_format``:
    ``float32`` (the inverse scale as float32, DeepSeek's ``weight_scale_inv``),
    ``bfloat16`` or ``float16`` (the inverse scale stored in that dtype, as Qwen3's FP8
    releases store it; dequantized in float32 all the same) or ``ue8m0`` (a power of two,
    stored as float32 or as ``float8_e8m0fnu``). Export quantizes each block with scale
    ``amax / FP8_MAX[dtype]`` rounded to the scale's dtype (up to a power of two for
    ``ue8m0``). ``line``: back into the spec."""

    glob: str
    scale: str = "{key}_scale_inv"
    block: tuple[int, int] = (128, 128)
    scale_format: str = "float32"
    dtype: str = "float8_e4m3fn"
    line: int = 0

    @cached_property
    def regex(self) -> re.Pattern[str]:
        return _glob_regex(self.glob)

    def scale_key(self, hf_key: str) -> str:
        return self.scale.replace("{key}", hf_key)

    @property
    def scale_dtypes(self) -> tuple[str, ...]:
        """The safetensors dtypes this declaration's scales may be stored in (the first:
        the one export writes)."""
        return SCALE_DTYPES.get(self.scale_format, ("F32",))

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The scale tensor's shape for a weight of ``shape`` (2-D, or stacked 3-D)."""
        *lead, rows, cols = shape
        r, c = self.block
        return (*lead, -(-rows // r), -(-cols // c))

    def __str__(self) -> str:
        b = f" block {self.block[0]} x {self.block[1]}"
        fmt = "" if self.scale_format == "float32" else f" {self.scale_format}"
        kind = " e5m2" if self.dtype == "float8_e5m2" else ""
        return f"fp8 {self.glob} scale {self.scale}{b}{fmt}{kind}"


@dataclass(frozen=True)
class HFMap:
    """A spec's whole ``hf`` block."""

    rules: tuple[MapRule, ...] = ()
    drops: tuple[str, ...] = ()  # HF key globs that nothing consumes
    ties: tuple[tuple[str, str], ...] = ()  # (alias, source): alias is the same tensor
    keeps: tuple[str, ...] = ()  # storage-name globs the HF checkpoint does not provide
    quants: tuple[BlockQuant, ...] = ()  # block-scaled FP8 HF tensors (first match wins)

    def __bool__(self) -> bool:
        return bool(self.rules or self.drops or self.ties or self.keeps or self.quants)

    def quant_of(self, hf_key: str) -> BlockQuant | None:
        """The FP8 declaration of HF key ``hf_key`` (a weight, not its scale), if any."""
        for q in self.quants:
            if q.regex.match(hf_key):
                return q
        return None

    def is_scale(self, hf_key: str) -> bool:
        """Whether ``hf_key`` is the scale of a declared FP8 weight (consumed with it): the
        key that the template of line ``q`` makes from a weight whose declaration is ``q``
        (a weight an earlier line covers is that line's, whose template names its scale)."""
        for q in self.quants:
            head, sep, tail = q.scale.partition("{key}")
            if sep and hf_key.startswith(head) and hf_key.endswith(tail):
                weight = hf_key[len(head) : len(hf_key) - len(tail)]
                if weight and self.quant_of(weight) is q:
                    return True
        return False

    @cached_property
    def _drop_res(self) -> tuple[re.Pattern[str], ...]:
        return tuple(_glob_regex(g) for g in self.drops)

    @cached_property
    def _keep_res(self) -> tuple[re.Pattern[str], ...]:
        return tuple(_glob_regex(g) for g in self.keeps)

    @cached_property
    def _target_index(self) -> _RuleIndex:
        return _RuleIndex([r.target for r in self.rules])

    @cached_property
    def _hf_index(self) -> _RuleIndex:
        return _RuleIndex([r.hf for r in self.rules])

    def dropped(self, hf_key: str) -> bool:
        return any(r.match(hf_key) for r in self._drop_res)

    def kept(self, name: str) -> bool:
        return any(r.match(name) for r in self._keep_res)

    def tie_of(self, hf_key: str) -> str | None:
        """The key ``hf_key`` is an alias of, if a ``tie`` says so."""
        for alias, source in self.ties:
            if alias == hf_key:
                return source
        return None

    def sources(self, name: str, shape: Sequence[int], fused: Fused | None = None) -> list[Source]:
        """Every rule producing storage unit ``name`` (lint wants exactly one). ``fused``:
        the parameter's fused dimension when ``name`` is one of its components (``<fqn>.q``),
        so that a line whose target is ``<fqn>`` itself splits its HF tensor."""
        out = []
        rules = self.rules
        for i in self._target_index.candidates(name):
            rule = rules[i]
            if rule.parts is not None or rule.grouped:
                continue  # an `as` list or `grouped` needs a fused parameter (lint: SS081)
            m = rule.target_regex.match(name)
            if m is None:
                continue
            caps = m.groupdict()
            chain = rule.transforms
            if rule.stack:
                if not shape:
                    continue
                keys = tuple(_fill(rule.hf, {**caps, rule.stack: str(e)}) for e in range(shape[0]))
                out.append(Source(i, keys, hf_shape(shape[1:], chain), True, chain))
            else:
                out.append(Source(i, (_fill(rule.hf, caps),), hf_shape(shape, chain), False, chain))
        if fused is not None and "." in name:
            out += self._split_sources(name, shape, fused)
            out.sort(key=lambda src: src.rule)
        return out

    def _split_sources(self, name: str, shape: Sequence[int], fused: Fused) -> list[Source]:
        base, _, comp = name.rpartition(".")
        at, comps = fused.at, fused.components
        out = []
        for i in self._target_index.candidates(base):
            rule = self.rules[i]
            m = rule.target_regex.match(base)
            if m is None:
                continue
            parts = rule.parts or tuple(Part(c) for c, _ in comps)
            order = [p.name for p in parts]
            if comp not in order:
                continue
            # A part that is no component counts 0 (lint reports it, SS081; the runtime
            # refuses it).
            sizes = dict(comps)
            sizes = {p: sizes.get(p, 0) for p in order}
            part = parts[order.index(comp)]
            chain = rule.transforms + part.transforms
            caps = m.groupdict()
            sub = tuple(shape[1:]) if rule.stack else tuple(shape)
            d = at - 1 if rule.stack else at
            if d < 0 or (rule.stack and not shape):
                continue  # the stack index cannot be the fused dimension (lint: SS081)
            k = hf_dim(len(sub), chain, d)
            hshape = list(hf_shape(sub, chain))
            # Grouped: each group's block holds every part's rows of that group.
            groups = fused.groups if rule.grouped else 1
            start = sum(sizes[p] // groups for p in order[: order.index(comp)])
            size = hshape[k]
            hshape[k] = sum(sizes[p] for p in order)
            split = Split(k, start, size, hshape[k], groups)
            if rule.stack:
                keys = tuple(_fill(rule.hf, {**caps, rule.stack: str(e)}) for e in range(shape[0]))
            else:
                keys = (_fill(rule.hf, caps),)
            out.append(Source(i, keys, tuple(hshape), bool(rule.stack), chain, split))
        return out

    def consumers(self, hf_key: str) -> list[tuple[int, str, int | None]]:
        """Every rule whose HF template matches ``hf_key``: ``(rule, unit name, stack
        index)``; for a split line the name is the fused parameter's (its components are
        the units)."""
        out = []
        rules = self.rules
        for i in self._hf_index.candidates(hf_key):
            rule = rules[i]
            m = rule.hf_regex.match(hf_key)
            if m is None:
                continue
            caps = m.groupdict()
            index = int(caps.pop(rule.stack)) if rule.stack else None
            out.append((i, _fill(rule.target, caps), index))
        return out

    def problems(self) -> Iterable[tuple[int, str]]:
        """Rules that cannot be inverted whatever the shapes: ``(rule index, why)``."""
        for i, rule in enumerate(self.rules):
            hf_caps = set(template_captures(rule.hf))
            target_caps = set(template_captures(rule.target))
            if rule.stack:
                if rule.stack not in hf_caps:
                    yield (
                        i,
                        (
                            f"the stack index [{rule.stack}] is not a capture of the Hugging Face "
                            "name, so every index would read the same tensor"
                        ),
                    )
                if rule.stack in target_caps:
                    yield i, f"{{{rule.stack}}} is both a capture of the target and its stack index"
                target_caps.add(rule.stack)
            if hf_caps - target_caps:
                names = ", ".join(f"{{{c}}}" for c in sorted(hf_caps - target_caps))
                yield (
                    i,
                    f"{names} appears only on the Hugging Face side: export could not name the key",
                )
            if target_caps - hf_caps:
                names = ", ".join(f"{{{c}}}" for c in sorted(target_caps - hf_caps))
                yield i, f"{names} appears only on the model side: load could not name the key"
            parts = rule.parts or ()
            for t in (*rule.transforms, *(t for p in parts for t in p.transforms)):
                if t.kind == "rope" and (t.head_dim < 2 or t.head_dim % 2):
                    yield i, f"rope needs an even head size, got {t.head_dim}"
            yield from ((i, why) for why in _pad_problems(rule))
            part_names = [p.name for p in parts]
            for n in sorted({n for n in part_names if part_names.count(n) > 1}):
                yield i, f"component {n!r} is named twice in the `as` list"


def _pad_problems(rule: MapRule) -> Iterable[str]:
    """Why a map line's ``pad`` transforms cannot apply whatever the shapes."""
    chain = rule.transforms
    for i, t in enumerate(chain):
        if t.kind != "pad":
            continue
        if t.multiple < 1:
            yield f"`{t}`: the multiple must be at least 1"
        if any(u.kind == "rope" for u in chain[i + 1 :]):
            yield f"`{t}` comes before `rope`: write the pad last, after the rope"
        if rule.grouped or rule.parts is not None:
            yield f"`{t}` on a split line: pad a whole tensor, not a fused part"
    for p in rule.parts or ():
        for t in p.transforms:
            if t.kind == "pad":
                yield f"`{t}` in the `as` part {p.name!r}: pad a whole tensor, not a fused part"


def unit_names(
    fqn: str, dims: Sequence, name_indexed_spans: Sequence[tuple[int, int]]
) -> list[tuple[str, tuple[int, ...]]]:
    """The storage units of parameter ``fqn`` with layout dims ``dims`` (``layout.dims``):
    ``(name, shape)`` as checkpoints store them.

    ``name_indexed_spans`` are the positions in ``fqn`` of the captures behind its
    name-indexed dims, in dim order. A module indexed by a name capture stands for every
    global index of its dim (its rank's first index plus the local one), so the names cover
    them all.
    """
    shape: list[int] = []
    comps: list[tuple[str, int]] = []
    fused_at = -1
    for d in dims:
        if d.name_indexed:
            continue
        if d.fusion is not None:
            fused_at = len(shape)
            comps = [(name, size * d.fusion.groups) for name, size in d.fusion.components]
        shape.append(d.size)
    indexed = [d for d in dims if d.name_indexed]
    bases = [""]
    if indexed:
        spans = sorted(zip(name_indexed_spans, (d.size for d in indexed), strict=True))
        bases = []
        ranges = [range(n) for _, n in spans]
        for combo in itertools.product(*ranges):
            out, last = [], 0
            for ((s, e), _), g in zip(spans, combo, strict=True):
                out += [fqn[last:s], str(g)]
                last = e
            out.append(fqn[last:])
            bases.append("".join(out))
    else:
        bases = [fqn]
    result: list[tuple[str, tuple[int, ...]]] = []
    for base in bases:
        if comps:
            for name, size in comps:
                dims = list(shape)
                dims[fused_at] = size
                result.append((f"{base}.{name}", tuple(dims)))
        else:
            result.append((base, tuple(shape)))
    return result
