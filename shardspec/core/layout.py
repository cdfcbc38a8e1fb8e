"""Shard arithmetic: which part of each parameter every rank holds.

Pure Python with no imports beyond the standard library: the compiler uses it to check
a spec and print tables, and ``shardspec.runtime`` uses the very same functions at train
time. Nothing here knows about lark, pydantic or torch.

Vocabulary
----------
* A *dimension* of a parameter is sharded over zero or more mesh axes, listed **outer to
  inner**: the first axis cuts the coarsest blocks, each later axis cuts the block its rank
  already holds. This is the *physical* layout: what FSDP2-over-TP or a module that holds a
  Megatron-style local shard really keeps in memory.
* A *fused* dimension is made of named components (gate/up, q/k/v). Its first axis splits
  every component separately, so each rank holds its slice of each component. With
  ``groups`` the components repeat per group (Megatron GQA layout) and the first axis
  splits whole groups instead.
* A *local* axis is one whose shard the module already holds (it was built with local
  shapes). The DTensor then only spans the remaining axes. Local axes must come first in
  a dimension's order, since the module holds a whole block of them.
* A *name-indexed* dimension does not exist in the module's tensor: it is indexed by a capture
  in the parameter's name (``local_experts.{expert}``) and only sharded by local axes.

Index sets are tuples of half-open ``(start, stop)`` ranges in increasing order. Sizes follow
``torch.chunk``: chunk size ``ceil(n / k)``, trailing chunks may be short or empty.

``torch_placement_indices`` simulates DTensor's own left-to-right interpretation of
``Shard``/``_StridedShard`` placements exactly, so the two views can be compared; a layout is
representable as a DTensor only when they agree on every rank.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import lru_cache

Ranges = tuple[tuple[int, int], ...]


class LayoutProblem(Enum):
    """What is wrong with a layout. The compiler reports each problem under a check code of
    its own (``shardspec.checks.layouts.LAYOUT_CODES``); the runtime raises the error."""

    MESH_SIZES = "mesh-sizes"  # the mesh's sizes do not multiply to the world size
    DIM_COUNT = "dim-count"  # a rule names another number of dimensions than the tensor has
    UNKNOWN_DIM = "unknown-dim"  # a shard statement names no dimension of the rule
    UNKNOWN_AXIS = "unknown-axis"  # a shard statement names no axis of the mesh
    AXIS_REUSED = "axis-reused"  # one axis shards two dimensions
    LOCAL_AFTER_NONLOCAL = "local-after-nonlocal"  # a local axis inside a non-local one
    NAME_INDEXED_NONLOCAL = "name-indexed-nonlocal"  # a name-indexed dim over a non-local axis
    GROUP_COUNT = "group-count"  # a fusion's group count below 1
    COMPONENT_SIZES = "component-sizes"  # a fusion's components do not fill its dimension
    COMPONENT_SPLIT = "component-split"  # components or groups do not divide over the axis


class LayoutError(ValueError):
    """A layout that cannot be realised: ``problem`` says what went wrong (``None``: a
    problem of another kind, e.g. the runtime's :class:`SpecError` about a model), ``hint``
    how to fix it."""

    def __init__(self, message: str, problem: LayoutProblem | None = None, hint: str = "") -> None:
        super().__init__(message)
        self.problem, self.hint = problem, hint


# --------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class Fusion:
    """Named components of one dimension, in storage order."""

    components: tuple[tuple[str, int], ...]  # (name, size); per group when groups > 1
    groups: int = 1  # > 1: the component block repeats once per group (GQA layout)
    # (name, head size) of components whose heads are replicated when the first axis has
    # more ranks than the component has heads (vLLM's QKVParallelLinear KV heads).
    replicated: tuple[tuple[str, int], ...] = ()
    # `squeezed`: each component is one index of the dimension, which a checkpoint stores
    # without that dimension (torchtitan's FusedSwiGLU `w13`); never sharded.
    squeezed: bool = False

    @property
    def group_size(self) -> int:
        return sum(size for _, size in self.components)

    @property
    def size(self) -> int:
        return self.group_size * self.groups

    def component_ranges(self, name: str) -> Ranges:
        """Where component ``name`` lies in the fused dimension, for every group."""
        start = 0
        for comp, size in self.components:
            if comp == name:
                break
            start += size
        else:  # pragma: no cover - callers pass known names
            raise KeyError(name)
        gs = self.group_size
        return tuple((g * gs + start, g * gs + start + size) for g in range(self.groups))


@dataclass(frozen=True)
class Dim:
    """One named dimension of a parameter's global (logical) shape."""

    name: str
    size: int
    axes: tuple[str, ...] = ()  # outer -> inner
    fusion: Fusion | None = None
    name_indexed: bool = False  # indexed by a name capture, absent from the module tensor


@dataclass(frozen=True)
class ParamLayout:
    """The declared layout of one parameter."""

    dims: tuple[Dim, ...]
    local: frozenset[str] = field(default_factory=frozenset)
    # Per dim, axes that only checkpoints split further (outer to inner), inside each
    # rank's runtime block: the parameter is replicated over them at run time.
    ckpt: tuple[tuple[str, ...], ...] = ()
    # Pipeline parallelism: the stage axis, and the stages (coordinates on it) whose ranks
    # hold the parameter. Other ranks hold none of it; its DTensor spans the other axes.
    stage_axis: str | None = None
    stages: tuple[int, ...] = ()

    def on_stage(self, mesh: Mesh, coord: Sequence[int]) -> bool:
        """Whether the rank at ``coord`` holds (part of) this parameter's stage."""
        if self.stage_axis is None:
            return True
        return coord[mesh.names.index(self.stage_axis)] in self.stages

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d.axes)

    def dim_index(self, name: str) -> int:
        for i, d in enumerate(self.dims):
            if d.name == name:
                return i
        raise KeyError(name)

    def tensor_dims(self) -> tuple[Dim, ...]:
        """The dimensions the module's tensor really has (name-indexed ones removed)."""
        return tuple(d for d in self.dims if not d.name_indexed)


@dataclass(frozen=True)
class Mesh:
    """Axis names outer to inner, with their sizes."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        return self.sizes[self.names.index(axis)]

    def coords(self) -> Iterable[tuple[int, ...]]:
        """Every rank's coordinate, in rank order (row-major, like ``init_device_mesh``)."""
        return itertools.product(*(range(s) for s in self.sizes))

    def coord_of(self, rank: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.sizes):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank_of(self, coord: Sequence[int]) -> int:
        rank = 0
        for c, s in zip(coord, self.sizes, strict=True):
            rank = rank * s + c
        return rank

    def submesh(self, names: Sequence[str]) -> Mesh:
        return Mesh(tuple(names), tuple(self.size(n) for n in names))


# The largest mesh lint and compile accept (2**20 ranks, beyond any cluster). Their layout
# checks cost the same at any world size (they sample the mesh: sample_boxes); the
# runtime's `verify` still compares placements rank by rank (same_layout). A stated limit:
# the compiler refuses larger meshes.
MAX_WORLD = 1 << 20


