"""Per Hugging Face name, the layout one side of a weight transfer declares to the other:
what vLLM's nccl-m2n RFC (vllm-project/vllm#46439, PR #51520) and pytorch#181061's M-to-N
primitive ask each side to state, computed from the compiled spec alone (no collective,
no model needed for :func:`get_sharding`).

* :func:`get_sharding` ``(spec, hf, hf_name, mesh)``: a plain, JSON-able description of
  where every element of HF tensor ``hf_name`` lies on every rank of this side: the mesh
  (axis names, sizes, ``start_rank`` in a group that holds both sides), DTensor
  ``placements`` of the HF tensor over that mesh in torch's vocabulary (``Shard(0)``,
  ``Replicate()``, ``_StridedShard(0, sf=2)``) when plain placements describe it exactly,
  else ``None``; per HF dimension, the parameter dimension it lies along, the mesh axes
  that shard that dimension (outer to inner), and whether it is a fused component, a part
  of a fused HF tensor (``split``), permuted (``rope``), padded; the HF shape, the HF
  dtype and the model's dtype; and per rank its ``box``: the HF indices it holds, per
  dimension, as sorted ``[start, stop)`` runs (what the consumer intersects, whatever the
  placements).
* :func:`local_view` ``(spec, hf, model, hf_name, mesh)``: on this rank, a
  :class:`LocalView` of the model's local tensor holding its part of ``hf_name``: its
  ``box`` (as above), ``tensor`` (a torch view of those elements in HF index order,
  where one exists: no rope permutation, no fused rows out of order) and ``read(box)`` /
  ``write(data, box)`` for any sub-box in HF index order, which work in every case.

Both read the same arithmetic as the transfer planner and ``load_hf``
(:func:`shardspec.core.transfer.holdings`, :func:`shardspec.core.hfmap.source_indices`).
A layout with a dimension indexed by a module's name (experts as one module each) is not
described yet (:class:`InteropError`, as the planner's SS127).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardspec.core.hfmap import HFMap, Source, fused_of, padded_dims, unit_names
from shardspec.core.layout import (
    Dim,
    Mesh,
    ParamLayout,
    dtensor_mesh,
    dtensor_placements,
    torch_placement_indices,
)
from shardspec.core.transfer import Holding, holdings, merged_holding
from shardspec.runtime.spec import CompiledSpec, SpecError

if TYPE_CHECKING:
    import torch

__all__ = ["InteropError", "LocalView", "get_sharding", "hf_names", "local_view"]

FORMAT = "shardspec-sharding/1"

# Safetensors dtype names -> torch's.
_TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class InteropError(SpecError):
    """An HF name this side cannot describe: unknown, dropped, or of a layout not
    supported yet."""


@dataclass(frozen=True)
class _Unit:
    """Where HF tensor ``key`` lives on this side: parameter ``param`` (global name),
    its component (a fused dimension's), its source, layout and mesh."""

    key: str
    param: str
    component: str | None
    source: Source
    layout: ParamLayout
    mesh: Mesh


def _side_mesh(spec: CompiledSpec, mesh: Any) -> Mesh:
    """A layout mesh from a DeviceMesh, a dict of sizes (axes left out: as the spec's
    defaults size them), a Mesh, or None (the mesh last built, else the default sizes)."""
    if mesh is None:
        mesh = spec.last_mesh
    if mesh is None:
        mesh = spec.sizes()
    elif isinstance(mesh, Mapping) and any(
        not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in mesh.values()
    ):
        raise InteropError(
            f"mesh sizes {dict(mesh)}: every axis's size must be a positive integer",
            None,
            f"pass sizes of spec {spec.name!r}'s axes ({', '.join(spec.axes)}), or a DeviceMesh",
        )
    elif isinstance(mesh, Mapping) and spec.views is None and set(mesh) != set(spec.axes):
        mesh = spec.sizes(**mesh)  # the other axes: their defaults, the rest axis the rest
    return spec.layout_mesh(mesh)


def _resolve(spec: CompiledSpec, hf: HFMap, hf_name: str, lm: Mesh) -> tuple[str, list[_Unit]]:
    """The key whose layout ``hf_name`` has (itself, or the source of a ``tie``) and the
    units it comes from (several for a fused HF tensor: one per component)."""
    key = hf_name
    if not hf.consumers(key) and (tied := hf.tie_of(key)) is not None:
        key = tied
    found = hf.consumers(key)
    if not found:
        why = "is dropped by" if hf.dropped(hf_name) else "is no tensor of"
        raise InteropError(
            f"{hf_name!r} {why} spec {spec.name!r}'s hf block",
            None,
            "ask for a name the hf block maps (hf_names() lists them)",
        )
    out: list[_Unit] = []
    for rule, name, _ in found:
        fqn = name
        if spec.params is not None and name not in spec.params and not spec.stores_buffer(name):
            fqn = name.rpartition(".")[0]  # a component of a fused parameter
        layout = spec.layout(fqn, lm)
        if any(d.name_indexed for d in layout.dims):
            raise InteropError(
                f"{hf_name!r}: parameter {fqn!r} has a dimension indexed by the module's name, "
                "which cannot be described per HF name yet",
                "SS127",
                "hold the experts as one stacked parameter (a `[e]` map line)",
            )
        fused = fused_of(layout.dims)
        for unit, shape in unit_names(fqn, layout.dims, ()):
            if hf.kept(unit):
                continue
            for src in hf.sources(unit, shape, fused):
                if src.rule == rule and key in src.keys:
                    comp = unit.rpartition(".")[2] if fused is not None and unit != fqn else None
                    out.append(_Unit(key, fqn, comp, src, layout, spec.mesh_of(fqn, lm)))
    if not out:
        raise InteropError(f"{hf_name!r}: no parameter of spec {spec.name!r} holds it")
    return key, out


def _holdings(units: Sequence[_Unit], ranks: Sequence[int] | None = None) -> dict[int, Holding]:
    """Every rank's holding of the units' key (one per rank, components merged)."""
    per_rank: dict[int, list[Holding]] = {}
    for u in units:
        for h in holdings(u.param, u.layout, u.mesh, u.component, u.source, ranks).get(u.key, []):
            per_rank.setdefault(h.rank, []).append(h)
    return {r: merged_holding(hs) for r, hs in sorted(per_rank.items())}


def _box(h: Holding | None, ndim: int) -> list[list[list[int]]]:
    """Per HF dimension, the sorted ``[start, stop)`` runs of the HF indices held."""
    if h is None:
        return [[] for _ in range(ndim)]
    return [[[a, b] for a, b in ax.ranges()] for ax in h.axes]


def _placements(u: _Unit, held: Mapping[int, Holding], shape: Sequence[int]) -> list[str] | None:
    """DTensor placements of the HF tensor over the parameter's DTensor mesh, where the
    same axes sharding the same dims as plain (torch) blocks give every rank exactly its
    elements; None otherwise (fused, padded, stacked, or FSDP inside a component)."""
    if u.source.stacked:
        return None
    first = next(iter(held.values()), None)
    if first is None:
        return None
    dims = tuple(
        Dim(f"hf{k}", n, u.layout.dims[ax.dim].axes)
        for k, (n, ax) in enumerate(zip(shape, first.axes, strict=True))
    )
    candidate = ParamLayout(
        dims, u.layout.local, stage_axis=u.layout.stage_axis, stages=u.layout.stages
    )
    sub = dtensor_mesh(candidate, u.mesh)
    places = dtensor_placements(candidate, sub)
    for rank, coord in enumerate(u.mesh.coords()):
        if not candidate.on_stage(u.mesh, coord):
            if rank in held:
                return None
            continue
        c = dict(zip(u.mesh.names, coord, strict=True))
        want = torch_placement_indices(shape, sub, places, [c[n] for n in sub.names])
        got = _box(held.get(rank), len(shape))
        if [[list(r) for r in w] for w in want] != got:
            return None
    return [_torch_name(p) for p in places]


def _torch_name(p: object) -> str:
    """A placement as torch prints it."""
    name = type(p).__name__
    if name == "StridedShard":
        return f"_StridedShard({p.dim}, sf={p.split_factor})"  # type: ignore[attr-defined]
    if name == "Shard":
        return f"Shard({p.dim})"  # type: ignore[attr-defined]
    return "Replicate()"


def get_sharding(
    spec: CompiledSpec, hf: HFMap, hf_name: str, mesh: Any = None, *, start_rank: int = 0
) -> dict[str, Any]:
    """How this side holds HF tensor ``hf_name`` on ``mesh`` (a DeviceMesh, a dict of axis
    sizes, or None: the mesh last built, else the spec's default sizes): see the module
    docstring. ``start_rank``: this side's first rank in a group that holds both sides
    (trainer ``0``, engine ``T``). A tied name (``tie lm_head.weight = ...``) is described
    by its source's layout, with ``tied_to``. Raises :class:`InteropError`."""
    lm = _side_mesh(spec, mesh)
    key, units = _resolve(spec, hf, hf_name, lm)
    held = _holdings(units)
    u = units[0]
    shape = u.source.shape
    first = next(iter(held.values()), None)
    rule = hf.rules[u.source.rule]
    pads = {d: t.multiple for d, t in padded_dims(len(shape), u.source.transforms)}
    dims = []
    for k, n in enumerate(shape):
        d = first.axes[k].dim if first is not None else k
        pdim = u.layout.dims[d]
        fusion = pdim.fusion
        split = u.source.split if u.source.split is not None and u.source.split.dim == k else None
        dims.append(
            {
                "size": n,
                "param_dim": d,
                "param_size": pdim.size,
                "shard": list(pdim.axes),
                "fused": None
                if fusion is None or u.component is None or len(units) > 1
                else {
                    "component": u.component,
                    "components": [[c, s * fusion.groups] for c, s in fusion.components],
                    "groups": fusion.groups,
                },
                "split": None
                if split is None
                else {"components": [x.component for x in units], "groups": split.groups},
                "permuted": any(h.axes[k].permuted for h in held.values()),
                "padded_to": pdim.size if d - (1 if u.source.stacked else 0) in pads else None,
            }
        )
    names = list(u.mesh.names)  # (with views: the parameter's view's)
    return {
        "format": FORMAT,
        "hf_name": hf_name,
        "tied_to": key if key != hf_name else None,
        "spec": spec.name,
        "param": u.param,
        "stack_index": u.source.keys.index(key) if u.source.stacked else None,
        "shape": list(shape),
        "hf_dtype": _TORCH_NAMES.get(rule.dtypes[0], rule.dtypes[0]) if rule.dtypes else None,
        "dtype": _model_dtype(spec, u.param),
        "transforms": [str(t) for t in u.source.transforms],
        "mesh": {"dim_names": names, "shape": list(u.mesh.sizes), "start_rank": start_rank},
        "placement_dims": list(dtensor_mesh(u.layout, u.mesh).names),
        "placements": _placements(u, held, shape),
        "dims": dims,
        "ranks": [
            {
                "rank": r,
                "coord": list(u.mesh.coord_of(r)),
                "box": _box(held.get(r), len(shape)),
                "count": held[r].count if r in held else 0,
            }
            for r in range(lm.world)
        ],
    }


def _model_dtype(spec: CompiledSpec, fqn: str) -> str | None:
    if spec.params is None:
        return None
    entry = spec.params.get(fqn) or (spec.buffers[fqn] if spec.stores_buffer(fqn) else None)
    return entry.dtype if entry is not None else None


def hf_names(spec: CompiledSpec, hf: HFMap, mesh: Any = None) -> list[str]:
    """Every HF name this side holds (sorted; tied aliases not listed), from the manifest."""
    if spec.params is None:
        raise InteropError(f"spec {spec.name!r} has no manifest: its HF names are not known")
    lm = _side_mesh(spec, mesh)
    out: set[str] = set()
    for fqn in [*spec.params, *spec.buffers]:
        if spec.is_ignored(fqn):
            continue
        layout = spec.layout(fqn, lm)
        if any(d.name_indexed for d in layout.dims):
            continue
        fused = fused_of(layout.dims)
        for unit, shape in unit_names(fqn, layout.dims, ()):
            if not hf.kept(unit):
                for src in hf.sources(unit, shape, fused):
                    out.update(src.keys)
    return sorted(out)


# ------------------------------------------------------------------------------ local views


@dataclass
class LocalView:
    """This rank's part of one HF tensor in its model: ``box`` (per HF dimension, the
    sorted ``[start, stop)`` runs of HF indices held; a dimension with no runs: nothing
    held), the local tensor ``local`` (``DTensor.to_local()`` of parameter ``param``) and
    how the box lies in it. ``tensor``: a view of ``local`` holding the box in HF index
    order (HF dimension order), or None where no strided view does (rope-permuted rows,
    fused components out of order); :meth:`read` and :meth:`write` work in every case."""

    hf_name: str
    param: str
    box: list[list[list[int]]]
    local: torch.Tensor
    fixed: tuple[tuple[int, int], ...]
    dims: tuple[int, ...]  # per HF dimension, the local dimension it lies along
    where: tuple[dict[int, int], ...]  # per HF dimension, HF index -> local position
    tensor: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, ...]:
        """The box's shape (per HF dimension, the number of indices held)."""
        return tuple(sum(b - a for a, b in d) for d in self.box)

    def _index(self, box: Sequence[Sequence[Sequence[int]]] | None) -> tuple[Any, ...]:
        """Advanced indices into the fixed-selected local tensor, in HF dimension order."""
        import torch

        box = self.box if box is None else box
        if not isinstance(box, Sequence) or len(box) != len(self.dims):
            raise InteropError(f"{self.hf_name}: a box of {box!r} for {len(self.dims)} dims")
        k = len(self.dims)
        local_dims = self._selected_dims()
        idx: list[Any] = [None] * k
        for j, (runs_, where) in enumerate(zip(box, self.where, strict=True)):
            try:
                pos = [where[i] for a, b in runs_ for i in range(a, b)]
            except KeyError as e:
                raise InteropError(
                    f"{self.hf_name}: HF index {e.args[0]} of dim {j} is not held on this rank"
                ) from None
            except (TypeError, ValueError):
                raise InteropError(
                    f"{self.hf_name}: dim {j} of the box is {runs_!r}, not [start, stop) runs "
                    "of integers"
                ) from None
            shape = [1] * k
            shape[j] = -1
            idx[local_dims[j]] = torch.tensor(pos, dtype=torch.long).reshape(shape)
        return tuple(idx)

    def _selected_dims(self) -> list[int]:
        """Per HF dimension, its dimension in :meth:`_selected`'s tensor."""
        gone = sorted(d for d, _ in self.fixed)
        return [d - sum(1 for g in gone if g < d) for d in self.dims]

    def _selected(self) -> torch.Tensor:
        """The local tensor with the fixed dimensions (a stacked expert's) selected."""
        t = self.local
        for d, p in sorted(self.fixed, reverse=True):
            t = t.select(d, p)
        return t

    def read(self, box: Sequence[Sequence[Sequence[int]]] | None = None) -> torch.Tensor:
        """A copy of the elements at HF indices ``box`` (default: all held), in HF index
        order."""
        return self._selected()[self._index(box)]

    def write(
        self, data: torch.Tensor, box: Sequence[Sequence[Sequence[int]]] | None = None
    ) -> None:
        """Write ``data`` (HF index order, the box's shape) into the elements at HF
        indices ``box`` (default: all held), in place."""
        import torch

        with torch.no_grad():
            self._selected()[self._index(box)] = data.to(self.local.dtype)