def resolve_sizes(
    names: Sequence[str], sizes: Sequence[int | None], world: int | None
) -> tuple[int, ...]:
    """Fill the one ``None`` ("the rest of the world") size from ``world``."""
    rest = [i for i, s in enumerate(sizes) if s is None]
    if len(rest) > 1:
        raise LayoutError(
            "at most one mesh axis can take the rest of the world size", LayoutProblem.MESH_SIZES
        )
    if not rest:
        fixed = tuple(int(s) for s in sizes if s is not None)
        if world is not None and math.prod(fixed) != world:
            raise LayoutError(
                f"mesh {dict(zip(names, fixed, strict=True))} has {math.prod(fixed)} ranks, "
                f"but the world size is {world}",
                LayoutProblem.MESH_SIZES,
            )
        return fixed
    known = math.prod(s for s in sizes if s is not None)
    if world is None:
        raise LayoutError(
            f"mesh axis {names[rest[0]]!r} takes the rest, but no world size is known",
            LayoutProblem.MESH_SIZES,
        )
    if known == 0 or world % known:
        raise LayoutError(
            f"world size {world} is not divisible by the other mesh axes' product {known}",
            LayoutProblem.MESH_SIZES,
        )
    return tuple(world // known if s is None else int(s) for s in sizes)


# --------------------------------------------------------------------------- rules -> layouts


@dataclass(frozen=True, slots=True)
class RuleSpec:
    """A rule after the compiler resolved it (FSDP default applied), in plain data.

    The generated module carries these for specs without a manifest, so the runtime builds
    layouts from module shapes with the same function the compiler uses.
    """

    pattern: str
    dims: tuple[str, ...]
    shard: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (dim, axes outer -> inner)
    fuse: tuple[tuple[str, tuple[tuple[str, int | None], ...], int], ...] = ()
    local: tuple[str, ...] = ()
    name_indexed: tuple[str, ...] = ()  # dims indexed by a name capture
    stored_fused: bool = False
    any_rank: bool = False  # `param p replicate` without dimension names
    # Checkpoint-only splits: (dim, axes) cutting stored chunks further over axes the
    # parameter is replicated on at run time.
    ckpt_shard: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # `heads COMP SIZE replicated`: (dim, component, head size) of fused components whose
    # heads the dimension's one (local) axis replicates when it has more ranks than heads.
    replicated_heads: tuple[tuple[str, str, int], ...] = ()
    # Fused dimensions whose `fuse` item says `squeezed` (:attr:`Fusion.squeezed`).
    squeezed: tuple[str, ...] = ()

    def axes_of(self, dim: str) -> tuple[str, ...]:
        return dict(self.shard).get(dim, ())


def build_layout(
    rule: RuleSpec,
    module_shape: Sequence[int],
    sizes: dict[str, int],
    name_indexed_counts: dict[str, int] | None = None,
) -> ParamLayout:
    """The global layout of a parameter whose module tensor has ``module_shape``.

    Sizes on local axes are multiplied up to global ones; a name-indexed dim's global size is the
    number of modules per rank (``name_indexed_counts``) times its local axes. Raises
    :class:`LayoutError` (saying what is wrong) when the rule does not fit the tensor.
    """
    if rule.any_rank:
        names = tuple(f"dim{i}" for i in range(len(module_shape)))
        return ParamLayout(tuple(Dim(n, s) for n, s in zip(names, module_shape, strict=True)))
    _check_axes(rule, sizes)
    tensor_dims = [d for d in rule.dims if d not in rule.name_indexed]
    if len(tensor_dims) != len(module_shape):
        raise LayoutError(
            f"the rule names {len(tensor_dims)} dimension(s) {list(tensor_dims)}, "
            f"but the tensor has {len(module_shape)}: shape {list(module_shape)}",
            LayoutProblem.DIM_COUNT,
            "name one dimension per tensor dimension, in order",
        )
    local = frozenset(rule.local)
    shapes = dict(zip(tensor_dims, module_shape, strict=True))
    fusions = {dim: (comps, groups) for dim, comps, groups in rule.fuse}
    dims = []
    for name in rule.dims:
        axes = rule.axes_of(name)
        local_factor = math.prod(sizes[a] for a in axes if a in local)
        if name in rule.name_indexed:
            count = (name_indexed_counts or {}).get(name, 1)
            size = count * local_factor
        else:
            size = shapes[name] * local_factor
        fusion = None
        if name in fusions:
            replicated = tuple((c, h) for d, c, h in rule.replicated_heads if d == name)
            if replicated:
                size = _replicated_size(name, shapes[name], fusions[name], replicated, axes, rule)
            if name in rule.squeezed:
                _check_squeezed(name, size, *fusions[name], axes)
            fusion = _fusion(name, size, *fusions[name], axes=axes, sizes=sizes, rep=replicated)
            if name in rule.squeezed:
                fusion = replace(fusion, squeezed=True)
            if replicated and axes[0] in local:
                _check_module_size(name, shapes[name], fusion, axes[0], sizes)
        dims.append(Dim(name, size, axes, fusion, name in rule.name_indexed))
    ckpt_of = dict(rule.ckpt_shard)
    ckpt = tuple(ckpt_of.get(d.name, ()) for d in dims) if ckpt_of else ()
    for d in dims:
        if d.fusion is not None and d.fusion.squeezed and ckpt_of.get(d.name):
            raise LayoutError(
                f"dimension {d.name!r} is squeezed (each component one index of it), but "
                f"`checkpoint shard` cuts it over {', '.join(ckpt_of[d.name])}",
                LayoutProblem.COMPONENT_SPLIT,
                "cut another dimension: a squeezed component is stored whole along its dimension",
            )
    return ParamLayout(tuple(dims), local, ckpt)


def _check_axes(rule: RuleSpec, sizes: dict[str, int]) -> None:
    """What the compiler's structural checks guarantee, checked again for rules that reach
    the runtime by another road (hand-written or edited ``RULES``)."""
    local = frozenset(rule.local)
    used: dict[str, str] = {}
    for dim, axes in rule.shard:
        if dim not in rule.dims:
            raise LayoutError(f"unknown dimension {dim!r}", LayoutProblem.UNKNOWN_DIM)
        for k, a in enumerate(axes):
            if a not in sizes:
                raise LayoutError(f"unknown mesh axis {a!r}", LayoutProblem.UNKNOWN_AXIS)
            if a in used:
                raise LayoutError(
                    f"axis {a!r} shards dimension {dim!r} and already {used[a]!r}",
                    LayoutProblem.AXIS_REUSED,
                )
            used[a] = dim
            if a in local and any(b not in local for b in axes[:k]):
                raise LayoutError(
                    f"local axis {a!r} comes after a non-local axis on dimension {dim!r}",
                    LayoutProblem.LOCAL_AFTER_NONLOCAL,
                )
        if dim in rule.name_indexed and any(a not in local for a in axes):
            raise LayoutError(
                f"dimension {dim!r} is indexed by module name, so only local axes can shard it",
                LayoutProblem.NAME_INDEXED_NONLOCAL,
            )


def _replicated_size(
    dim: str,
    module_size: int,
    fuse: tuple[tuple[tuple[str, int | None], ...], int],
    replicated: tuple[tuple[str, int], ...],
    axes: tuple[str, ...],
    rule: RuleSpec,
) -> int:
    """The global size of a fused dimension with replicated heads: its components' sizes,
    which must be given (a module built with its shard does not tell them), over one axis."""
    comps, groups = fuse
    if len(axes) != 1 or groups != 1 or any(s is None for _, s in comps):
        raise LayoutError(
            f"dimension {dim!r}: replicated heads ({', '.join(c for c, _ in replicated)}) "
            "need one shard axis, no groups, and every component's global size",
            LayoutProblem.COMPONENT_SPLIT,
            "write `fuse qkv as q 64, k 32, v 32` and `shard qkv over tp` with `local tp`",
        )
    if axes[0] not in rule.local:
        return module_size
    return sum(int(s or 0) for _, s in comps)


def _check_module_size(
    dim: str, module_size: int, fusion: Fusion, axis: str, sizes: dict[str, int]
) -> None:
    """A module built with its shard of a dimension with replicated heads holds what rank 0
    of ``axis`` holds (every rank holds as much)."""
    n = sizes[axis]
    held = [component_chunk(fusion, c, s, n, 0) for c, s in fusion.components]
    size = sum(b - a for a, b in held)
    if size != module_size:
        raise LayoutError(
            f"dimension {dim!r} is {module_size} in the module, but each of the {n} ranks "
            f"of {axis} holds {size} of it (its components' slices, replicated heads whole)",
            LayoutProblem.COMPONENT_SIZES,
            f"build the module with {axis}={n}, or give the components' global sizes",
        )


def _fusion(
    dim: str,
    size: int,
    comps: tuple[tuple[str, int | None], ...],
    groups: int,
    *,
    axes: tuple[str, ...],
    sizes: dict[str, int],
    rep: tuple[tuple[str, int], ...] = (),
) -> Fusion:
    if groups < 1:
        raise LayoutError(
            f"dimension {dim!r}: the group count must be at least 1", LayoutProblem.GROUP_COUNT
        )
    if all(s is None for _, s in comps):
        per = size // groups
        if size % (groups * len(comps)):
            raise LayoutError(
                f"dimension {dim!r} has size {size}, which does not split into "
                f"{groups * len(comps)} equal component(s)",
                LayoutProblem.COMPONENT_SIZES,
                "give each component's size explicitly",
            )
        comp_sizes = tuple((n, per // len(comps)) for n, _ in comps)
    else:
        comp_sizes = tuple((n, int(s or 0)) for n, s in comps)
        total = sum(s for _, s in comp_sizes) * groups
        if total != size:
            detail = " + ".join(f"{n} {s}" for n, s in comp_sizes)
            times = f" x {groups} groups" if groups > 1 else ""
            raise LayoutError(
                f"components of {dim!r} add up to {total} ({detail}{times}), "
                f"but the dimension has size {size}",
                LayoutProblem.COMPONENT_SIZES,
                "component sizes are global sizes; they must add up to the dimension",
            )
    fusion = Fusion(comp_sizes, groups, rep)
    if axes:
        n = sizes[axes[0]]
        if groups > 1 and groups % n:
            raise LayoutError(
                f"{groups} groups of {dim!r} do not divide over {axes[0]}={n}",
                LayoutProblem.COMPONENT_SPLIT,
                f"the group count must be a multiple of {axes[0]}",
            )
        bad = [
            (c, s)
            for c, s in comp_sizes
            if groups == 1 and s % n and replicated_heads(fusion, c, s, n) is None
        ]
        if bad:
            detail = ", ".join(f"{c} {s}" for c, s in bad)
            raise LayoutError(
                f"component(s) of {dim!r} not divisible by {axes[0]}={n}: {detail}",
                LayoutProblem.COMPONENT_SPLIT,
                "every component is split separately: each must divide by the axis size",
            )
    return fusion


def _check_squeezed(
    dim: str,
    size: int,
    comps: tuple[tuple[str, int | None], ...],
    groups: int,
    axes: tuple[str, ...],
) -> None:
    """A squeezed fused dimension (`fuse DIM as A, B squeezed`): each component one index
    of it, which no axis shards (a rank holds every component of its block whole)."""
    n = len(comps)
    if groups != 1 or size != n or any(s not in (None, 1) for _, s in comps):
        raise LayoutError(
            f"dimension {dim!r} is squeezed, so each of its {n} component(s) is one index of "
            f"it, but it has size {size}" + (f" in {groups} groups" if groups != 1 else ""),
            LayoutProblem.COMPONENT_SIZES,
            f"a squeezed dimension has size {n} (its components, no groups): `[hidden, 2, dim]`"
            " with `fuse pair as w1, w3 squeezed`; drop `squeezed` for components of more rows",
        )
    if axes:
        raise LayoutError(
            f"dimension {dim!r} is squeezed (each component one index of it), but "
            f"{', '.join(axes)} shards it",
            LayoutProblem.COMPONENT_SPLIT,
            "shard another dimension (torchtitan shards `w13`'s hidden dimension over tp); "
            "a squeezed component is stored whole along its dimension",
        )


# --------------------------------------------------------------------------- index sets


def chunk_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """``torch.chunk(range(n), k)[i]`` as ``(start, stop)``, empty chunks included."""
    c = -(-n // k) if n else 0
    start = min(n, c * i)
    return start, min(n, start + c)


def chunk_sizes(n: int, k: int) -> tuple[int, ...]:
    return tuple(b - a for a, b in (chunk_bounds(n, k, i) for i in range(k)))


def ranges_len(r: Ranges) -> int:
    return sum(b - a for a, b in r)


def _merge(parts: Iterable[tuple[int, int]]) -> Ranges:
    out: list[list[int]] = []
    for a, b in parts:
        if a >= b:
            continue
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def slice_ranges(r: Ranges, start: int, stop: int) -> Ranges:
    """Positions ``[start, stop)`` of the sequence that ``r`` enumerates."""
    out = []
    pos = 0
    for a, b in r:
        n = b - a
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += n
        if pos >= stop:
            break
    return _merge(out)


def _block(r: Ranges, n: int, i: int) -> Ranges:
    lo, hi = chunk_bounds(ranges_len(r), n, i)
    return slice_ranges(r, lo, hi)


def _strided(r: Ranges, split_factor: int, n: int, i: int) -> Ranges:
    """DTensor's ``_StridedShard(split_factor)``: chunk into ``split_factor`` pieces, then take
    piece ``i`` of every piece's ``n``-way chunk."""
    total = ranges_len(r)
    parts: list[tuple[int, int]] = []
    for j in range(split_factor):
        plo, phi = chunk_bounds(total, split_factor, j)
        lo, hi = chunk_bounds(phi - plo, n, i)
        parts.extend(slice_ranges(r, plo + lo, plo + hi))
    return _merge(parts)


def _first_split(dim: Dim, n: int, i: int) -> Ranges:
    """The first axis on a dimension: per component when fused, else a plain block."""
    f = dim.fusion
    if f is None:
        return _block(((0, dim.size),) if dim.size else (), n, i)
    if f.groups > 1:
        g0, g1 = chunk_bounds(f.groups, n, i)
        return _merge([(g0 * f.group_size, g1 * f.group_size)])
    parts = []
    start = 0
    for name, size in f.components:
        lo, hi = component_chunk(f, name, size, n, i)
        parts.append((start + lo, start + hi))
        start += size
    return _merge(parts)


def replicated_heads(fusion: Fusion, name: str, size: int, n: int) -> int | None:
    """The head count of component ``name`` (``size`` indices) when its heads are
    replicated over ``n`` ranks (``n`` above the head count: vLLM's ``QKVParallelLinear``
    with ``tp > num_kv_heads``); ``None`` when the component is split as usual."""
    head = dict(fusion.replicated).get(name)
    if not head or size % head:
        return None
    heads = size // head
    return heads if 0 < heads < n else None


def component_chunk(fusion: Fusion, name: str, size: int, n: int, i: int) -> tuple[int, int]:
    """``(start, stop)`` in component ``name`` (``size`` indices) of the ``i``-th of ``n``
    ranks splitting it: ``torch.chunk``'s, or, for heads replicated over more ranks than
    there are heads, head ``i * heads // n`` (``i // (n // heads)``: vLLM's ``rank //
    num_kv_head_replicas``), whole on each of its ``n // heads`` consecutive ranks."""
    heads = replicated_heads(fusion, name, size, n)
    if heads is None:
        return chunk_bounds(size, n, i)
    head = size // heads
    h = i * heads // n
    return h * head, (h + 1) * head


def dim_indices(dim: Dim, sizes: dict[str, int], coord: dict[str, int]) -> Ranges:
    """The global indices of ``dim`` that a rank holds, physically (outer to inner)."""
    r: Ranges = ((0, dim.size),) if dim.size else ()
    for k, axis in enumerate(dim.axes):
        n, i = sizes[axis], coord[axis]
        r = _first_split(dim, n, i) if k == 0 else _block(r, n, i)
    return r


def local_indices(layout: ParamLayout, mesh: Mesh, coord: Sequence[int]) -> tuple[Ranges, ...]:
    """Per dimension, the global indices that the rank at ``coord`` holds (none on a
    rank of another pipeline stage)."""
    if not layout.on_stage(mesh, coord):
        return tuple(() for _ in layout.dims)
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    c = dict(zip(mesh.names, coord, strict=True))
    return tuple(dim_indices(d, sizes, c) for d in layout.dims)


def box(ranges: tuple[Ranges, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(shape, offset)`` when the index sets form one box, else ``None``.

    An empty dimension gives shape 0 and offset 0.
    """
    shape, offset = [], []
    for r in ranges:
        if len(r) > 1:
            return None
        if not r:
            shape.append(0)
            offset.append(0)
        else:
            shape.append(r[0][1] - r[0][0])
            offset.append(r[0][0])
    return tuple(shape), tuple(offset)


# --------------------------------------------------------------------------- DTensor view

# Placements without torch, as DTensor reads them left to right over its mesh's axes. The
# runtime turns them into torch's Replicate, Shard and _StridedShard (runtime.dtensor).


@dataclass(frozen=True, slots=True)
class Replicate:
    """The axis holds the whole tensor on every rank."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Shard:
    """The axis cuts tensor dimension ``dim`` into ``torch.chunk`` blocks."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard:
    """DTensor's ``_StridedShard``: the axis cuts each of ``split_factor`` equal pieces of
    tensor dimension ``dim`` into blocks, and a rank holds its block of every piece."""

    dim: int
    split_factor: int

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


Placement = Replicate | Shard | StridedShard
REPLICATE = Replicate()


def dtensor_mesh(layout: ParamLayout, mesh: Mesh) -> Mesh:
    """The mesh a parameter's DTensor spans: every axis that is not local to it, nor its
    pipeline stage axis (a stage's DTensors live on that stage's ranks)."""
    return mesh.submesh([n for n in mesh.names if n not in layout.local and n != layout.stage_axis])


def dtensor_placements(layout: ParamLayout, mesh: Mesh) -> tuple[Placement, ...]:
    """DTensor placements (on ``dtensor_mesh``) that describe the layout, left to right.

    An axis that shards a dimension after axes that come later in mesh order gets
    ``_StridedShard`` with the product of those axes' sizes as split factor, as FSDP2 does
    for FSDP-over-TP. A fused (ungrouped) dimension whose first axis is not local counts as
    one more outer split of ``len(components)``. An axis of size 1 cuts nothing: it is
    ``Replicate`` and takes no part in any split factor (torch reads split factors as a
    shard order over the axes that shard, and a size-1 axis there breaks that reading).
    Whether the result really equals the physical layout is for :func:`representable` to
    say, whether torch's own operations handle it for :func:`torch_problem`.
    """
    sub = dtensor_mesh(layout, mesh)
    pos = {n: i for i, n in enumerate(sub.names)}
    out: list[Placement] = [REPLICATE] * len(sub.names)
    tensor_dims = layout.tensor_dims()
    for d_index, dim in enumerate(tensor_dims):
        dt_axes = [a for a in dim.axes if a not in layout.local and sub.size(a) > 1]
        # A fused dimension's first (non-local) axis splits each component: for DTensor,
        # one more outer split, into as many pieces as there are components. A first axis
        # of size 1 splits nothing, and the next one cuts the dimension as one block.
        component_factor = (
            len(dim.fusion.components)
            if dim.fusion is not None
            and dim.fusion.groups == 1
            and dim.axes
            and dim.axes[0] in dt_axes
            else 1
        )
        for k, axis in enumerate(dt_axes):
            sf = component_factor
            for outer in dt_axes[:k]:
                if pos[outer] > pos[axis]:
                    sf *= sub.size(outer)
            out[pos[axis]] = Shard(d_index) if sf == 1 else StridedShard(d_index, sf)
    return tuple(out)


def torch_placement_indices(
    shape: Sequence[int], mesh: Mesh, placements: Sequence[Placement], coord: Sequence[int]
) -> tuple[Ranges, ...]:
    """DTensor's left-to-right meaning of ``placements``: per dim, the indices at ``coord``."""
    r: list[Ranges] = [((0, s),) if s else () for s in shape]
    for p, n, i in zip(placements, mesh.sizes, coord, strict=True):
        if isinstance(p, Shard):
            r[p.dim] = _block(r[p.dim], n, i)
        elif isinstance(p, StridedShard):
            r[p.dim] = _strided(r[p.dim], p.split_factor, n, i)
    return tuple(r)


@lru_cache(maxsize=4096)
def same_layout(
    shape: tuple[int, ...],
    mesh: Mesh,
    placements: tuple[Placement, ...],
    names: tuple[str, ...],
    other: tuple[Placement, ...],
) -> tuple[tuple[int, ...], tuple[Ranges, ...], tuple[Ranges, ...]] | None:
    """Whether ``other`` on the sub-mesh ``names`` of ``mesh`` (axes it leaves out are
    replicated) puts every rank on the same indices as ``placements`` on ``mesh``, both read
    with DTensor's own semantics. ``None`` when they agree; else the first coordinate that
    differs, with its indices under ``placements`` and under ``other``. Compares layouts,
    not spellings: ``Shard(0)`` on ``(dp,)`` equals ``(Shard(0), Replicate())`` on
    ``(dp, tp)``, and ``_StridedShard(d, 1)`` equals ``Shard(d)``."""
    sub = mesh.submesh(names)
    pos = [mesh.names.index(n) for n in names]

    def read(coord: Sequence[int]) -> tuple[tuple[Ranges, ...], tuple[Ranges, ...]]:
        want = torch_placement_indices(shape, mesh, placements, coord)
        return want, torch_placement_indices(shape, sub, other, [coord[p] for p in pos])

    def differs(coord: tuple[int, ...]) -> bool:
        want, have = read(coord)
        return want != have and not _same_empty(want, have)

    # Sampled, not a walk over every rank (65,536 ranks took a second per layout).
    programs = ((mesh.names, placements), (tuple(names), other))
    coord = _first_in_boxes(placement_boxes(shape, mesh, programs), mesh, differs)
    return None if coord is None else (tuple(coord), *read(coord))


def _same_empty(a: tuple[Ranges, ...], b: tuple[Ranges, ...]) -> bool:
    """Two shards without elements, of one local shape: they hold the same (nothing),
    whatever ranges their other dimensions would cover."""
    return (
        any(not r for r in a)
        and any(not r for r in b)
        and tuple(map(ranges_len, a)) == tuple(map(ranges_len, b))
    )


def torch_local_shape_and_offset(
    shape: Sequence[int], mesh: Mesh, placements: Sequence[Placement], coord: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` returns:
    the local shape and each dim's first global index (the dim's size when empty)."""
    r = torch_placement_indices(shape, mesh, placements, coord)
    sharded = {p.dim for p in placements if not isinstance(p, Replicate)}
    local = tuple(ranges_len(x) for x in r)
    offset = tuple((x[0][0] if x else shape[d]) if d in sharded else 0 for d, x in enumerate(r))
    return local, offset


def _dtensor_view(layout: ParamLayout, mesh: Mesh, coord: Sequence[int]) -> tuple[Ranges, ...]:
    """The physical indices restricted to the DTensor's own dims and axes.

    For a local axis the module tensor is the DTensor's global tensor; its indices are
    re-based so that the DTensor-side view starts at 0.
    """
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    c = dict(zip(mesh.names, coord, strict=True))
    out = []
    for dim in layout.tensor_dims():
        n_local = sum(1 for a in dim.axes if a in layout.local)
        if n_local == 0:
            out.append(dim_indices(dim, sizes, c))
            continue
        # The module holds the local block; index it by position within that block.
        block = dim_indices(Dim(dim.name, dim.size, dim.axes[:n_local], dim.fusion), sizes, c)
        rest = Dim(dim.name, ranges_len(block), dim.axes[n_local:])
        out.append(dim_indices(rest, sizes, c))
    return tuple(out)


def _first_coord(layout: ParamLayout, mesh: Mesh) -> tuple[int, ...]:
    """Coordinate 0 on every axis, but on the parameter's (first) pipeline stage."""
    if layout.stage_axis is None or layout.stage_axis not in mesh.names:
        return (0,) * len(mesh.names)
    return tuple(layout.stages[0] if n == layout.stage_axis else 0 for n in mesh.names)


def module_shape(layout: ParamLayout, mesh: Mesh) -> tuple[int, ...]:
    """The shape of the tensor the module holds before any DTensor sharding (its local-axis
    block, for name-indexed dims nothing). Uses the rank at coordinate 0 on every axis, so it is
    exact only when local axes divide evenly, which checks require."""
    coord = _first_coord(layout, mesh)
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    c = dict(zip(mesh.names, coord, strict=True))
    out = []
    for dim in layout.tensor_dims():
        local_axes = tuple(a for a in dim.axes if a in layout.local)
        if not local_axes:
            out.append(dim.size)
        else:
            d = Dim(dim.name, dim.size, local_axes, dim.fusion)
            out.append(ranges_len(dim_indices(d, sizes, c)))
    return tuple(out)


@lru_cache(maxsize=4096)
def representable(layout: ParamLayout, mesh: Mesh) -> tuple[int, ...] | None:
    """``None`` when DTensor placements describe the layout on every rank; otherwise the
    coordinate of the first rank where they do not."""
    placements = dtensor_placements(layout, mesh)
    sub = dtensor_mesh(layout, mesh)
    shape = module_shape(layout, mesh)
    sub_pos = [mesh.names.index(n) for n in sub.names]

    def differs(coord: tuple[int, ...]) -> bool:
        want = _dtensor_view(layout, mesh, coord)
        got = torch_placement_indices(shape, sub, placements, [coord[p] for p in sub_pos])
        return want != got

    return first_difference(layout, mesh, differs)


# --------------------------------------------------------------------------- torch's operations
#
# Placements that describe a layout are not enough: torch's own operations must handle them,
# and two of them do not handle every _StridedShard (torch 2.13; tests/test_layout_torch.py
# runs every layout the compiler emits through them on gloo):
#
# * ``distribute_tensor`` scatters a ``_StridedShard`` step only when all its shards have one
#   size (``_StridedShard._shard_tensor`` computes padding but does not apply it): an uneven
#   ``_StridedShard`` raises an AssertionError.
# * ``redistribute`` (``full_tensor``) first reads the split factors as a shard order
#   (``DTensorSpec._maybe_convert_StridedShard_to_shard_order``) and gathers in that order. When
#   they do not decode (a split per component: its factor is no product of axis sizes), it
#   falls back to a greedy plan that gathers right to left and sizes each step by the
#   ``Shard`` placements before it only, so a ``_StridedShard`` before another cut of the
#   same dimension gives that step the wrong size: "Expected cond to be True" in
#   ``_maybe_unpad_tensor``, or silently wrong data.
#
# Lint refuses what torch cannot gather. What it cannot scatter from one rank, lint only
# notes in a hint: such layouts gather, train, save and load (nothing in shardspec scatters),
# and ``distribute_tensor(..., src_data_rank=None)`` builds them from whole tensors.


@dataclass(frozen=True)
class TorchProblem:
    """Where torch's own operations fail on a layout's DTensor placements."""

    op: str  # "distribute_tensor" (an uneven _StridedShard) or "full_tensor" (the gather)
    coord: tuple[int, ...]  # the first rank concerned, on the layout's mesh
    axis: str  # the mesh axis whose step fails
    dim: int  # the tensor dimension it cuts (an index into ``tensor_dims()``)


def torch_shard_order(
    placements: Sequence[Placement], sizes: Sequence[int]
) -> dict[int, list[int]] | None:
    """Per tensor dim, the mesh dims that cut it in the order torch's redistribute reads
    from ``placements`` (its ``_maybe_convert_StridedShard_to_shard_order``: right to left,
    each at the first place whose earlier axes' sizes multiply to its split factor); ``None``
    when the split factors do not decode, and torch falls back to its greedy plan."""
    order: dict[int, list[int]] = {}
    strided = any(isinstance(p, StridedShard) for p in placements)
    for i in reversed(range(len(placements))) if strided else range(len(placements)):
        p = placements[i]
        if isinstance(p, Replicate):
            continue
        dims = order.setdefault(p.dim, [])
        if not strided:
            dims.append(i)
            continue
        want = p.split_factor if isinstance(p, StridedShard) else 1
        acc = 1
        for k in range(len(dims) + 1):
            if acc == want:
                dims.insert(k, i)
                break
            if k < len(dims):
                acc *= sizes[dims[k]]
        else:
            return None
    return order


def _strided_shard_sizes(m: int, split_factor: int, n: int) -> set[int]:
    """The sizes of the ``n`` shards of a ``_StridedShard(split_factor)`` step on ``m``
    positions: shard ``i`` holds chunk ``i`` of each of the ``split_factor`` pieces. The
    pieces have at most two sizes besides 0, and a piece's chunk sizes change at two
    chunks only, so a few chunks say every size the shards have."""
    c = -(-m // split_factor) if m else 0
    pieces = {c: m // c, m % c: 1} if c else {}
    pieces.pop(0, None)
    candidates = {0, n - 1}
    for size in pieces:
        q = size // -(-size // n)
        candidates.update((q - 1, q, q + 1))

    def length(size: int, i: int) -> int:
        lo, hi = chunk_bounds(size, n, i)
        return hi - lo

    return {
        sum(count * length(size, i) for size, count in pieces.items())
        for i in candidates
        if 0 <= i < n
    }


def _step_sizes(
    shape: Sequence[int], mesh: Mesh, placements: Sequence[Placement], coord: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Per mesh dim, the size of the tensor dim its placement cuts (0 where it replicates)
    just before that step, as DTensor holds it at ``coord``; and as torch's greedy
    redistribute sizes it (counting the ``Shard`` steps before it only)."""
    held: list[Ranges] = [((0, s),) if s else () for s in shape]
    greedy = list(shape)
    true_sizes, greedy_sizes = [], []
    for p, n, i in zip(placements, mesh.sizes, coord, strict=True):
        if isinstance(p, Replicate):
            true_sizes.append(0)
            greedy_sizes.append(0)
            continue
        true_sizes.append(ranges_len(held[p.dim]))
        greedy_sizes.append(greedy[p.dim])
        if isinstance(p, StridedShard):
            held[p.dim] = _strided(held[p.dim], p.split_factor, n, i)
        else:
            held[p.dim] = _block(held[p.dim], n, i)
            lo, hi = chunk_bounds(greedy[p.dim], n, i)
            greedy[p.dim] = hi - lo
    return true_sizes, greedy_sizes


SCATTER, GATHER = "distribute_tensor", "full_tensor"


@lru_cache(maxsize=4096)
def placement_problem(
    shape: tuple[int, ...], mesh: Mesh, placements: tuple[Placement, ...], op: str = GATHER
) -> tuple[tuple[int, ...], int] | None:
    """Where torch's ``op`` (:data:`SCATTER`: ``distribute_tensor`` from one rank;
    :data:`GATHER`: ``full_tensor``, ``redistribute`` to ``Replicate``) fails on
    ``placements`` for a tensor of ``shape`` (see the comment above): ``(first coordinate,
    mesh dim)``, or ``None`` where it works. Sampled like :func:`same_layout`: the cost does
    not grow with the world."""
    if not any(isinstance(p, StridedShard) for p in placements):
        return None  # Shard and Replicate only: padded scatter, left-to-right gather
    shards = [(n, p) for n, p in zip(mesh.names, placements, strict=True) if isinstance(p, Shard)]
    programs = (
        (mesh.names, placements),
        (tuple(n for n, _ in shards), tuple(p for _, p in shards)),
    )
    boxes = placement_boxes(shape, mesh, programs)

    def uneven_scatter(coord: tuple[int, ...]) -> int | None:
        sizes, _ = _step_sizes(shape, mesh, placements, coord)
        for i, p in enumerate(placements):
            if isinstance(p, StridedShard) and mesh.sizes[i] > 1:
                if len(_strided_shard_sizes(sizes[i], p.split_factor, mesh.sizes[i])) > 1:
                    return i
        return None

    def missized(coord: tuple[int, ...]) -> int | None:
        true_sizes, greedy_sizes = _step_sizes(shape, mesh, placements, coord)
        for i in range(len(placements)):
            if mesh.sizes[i] > 1 and true_sizes[i] != greedy_sizes[i]:
                return i
        return None

    if op == SCATTER:
        step = uneven_scatter
    else:
        order = torch_shard_order(placements, mesh.sizes)
        if order is not None:
            # Gathered in the decoded order: nested torch.chunk, outer to inner.
            names = tuple(mesh.names[i] for dims in order.values() for i in dims)
            nested = tuple(Shard(t) for t, dims in order.items() for _ in dims)
            found = same_layout(shape, mesh, placements, names, nested)
            strided = next(i for i, p in enumerate(placements) if isinstance(p, StridedShard))
            return None if found is None else (found[0], strided)
        step = missized
    coord = _first_in_boxes(boxes, mesh, lambda c: step(c) is not None)
    return None if coord is None else (coord, step(coord))  # type: ignore[return-value]


@lru_cache(maxsize=4096)
def torch_problem(layout: ParamLayout, mesh: Mesh, op: str = GATHER) -> TorchProblem | None:
    """Where torch's own ``op`` (:data:`GATHER`, what lint refuses, or :data:`SCATTER`) fails
    on the layout's :func:`dtensor_placements`; ``None`` where it works. Meaningful once
    :func:`representable` holds."""
    sub = dtensor_mesh(layout, mesh)
    placements = dtensor_placements(layout, mesh)
    found = placement_problem(module_shape(layout, mesh), sub, placements, op)
    if found is None:
        return None
    sub_coord, i = found
    coord = list(_first_coord(layout, mesh))
    for name, c in zip(sub.names, sub_coord, strict=True):
        coord[mesh.names.index(name)] = c
    p = placements[i]
    assert not isinstance(p, Replicate)
    return TorchProblem(op, tuple(coord), sub.names[i], p.dim)


def torch_problem_text(layout: ParamLayout, mesh: Mesh, problem: TorchProblem) -> tuple[str, str]:
    """What :func:`torch_problem` found, said for people: ``(message, hint)``, naming the
    dimensions and axes (the caller adds the parameter)."""
    dims = layout.tensor_dims()
    dim = dims[problem.dim]
    placements = dtensor_placements(layout, mesh)
    sub = dtensor_mesh(layout, mesh)
    p = placements[sub.names.index(problem.axis)]
    in_dim_order = " before ".join(a for a in dim.axes if a not in layout.local)
    mesh_first = (
        f"order the mesh's axes {in_dim_order} (the order they cut {dim.name!r} in), so that "
        "no _StridedShard cuts it"
    )
    if problem.op == SCATTER and isinstance(p, StridedShard):
        axes = [a for a in dim.axes if a not in layout.local]
        total = math.prod(mesh.size(a) for a in axes)
        return (
            f"torch's distribute_tensor cannot scatter {dim.name!r} from one rank: its cut over "
            f"{problem.axis!r} is a _StridedShard (split factor {p.split_factor}) whose shards "
            "differ in size, which torch does not pad",
            "give every rank the whole tensor and pass src_data_rank=None (shardspec's "
            f"distribute, load and load_hf scatter nothing), or make {dim.name!r} divisible by "
            f"{' x '.join(axes)} = {total}",
        )
    fused = next(
        (
            d
            for d in dims
            if d.fusion is not None
            and d.fusion.groups == 1
            and d.axes
            and d.axes[0] in sub.names
            and mesh.size(d.axes[0]) > 1
        ),
        None,
    )
    strided = [
        a
        for a, q in zip(sub.names, placements, strict=True)
        if isinstance(q, StridedShard) and q.dim == problem.dim and a != problem.axis
    ]
    if fused is not None and strided and fused is not dim:
        return (
            f"torch cannot gather this layout (full_tensor, redistribute): {fused.name!r} is "
            f"split per component over {fused.axes[0]!r}, a _StridedShard that torch cannot "
            f"read as a shard order, and its fallback then sizes the cut of {dim.name!r} over "
            f"{problem.axis!r} without the _StridedShard over {strided[0]!r} before it",
            f"{mesh_first}; or keep {fused.name!r} from being split per component over a "
            f"DTensor axis (`local {fused.axes[0]}`, or fused in groups)",
        )
    return (
        f"torch cannot gather this layout (full_tensor, redistribute): it reads the "
        f"_StridedShard placements {', '.join(map(str, placements))} in another order than "
        f"they cut {dim.name!r}",
        mesh_first,
    )


def first_difference(
    layout: ParamLayout, mesh: Mesh, differs: Callable[[tuple[int, ...]], bool], *more: ParamLayout
) -> tuple[int, ...] | None:
    """The first coordinate (in rank order) on ``layout``'s stages where ``differs``, a
    comparison of two index sets that ``layout`` and ``more`` determine, is true; ``None``
    if nowhere. Visits each box of :func:`sample_boxes` at its corner and one step from it
    along each axis, which decides the whole box: the index sets are affine over it, so
    where they agree at the corner and at those steps they agree everywhere, and otherwise
    the first rank where they differ is the corner or the step along the innermost axis
    where they differ."""
    boxes = sample_boxes((layout, *more), mesh)
    return _first_in_boxes([b for b in boxes if layout.on_stage(mesh, b.corner)], mesh, differs)


def _first_in_boxes(
    boxes: Iterable[Box], mesh: Mesh, differs: Callable[[tuple[int, ...]], bool]
) -> tuple[int, ...] | None:
    """The first coordinate in rank order where ``differs`` (a comparison of index sets
    affine over each box) is true: each box decided at its corner and one step on."""
    best: tuple[int, ...] | None = None
    best_rank = mesh.world
    for box in boxes:
        if mesh.rank_of(box.corner) >= best_rank:
            continue
        found = (
            box.corner
            if differs(box.corner)
            else next((step for step in box.steps() if differs(step)), None)
        )
        if found is not None and mesh.rank_of(found) < best_rank:
            best, best_rank = found, mesh.rank_of(found)
    return best


# --------------------------------------------------------------------------- per-rank table


@dataclass(frozen=True)
class RankShard:
    """One rank's view of a parameter."""

    rank: int
    coord: tuple[int, ...]
    indices: tuple[Ranges, ...]  # global, per dim (name-indexed dims included)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(ranges_len(r) for r in self.indices)

    @property
    def offset(self) -> tuple[int, ...]:
        return tuple(r[0][0] if r else 0 for r in self.indices)

    @property
    def contiguous(self) -> bool:
        return box(self.indices) is not None

    @property
    def empty(self) -> bool:
        return any(not r for r in self.indices)


@lru_cache(maxsize=4096)
def sampled_table(layout: ParamLayout, mesh: Mesh) -> tuple[tuple[RankShard, Box], ...]:
    """The shard of the rank at each corner of :func:`sample_boxes`, with its box: every
    rank of a box has the corner's local sizes, empty dimensions and pieces per stored
    unit. What :func:`rank_table` says, at a cost that does not grow with the world."""
    return tuple(
        (RankShard(mesh.rank_of(b.corner), b.corner, local_indices(layout, mesh, b.corner)), b)
        for b in sample_boxes((layout,), mesh)
    )


@lru_cache(maxsize=4096)
def rank_table(layout: ParamLayout, mesh: Mesh) -> tuple[RankShard, ...]:
    """Every rank's shard of a parameter, in rank order."""
    return tuple(
        RankShard(rank, coord, local_indices(layout, mesh, coord))
        for rank, coord in enumerate(mesh.coords())
    )


def component_indices(fusion: Fusion, ranges: Ranges, name: str) -> Ranges:
    """The part of ``ranges`` (indices of a fused dim) inside component ``name``, re-based to
    that component's own global numbering (the component stored as its own tensor)."""
    comp_size = dict(fusion.components)[name]
    out = []
    for g, (cs, ce) in enumerate(fusion.component_ranges(name)):
        for a, b in ranges:
            lo, hi = max(a, cs), min(b, ce)
            if lo < hi:
                base = g * comp_size - cs
                out.append((lo + base, hi + base))
    return _merge(out)


def checkpoint_indices(
    layout: ParamLayout, mesh: Mesh, coord: Sequence[int], held: tuple[Ranges, ...]
) -> tuple[Ranges, ...]:
    """The part of a rank's ``held`` indices that it stores in a checkpoint: its runtime
    block, cut further over the dims' checkpoint-only axes (torch.chunk, outer to inner)."""
    if not layout.ckpt:
        return held
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    c = dict(zip(mesh.names, coord, strict=True))
    out = []
    for r, axes in zip(held, layout.ckpt, strict=True):
        for axis in axes:
            r = _block(r, sizes[axis], c[axis])
        out.append(r)
    return tuple(out)


def storage_units(layout: ParamLayout) -> list[tuple[str | None, int | None]]:
    """What a checkpoint stores for a parameter: the whole tensor ``(None, None)``, or one
    ``(component, dim_index)`` per component of its fused dimension."""
    for i, d in enumerate(layout.dims):
        if d.fusion is not None:
            return [(name, i) for name, _ in d.fusion.components]
    return [(None, None)]


# --------------------------------------------------------------------------- sampling
#
# A check that visited every rank would cost as much as the world is large (65,536 ranks:
# seconds per parameter group). It need not: along each mesh axis, consecutive
# coordinates whose blocks are full ``torch.chunk`` blocks lying inside one run of the
# sequence they cut (no range joint, component or group boundary inside, not the tail)
# hold translations of each other's indices, and so do every finer axis's blocks within
# them. Such a run of coordinates is one *box* side; every other coordinate (a block that
# a boundary cuts, its neighbours, the tail, the first empty block) is a box of its own.
# A box of the mesh is a product of such sides. Over one box, every per-rank quantity the
# checks use is constant (local sizes, emptiness, pieces per stored unit) and every index
# set is an affine function of the coordinate, so two index sets agree on the whole box
# when they agree at its corner and one step from it along each axis.


def _chunk_specials(total: int, cuts: Iterable[int], n: int) -> set[int]:
    """Coordinates of an ``n``-way ``torch.chunk`` of a sequence of ``total`` positions
    whose block is not a full block strictly between two consecutive ``cuts``: the blocks
    holding or touching a cut or the end, their neighbours, and the first and last."""
    if n <= 1:
        return {0}
    out = {0, 1, n - 1}
    step = -(-total // n) if total else 0
    if step:
        for p in (*cuts, total):
            q = p // step
            out.update((q - 1, q, q + 1))
    return {i for i in out if 0 <= i < n}


def _cuts(r: Ranges, bounds: Iterable[int] = ()) -> list[int]:
    """Positions in the sequence ``r`` enumerates where a range ends or a global index of
    ``bounds`` falls strictly inside a range."""
    out: list[int] = []
    pos = 0
    bounds = sorted(set(bounds))
    for a, b in r:
        out.extend(pos + g - a for g in bounds if a < g < b)
        pos += b - a
        out.append(pos)
    return out


def _fusion_bounds(dim: Dim) -> tuple[int, ...]:
    f = dim.fusion
    if f is None:
        return ()
    return tuple(
        sorted({x for name, _ in f.components for r in f.component_ranges(name) for x in r})
    )


def _reps(special: set[int], n: int) -> list[int]:
    """A coordinate for each box side along an axis: each special coordinate, and the
    first of each run of ordinary ones (the one after a special)."""
    return sorted(special | {x + 1 for x in special if x + 1 < n})


def _grid(
    axes: Sequence[str], sizes: dict[str, int], samples: dict[str, set[int]]
) -> Iterable[dict[str, int]]:
    """Every combination of box-side coordinates of ``axes``."""
    return (
        dict(zip(axes, combo, strict=True))
        for combo in itertools.product(*(_reps(samples[a], sizes[a]) for a in axes))
    )


def _physical_specials(dim: Dim, sizes: dict[str, int], samples: dict[str, set[int]]) -> None:
    """Add to ``samples`` the special coordinates of ``dim_indices(dim)`` along each of its
    axes, inner axes at every sampled coordinate of the outer ones."""
    if not dim.axes:
        return
    first, n0 = dim.axes[0], sizes[dim.axes[0]]
    f = dim.fusion
    if f is None:
        samples[first] |= _chunk_specials(dim.size, (), n0)
    elif f.groups > 1:
        samples[first] |= _chunk_specials(f.groups, (), n0)
    else:
        for _, size in f.components:
            samples[first] |= _chunk_specials(size, (), n0)
    bounds = _fusion_bounds(dim)
    for k in range(1, len(dim.axes)):
        outer = Dim(dim.name, dim.size, dim.axes[:k], f)
        found: set[int] = set()
        for c in _grid(dim.axes[:k], sizes, samples):
            r = dim_indices(outer, sizes, c)
            found |= _chunk_specials(ranges_len(r), _cuts(r, bounds), sizes[dim.axes[k]])
        samples[dim.axes[k]] |= found


def _torch_specials(layout: ParamLayout, mesh: Mesh, samples: dict[str, set[int]]) -> None:
    """Add the special coordinates of DTensor's reading of the layout's placements."""
    sub = dtensor_mesh(layout, mesh)
    _placement_specials(module_shape(layout, mesh), sub, dtensor_placements(layout, mesh), samples)


def _placement_specials(
    shape: Sequence[int],
    mesh: Mesh,
    placements: Sequence[Placement],
    samples: dict[str, set[int]],
) -> None:
    """Add the special coordinates of :func:`torch_placement_indices` (``shape`` under
    ``placements`` on ``mesh``, whose axis names key ``samples``), axis by axis in mesh
    order."""
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    for t, size in enumerate(shape):
        steps = [
            (mesh.names[i], p)
            for i, p in enumerate(placements)
            if not isinstance(p, Replicate) and p.dim == t
        ]
        for k, (axis, p) in enumerate(steps):
            n = sizes[axis]
            found: set[int] = set()
            for c in _grid([a for a, _ in steps[:k]], sizes, samples):
                r: Ranges = ((0, size),) if size else ()
                for a, q in steps[:k]:
                    r = (
                        _strided(r, q.split_factor, sizes[a], c[a])
                        if isinstance(q, StridedShard)
                        else _block(r, sizes[a], c[a])
                    )
                total = ranges_len(r)
                if isinstance(p, Shard):
                    found |= _chunk_specials(total, _cuts(r), n)
                    continue
                for j in range(p.split_factor):
                    lo, hi = chunk_bounds(total, p.split_factor, j)
                    inside = [x - lo for x in _cuts(r) if lo < x < hi]
                    found |= _chunk_specials(hi - lo, inside, n)
            samples[axis] |= found


@dataclass(frozen=True)
class Box:
    """Mesh coordinates ``lo[a] <= c[a] < hi[a]`` on every axis; ``corner`` is ``lo``."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @property
    def corner(self) -> tuple[int, ...]:
        return self.lo

    @property
    def size(self) -> int:
        return math.prod(h - lo for lo, h in zip(self.lo, self.hi, strict=True))

    def steps(self) -> list[tuple[int, ...]]:
        """The corner moved one step along each axis the box is longer than 1 on, innermost
        axis first."""
        out = []
        for a in reversed(range(len(self.lo))):
            if self.hi[a] - self.lo[a] > 1:
                out.append(tuple(c + (i == a) for i, c in enumerate(self.lo)))
        return out

    def ranks(self, mesh: Mesh) -> Iterator[int]:
        """The box's ranks, in increasing order (lazily: a box may hold a million)."""

        def walk(axis: int, base: int) -> Iterator[int]:
            if axis == len(self.lo):
                yield base
                return
            for c in range(self.lo[axis], self.hi[axis]):
                yield from walk(axis + 1, base * mesh.sizes[axis] + c)

        return walk(0, 0)


@lru_cache(maxsize=4096)
def sample_boxes(layouts: tuple[ParamLayout, ...], mesh: Mesh) -> tuple[Box, ...]:
    """Boxes that cover the mesh, in rank order of their corners, such that over each box
    every layout of ``layouts`` (physically and as DTensor placements read it) gives every
    rank the same local sizes, the same empty dimensions and the same number of pieces per
    stored unit as at the corner, with indices that are affine in the coordinate (see the
    comment above). Their number depends on the layouts' shapes and boundaries, not on the
    world size. Layouts on a pipeline stage are sampled within their stage."""
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    samples: dict[str, set[int]] = {a: {0} for a in mesh.names}
    for layout in layouts:  # every stage coordinate is a box side of its own
        if layout.stage_axis is not None and layout.stage_axis in sizes:
            samples[layout.stage_axis] |= set(range(sizes[layout.stage_axis]))
    plain = [_within_stage(layout) for layout in layouts]
    while True:  # inner axes depend on outer samples, in two orders: to a fixed point
        before = sum(len(s) for s in samples.values())
        for layout in plain:
            for dim in layout.dims:
                _physical_specials(dim, sizes, samples)
            _torch_specials(layout, mesh, samples)
        if sum(len(s) for s in samples.values()) == before:
            break
    return _boxes(mesh, samples)


def _boxes(mesh: Mesh, samples: dict[str, set[int]]) -> tuple[Box, ...]:
    """The boxes whose sides start at each axis's special coordinates and the first
    ordinary coordinate after each, in rank order of their corners."""
    sides = []
    for a, n in zip(mesh.names, mesh.sizes, strict=True):
        starts = _reps(samples[a], n)
        sides.append(
            [(s, starts[i + 1] if i + 1 < len(starts) else n) for i, s in enumerate(starts)]
        )
    return tuple(
        Box(tuple(lo for lo, _ in combo), tuple(hi for _, hi in combo))
        for combo in itertools.product(*sides)
    )


@lru_cache(maxsize=4096)
def placement_boxes(
    shape: tuple[int, ...],
    mesh: Mesh,
    programs: tuple[tuple[tuple[str, ...], tuple[Placement, ...]], ...],
) -> tuple[Box, ...]:
    """:func:`sample_boxes` for DTensor placements: over each box, ``shape`` read under each
    ``(axis names, placements)`` of ``programs`` (axes of ``mesh``; the others replicate)
    gives indices affine in the coordinate."""
    samples: dict[str, set[int]] = {a: {0} for a in mesh.names}
    while True:
        before = sum(len(s) for s in samples.values())
        for names, placements in programs:
            _placement_specials(shape, mesh.submesh(names), placements, samples)
        if sum(len(s) for s in samples.values()) == before:
            return _boxes(mesh, samples)


def _within_stage(layout: ParamLayout) -> ParamLayout:
    """``layout`` read within its stage (no stage axis): its shards on a stage's ranks."""
    if layout.stage_axis is None:
        return layout
    return ParamLayout(layout.dims, layout.local, layout.ckpt)


# --------------------------------------------------------------------------- heads


@dataclass(frozen=True)
class HeadCut:
    """A shard boundary inside a head: splitting over ``axis``, the shard at ``coord`` on it
    starts (and the one at ``coord - 1`` ends) at global index ``index`` of the dimension,
    inside head ``head`` of ``component`` (``None``: of the dimension itself), whose heads
    have ``head_size`` indices. ``outer`` gives the coordinates on the dimension's earlier
    axes of the block being split (empty for its first axis)."""

    axis: str
    coord: int
    outer: tuple[tuple[str, int], ...]
    index: int
    component: str | None
    head: int  # in the component's own numbering of heads
    head_size: int
    head_start: int  # the head's first global index


# A run: a contiguous range of the dimension, ``(global start, length)``. A rank's block
# of a dimension is a tuple of runs, in the order its shard enumerates them (the order
# ``_block`` slices): one run, or one per component of a fused dimension.
_Run = tuple[int, int]


class _Heads:
    """Where a dimension's heads start: its components (one, unfused), each with a head
    size (1: none declared), repeating once per group."""

    def __init__(self, dim: Dim, heads: dict[str | None, int]) -> None:
        whole = heads.get(None, 1)
        f = dim.fusion
        comps = f.components if f is not None else ((None, dim.size),)
        self.period = f.group_size if f is not None else dim.size
        self.offsets: list[int] = []
        self.parts: list[tuple[str | None, int, int]] = []  # (component, size, head size)
        start = 0
        for name, size in comps:
            self.offsets.append(start)
            self.parts.append((name, size, heads.get(name, whole)))
            start += size
        sizes = {h for _, size, h in self.parts if size}
        # One head size over the whole dimension: every component starts a head (each
        # component's size is a multiple of its head size), so heads start every `uniform`.
        self.uniform = sizes.pop() if len(sizes) == 1 else None
        self.trivial = sizes == set() and self.uniform == 1

    def at(self, g: int) -> tuple[int, str | None, int, int, int]:
        """The component instance holding index ``g``: (its global start, component, size,
        head size, its first index in the component's own numbering)."""
        group, r = divmod(g, self.period) if self.period else (0, 0)
        k = bisect.bisect_right(self.offsets, r) - 1
        while k > 0 and not self.parts[k][1]:  # an empty component holds nothing
            k -= 1
        name, size, head = self.parts[k]
        return group * self.period + self.offsets[k], name, size, head, group * size

    def first_cut(self, g0: int, c: int, count: int) -> int | None:
        """The first ``i < count`` such that index ``g0 + c * i`` falls inside a head. Never
        per boundary: in one component (or with one head size throughout) the boundaries
        modulo the head size repeat, and two in a row cannot both start heads unless all
        do; across the components of groups they repeat within one group's worth."""
        if count <= 0:
            return None
        start, _, size, head, _ = self.at(g0)
        if g0 + c * (count - 1) < start + size or self.uniform is not None:
            h = head if self.uniform is None else self.uniform
            for i in range(min(count, 1 if c % h == 0 else 2)):
                if (g0 + c * i - start) % h:
                    return i
            return None
        for i in range(min(count, self.period // math.gcd(c, self.period))):
            start, _, _, head, _ = self.at(g0 + c * i)
            if (g0 + c * i - start) % head:
                return i
        return None

    def shape(self, runs: Sequence[_Run]) -> tuple:
        """What decides where a block's inner splits cut (its runs start on head
        boundaries once the outer splits cut none): per run its length, and the head size
        when it lies in one component or heads are uniform, else its place in a group."""
        out = []
        for g, length in runs:
            start, _, size, head, _ = self.at(g)
            if self.uniform is not None:
                out.append((length, self.uniform))
            elif g + length <= start + size:
                out.append((length, head))
            else:
                out.append((length, -1 - g % self.period))
        return tuple(out)


def _split_cut(heads: _Heads, runs: Sequence[_Run], c: int, m: int) -> tuple[int, int] | None:
    """The first boundary ``c * j`` (``0 < j < m``) between the chunks of a block that falls
    inside a head: ``(j, global index)``."""
    pos = 0
    for g, length in runs:
        lo, hi = pos // c + 1, min((pos + length - 1) // c, m - 1)
        first = c * lo - pos + g
        i = heads.first_cut(first, c, hi - lo + 1)
        if i is not None:
            return lo + i, first + c * i
        pos += length
    return None


def _slice_runs(runs: Sequence[_Run], lo: int, hi: int) -> tuple[_Run, ...]:
    """Positions ``[lo, hi)`` of the block, as runs."""
    out = []
    pos = 0
    for g, length in runs:
        a, b = max(lo, pos), min(hi, pos + length)
        if a < b:
            out.append((g + a - pos, b - a))
        pos += length
    return tuple(out)


def _chunk_candidates(heads: _Heads, runs: Sequence[_Run], c: int, m: int) -> list[int]:
    """Chunk indices whose sub-blocks have every shape the block's chunks have: a chunk
    inside one run is like the run's first such chunk (within one group's worth of them,
    across mixed head sizes), or holds the start of a run, or is the last."""
    out = {0, m - 1}
    pos = 0
    for g, length in runs:
        first = pos // c
        out.update((first, first + 1))
        start, _, size, _, _ = heads.at(g)
        if heads.uniform is None and g + length > start + size:
            cycle = heads.period // math.gcd(c, heads.period)
            out.update(range(first + 1, min(first + 1 + cycle, (pos + length) // c + 1)))
        pos += length
    return sorted(j for j in out if 0 <= j < m)


def head_cut(
    dim: Dim, axes: Sequence[str], sizes: dict[str, int], heads: dict[str | None, int]
) -> HeadCut | None:
    """Where splitting ``dim`` over ``axes`` (outer to inner; the first splits a fused
    dimension per component, or whole groups) puts a shard boundary inside a head, or
    ``None`` when every rank holds whole heads. ``heads`` maps a component (``None``: the
    dimension, or every component) to its head size, which must divide the component.

    Reasons per shard boundary and block shape, never per rank: at one level a
    dimension's blocks have few shapes (torch.chunk gives full chunks, a short one and
    empty ones), so the cost does not grow with the axes' sizes (with groups of components
    of different head sizes, it is bounded by the group's size)."""
    h = _Heads(dim, heads)
    if not axes or h.trivial or not dim.size:
        return None
    n = sizes[axes[0]]
    f = dim.fusion
    blocks: list[tuple[tuple[tuple[str, int], ...], tuple[_Run, ...]]] = []
    if f is not None and f.groups > 1:
        # Whole groups per rank: their boundaries start heads.
        m = -(-f.groups // -(-f.groups // n))
        for i in sorted({0, m - 1}):
            g0, g1 = chunk_bounds(f.groups, n, i)
            blocks.append((((axes[0], i),), ((g0 * f.group_size, (g1 - g0) * f.group_size),)))
    else:
        # Every component (the dimension, unfused) is split separately; replicated heads
        # (more ranks than heads) are held whole.
        parts = [
            (start, size)
            for start, (name, size, _) in zip(h.offsets, h.parts, strict=True)
            if size and (f is None or name is None or replicated_heads(f, name, size, n) is None)
        ]
        candidates = {0}
        for start, size in parts:
            c = -(-size // n)
            m = -(-size // c)
            found = _split_cut(h, ((start, size),), c, m)
            if found is not None:
                return _cut(h, axes[0], (), found)
            candidates.update((m - 1, m))
        for i in sorted(x for x in candidates if x < n):
            runs: list[tuple[int, int]] = []
            for start, size in parts:
                lo, hi = chunk_bounds(size, n, i)
                if lo < hi:
                    runs.append((start + lo, hi - lo))
            blocks.append((((axes[0], i),), tuple(runs)))
    for axis in axes[1:]:
        n = sizes[axis]
        seen: set[tuple] = set()
        inner = []
        for outer, block in blocks:
            total = sum(length for _, length in block)
            shape = h.shape(block)
            if not total or shape in seen:
                continue
            seen.add(shape)
            c = -(-total // n)
            m = -(-total // c)
            found = _split_cut(h, block, c, m)
            if found is not None:
                return _cut(h, axis, outer, found)
            for j in _chunk_candidates(h, block, c, m):
                inner.append(((*outer, (axis, j)), _slice_runs(block, c * j, c * (j + 1))))
        blocks = inner
    return None


def _cut(
    heads: _Heads, axis: str, outer: tuple[tuple[str, int], ...], found: tuple[int, int]
) -> HeadCut:
    j, index = found
    start, name, _, head, base = heads.at(index)
    into = (index - start) % head
    return HeadCut(axis, j, outer, index, name, (base + index - start) // head, head, index - into)


# The rule of a persistent buffer that no rule matches: whole on every rank, whatever its
# rank (FSDP2 and torch's tensor-parallel styles leave buffers as plain tensors).
WHOLE = RuleSpec(pattern="**", dims=(), any_rank=True)