def _strided_view(t: torch.Tensor, dims: Sequence[int], pos: Sequence[Sequence[int]]) -> Any:
    """``t`` (fixed dims selected) narrowed to positions ``pos`` per HF dim and permuted
    into HF order, where each dim's positions are one arithmetic progression; else None."""
    for d, p in zip(dims, pos, strict=True):
        if not p:
            return None
        step = p[1] - p[0] if len(p) > 1 else 1
        if step < 1 or list(p) != list(range(p[0], p[0] + step * len(p), step)):
            return None
        idx: list[Any] = [slice(None)] * t.dim()
        idx[d] = slice(p[0], p[-1] + 1, step)
        t = t[tuple(idx)]
    return t.permute(tuple(dims))


def local_view(
    spec: CompiledSpec,
    hf: HFMap,
    model: Any,
    hf_name: str,
    mesh: Any = None,
    *,
    rank: int | None = None,
) -> LocalView:
    """This rank's :class:`LocalView` of HF tensor ``hf_name`` in ``model`` (an
    ``nn.Module`` or a state dict; DTensor parameters are read through ``to_local()``).
    ``mesh``: the side's DeviceMesh (this rank: its coordinate), or sizes with ``rank``
    (a one-rank engine: no mesh at all). No collective. Raises :class:`InteropError`."""
    lm = _side_mesh(spec, mesh)
    if rank is None:
        mesh = mesh if mesh is not None else spec.last_mesh
        coord = mesh.get_coordinate() if hasattr(mesh, "get_coordinate") else None
        if coord is None and lm.world != 1:
            raise InteropError(
                f"local_view({hf_name!r}): which rank? pass the side's DeviceMesh, or rank="
            )
        rank = lm.rank_of(coord) if coord is not None else 0
    _, units = _resolve(spec, hf, hf_name, lm)
    h = _holdings(units, [rank]).get(rank)
    u = units[0]
    shape = u.source.shape
    name = u.param
    sp = spec.stage_plan(lm)
    if sp is not None:
        stage = spec.stage_of(lm, lm.coord_of(rank))
        name = sp.local_name(name, stage) or name
    tensors = model if isinstance(model, Mapping) else dict(model.state_dict(keep_vars=True))
    if h is None:  # nothing of it on this rank (another pipeline stage's model lacks it)
        import torch

        local = _to_local(tensors[name]) if name in tensors else torch.empty(0)
        return LocalView(hf_name, name, _box(None, len(shape)), local, (), (), (), None)
    if name not in tensors:
        raise InteropError(
            f"local_view({hf_name!r}): the model has no {name!r} (rank {rank})",
            None,
            "pass the model this side's spec describes, on this rank",
        )
    local = _to_local(tensors[name])
    order = [ax.pairs() for ax in h.axes]
    where = tuple(dict(o) for o in order)
    dims = tuple(ax.dim for ax in h.axes)
    lv = LocalView(hf_name, name, _box(h, len(shape)), local, h.fixed, dims, where, None)
    lv.tensor = _strided_view(
        lv._selected(), lv._selected_dims(), [[p for _, p in o] for o in order]
    )
    return lv


def _to_local(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
