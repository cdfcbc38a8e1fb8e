"""``parallelize``, ``verify``, ``tp_plan`` and ``shard_placement_fn``: the spec as a
trainer's parallelization, with torch's own tensor parallelism and FSDP2.

* :func:`tp_plan` gives ``parallelize_module`` a plan of :class:`SpecColwise` /
  :class:`SpecRowwise` styles (subclasses of torch's ``ColwiseParallel`` /
  ``RowwiseParallel``) that cut each parameter exactly as the spec does on the TP axis,
  fused per component included, with torch's own input and output redistribution.
* :func:`shard_placement_fn` tells ``fully_shard`` which dimension the spec shards over its
  fsdp axis.
* :func:`parallelize` applies both (FSDP2 per block, the root last) and checks the result
  with :func:`verify`.
* :func:`verify` checks a model parallelized by any means against the spec. It compares
  layouts, not spellings: each DTensor's (mesh axes, placements) is read with DTensor's own
  semantics into per-rank index sets and compared with the spec's, so FSDP2's ``Shard(0)``
  on a 1-D ``dp_shard`` mesh equals ``(Shard(0), Replicate())`` on ``(dp_shard, tp)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import _StridedShard

from shardspec.core import layout as core
from shardspec.core.layout import (
    Mesh,
    ParamLayout,
    dtensor_mesh,
    dtensor_placements,
    module_shape,
    ranges_len,
    same_layout,
    torch_placement_indices,
)
from shardspec.core.styles import (
    EMBEDDING,
    LINEAR,
    custom_module_hint,
    derive,
    forward_class,
    qualified_name,
    runs_torch_forward,
    why_not_torch,
)
from shardspec.runtime.dtensor import _contiguous_stride, layout_of, submesh, take, to_torch
from shardspec.runtime.spec import CompiledSpec, SpecError
from shardspec.runtime.user_styles import fmt_ranges, style_problems

# --------------------------------------------------------------------------- placements


def _mesh_names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class ParamPlan:
    """One parameter's spec layout, and where its axes go."""

    fqn: str
    layout: ParamLayout
    placements: tuple[core.Placement, ...]  # on ``names``
    names: tuple[str, ...]  # the DTensor's mesh axes (the spec's axes minus local ones)
    global_fqn: str = ""  # the whole model's name (a pipeline stage's model may renumber)
    # The name its rule (and style) go by: the global name, or a pipeline tie's alias.
    rule_fqn: str = ""

    def on(self, axis: str) -> core.Placement:
        return self.placements[self.names.index(axis)] if axis in self.names else core.REPLICATE

    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(
            n
            for n, p in zip(self.names, self.placements, strict=True)
            if not isinstance(p, core.Replicate)
        )


def plan_params(
    spec: CompiledSpec, model: nn.Module, lmesh: Mesh, mesh: DeviceMesh | None = None
) -> tuple[dict[str, ParamPlan], dict[str, str]]:
    """Every non-ignored parameter's plan by FQN (the model's own names), and tied aliases
    (alias -> FQN planned; ignored names of a planned tensor included: GPT-2's spec ignores
    its tied head, whose module still holds the embedding's weight). A pipeline stage's
    model is planned under the whole model's names (``mesh``, the DeviceMesh, says which
    stage this rank is).

    Raises :class:`SpecError` naming every parameter that does not fit."""
    table = spec.table(lmesh)
    named = list(model.named_parameters(remove_duplicate=False))
    gname: dict[str, str] = {}
    rname: dict[str, str] = {}
    if spec.pipeline is not None:
        coord = mesh.get_coordinate() if mesh is not None else None
        if coord is None:
            raise SpecError("a pipeline stage's model needs this rank's DeviceMesh")
        own = [f for f, _ in model.named_parameters()]
        gname = spec.global_names(own, lmesh, coord)
        rname = spec.global_names(own, lmesh, coord, ties=False)
    counts = spec.name_indexed_counts_of(f for f, _ in named) if table is None else {}
    plans: dict[str, ParamPlan] = {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    errors: list[str] = []
    ignored: list[tuple[str, nn.Parameter]] = []
    for fqn, p in named:
        if spec.is_ignored(fqn):
            ignored.append((fqn, p))
            continue
        if id(p) in first:
            aliases[fqn] = first[id(p)]
            continue
        first[id(p)] = fqn
        try:
            layout = spec.layout(gname.get(fqn, fqn), lmesh, tuple(p.shape), counts.get(fqn))
        except SpecError as e:
            errors.append(str(e))
            continue
        sub = dtensor_mesh(layout, lmesh)
        plans[fqn] = ParamPlan(
            fqn,
            layout,
            dtensor_placements(layout, lmesh),
            sub.names,
            gname.get(fqn, fqn),
            rname.get(fqn, fqn),
        )
    aliases.update((fqn, first[id(p)]) for fqn, p in ignored if id(p) in first)
    if table is not None and spec.pipeline is None:  # (stages: global_names checked)
        seen = {f for f, _ in named}
        missing = sorted(f for f in table if f not in seen and not spec.is_ignored(f))
        if missing:
            errors.append(
                f"the model lacks {len(missing)} parameter(s) of the manifest, e.g. {missing[0]!r}"
            )
    if errors:
        raise SpecError("the model does not fit the spec:\n  " + "\n  ".join(errors))
    return plans, aliases


# --------------------------------------------------------------------------- verify


def layout_problem(
    plan: ParamPlan, value: torch.Tensor, lmesh: Mesh, mesh: DeviceMesh
) -> str | None:
    """Why ``value`` does not hold ``plan``'s layout on this rank's mesh, or ``None``."""
    want_shape = module_shape(plan.layout, lmesh)
    if tuple(value.shape) != want_shape:
        return f"global shape {list(value.shape)}, the spec's is {list(want_shape)}"
    if isinstance(value, DTensor):
        dmesh = value.device_mesh
        names = _mesh_names(dmesh)
        if not names:
            return "its DTensor's mesh has no axis names; build meshes from the spec's mesh"
        unknown = [n for n in names if n not in plan.names]
        if unknown:
            local = [n for n in unknown if n in plan.layout.local]
            why = (
                f"{local} is local to this parameter (its module holds its shard, so no "
                "DTensor spans it)"
                if local
                else f"{unknown} is not an axis of the spec's mesh {lmesh.names}"
            )
            return f"its DTensor spans mesh axes {names}; {why}"
        if not _same_group(dmesh, mesh, names):
            return f"its DTensor mesh {names} groups other ranks than the spec mesh's {names}"
        _, got = layout_of(value)
        if got is None:
            return f"placements {tuple(value.placements)} (partial values are not a layout)"
        placements_a: tuple[core.Placement, ...] = got
    else:
        names, placements_a = (), ()
    sub = dtensor_mesh(plan.layout, lmesh)
    bad = same_layout(want_shape, sub, plan.placements, names, placements_a)
    if bad is None:
        return None
    coord, want, have = bad
    desc = _describe(names, placements_a) if names else "a plain tensor (the whole parameter)"
    return (
        f"{desc}, but the spec says {_describe(plan.names, plan.placements)}: mesh "
        f"coordinate {dict(zip(sub.names, coord, strict=True))} would hold {fmt_ranges(have)}, "
        f"the spec gives it {fmt_ranges(want)}"
    )


def _describe(names: Iterable[str], placements: Iterable[core.Placement]) -> str:
    return "(" + ", ".join(f"{n}={p}" for n, p in zip(names, placements, strict=True)) + ")"


def _same_group(dmesh: DeviceMesh, mesh: DeviceMesh, names: tuple[str, ...]) -> bool:
    """Whether ``dmesh`` (axes ``names``) groups this rank with the same ranks, in the same
    order, as the spec mesh's sub-mesh over ``names``."""
    full = mesh.mesh
    full_names = _mesh_names(mesh)
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    index: list[Any] = []
    for n, c in zip(full_names, coord, strict=True):
        index.append(slice(None) if n in names else c)
    group = full[tuple(index)]
    kept = [n for n in full_names if n in names]
    group = group.permute([kept.index(n) for n in names]) if len(names) > 1 else group
    return bool(torch.equal(group.cpu(), dmesh.mesh.cpu()))


def refuse_views(spec: CompiledSpec, what: str) -> None:
    """Raise before anything changes: ``what`` does not take a spec with views yet."""
    if spec.views is not None:
        raise SpecError(
            f"{what} does not take spec {spec.name!r} yet: it has views "
            f"({', '.join(spec.views.names)}), and {what} runs one mesh",
            None,
            "distribute(model, build_mesh()) places every parameter on its view's DeviceMesh, "
            "and save/load move checkpoints between folds; parallelize and verify on views "
            "come next (issue 21)",
        )


def mismatches(spec: CompiledSpec, model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Every parameter of ``model`` whose layout differs from the spec's, one line each."""
    refuse_views(spec, "verify")
    lmesh = spec.layout_mesh(mesh)
    if mesh.get_coordinate() is None:
        raise SpecError("this rank is not part of the mesh")
    plans, _ = plan_params(spec, model, lmesh, mesh)
    out = []
    params = dict(model.named_parameters())
    for fqn, plan in plans.items():
        problem = layout_problem(plan, params[fqn], lmesh, mesh)
        if problem is not None:
            out.append(f"{fqn}: {problem}")
    return out


def verify(spec: CompiledSpec, model: nn.Module, mesh: DeviceMesh) -> None:
    """Raise one :class:`SpecError` naming every parameter whose layout (mesh axes,
    placements, local shape and global offset on every rank) differs from the spec."""
    bad = mismatches(spec, model, mesh)
    if bad:
        raise SpecError(
            f"{len(bad)} parameter(s) are not on spec {spec.name!r}'s layout:\n  "
            + "\n  ".join(bad),
            "SS031",
        )


# --------------------------------------------------------------------------- TP styles


def _cut(value: torch.Tensor, mesh: DeviceMesh, placement: core.Placement) -> DTensor:
    """``value`` (the module's whole tensor, possibly on meta) cut for this rank of the 1-D
    ``mesh`` by ``placement``, with no communication."""
    n = mesh.size()
    coord = mesh.get_coordinate()
    assert coord is not None
    idx = torch_placement_indices(tuple(value.shape), Mesh(("tp",), (n,)), (placement,), coord)
    if value.is_meta:
        local = torch.empty([ranges_len(r) for r in idx], dtype=value.dtype, device="meta")
    else:
        local = take(value, idx)
        if local.device.type != mesh.device_type:
            local = local.to(mesh.device_type)
    return DTensor.from_local(
        local,
        mesh,
        [to_torch(placement)],
        run_check=False,
        shape=value.shape,
        stride=_contiguous_stride(value.shape),
    )


def _partition(style: Any, module: nn.Module, mesh: DeviceMesh) -> None:
    for leaf, param in list(module.named_parameters(recurse=False)):
        placement = style.param_placements.get(leaf, core.REPLICATE)
        dt = _cut(param.detach(), mesh, placement)
        module.register_parameter(leaf, nn.Parameter(dt, requires_grad=param.requires_grad))


class _SpecCut:
    """Cuts a module's parameters as the spec says (``param_placements``: leaf -> layout
    placement on the TP axis), in place of torch's own partition functions."""

    param_placements: dict[str, core.Placement]

    def _partition_linear_fn(self, name, module, device_mesh):
        _partition(self, module, device_mesh)

    def _partition_embedding_fn(self, name, module, device_mesh):
        _partition(self, module, device_mesh)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.param_placements})"


class SpecColwise(_SpecCut, ColwiseParallel):
    """torch's ``ColwiseParallel`` (input and output layouts, hooks), with each parameter
    cut as the spec says: per component for a fused dimension (``_StridedShard``), not the
    contiguous ``Shard(0)`` that would hand one TP rank all of gate and none of up."""

    def __init__(self, param_placements: Mapping[str, core.Placement], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.param_placements = dict(param_placements)


class SpecRowwise(_SpecCut, RowwiseParallel):
    """torch's ``RowwiseParallel`` with each parameter cut as the spec says."""

    def __init__(self, param_placements: Mapping[str, core.Placement], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.param_placements = dict(param_placements)


class SpecPlaced(_SpecCut, ParallelStyle):
    """`style none`: the parameters cut as the spec says, and nothing else: the module's
    own forward handles its shards (an expert-parallel MoE, say)."""

    def __init__(self, param_placements: Mapping[str, core.Placement]) -> None:
        super().__init__()
        self.param_placements = dict(param_placements)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _partition(self, module, device_mesh)
        return module


_LAYOUTS = {"replicate": Replicate(), "sequence": Shard(1), "features": Shard(-1)}


def _style_for(
    fqn: str,
    module: nn.Module,
    leaves: Mapping[str, ParamPlan],
    tp_axis: str,
    stated: Mapping[str, Any] | None,
) -> ParallelStyle | None:
    """The style of ``module`` from its parameters' placements on ``tp_axis`` (and the
    spec's stated style, which the compiler checked against them)."""
    placements = {leaf: plan.on(tp_axis) for leaf, plan in leaves.items()}
    stated = dict(stated or {})
    kind = stated.pop("kind", None)
    stated.pop("derived", None)
    sharded = {leaf: p for leaf, p in placements.items() if not isinstance(p, core.Replicate)}
    if kind == "sequence_parallel":
        if sharded:
            raise SpecError(f"{fqn}: sequence parallelism needs parameters replicated over tp")
        return SequenceParallel(**_style_kwargs(stated, sequence=True))
    if not sharded:
        return None
    if kind == "none":
        return SpecPlaced(placements)
    module_kind = (
        LINEAR
        if isinstance(module, nn.Linear)
        else EMBEDDING
        if isinstance(module, nn.Embedding)
        else type(module).__name__
    )
    kinds = {
        kind
        for leaf, p in placements.items()
        if (kind := derive(module_kind, leaf, None if isinstance(p, core.Replicate) else p.dim))
        is not None
    }
    derived = kinds.pop() if len(kinds) == 1 else "?"
    bias = placements.get("bias")
    if derived == "colwise" and module_kind == LINEAR and isinstance(bias, core.Replicate):
        raise SpecError(
            f"{fqn}: a column-parallel Linear whose bias is replicated over {tp_axis!r}: each "
            "rank's output columns need their own slice of the bias; shard the bias's out "
            f"dimension over {tp_axis!r} too"
        )
    if derived == "?":
        raise SpecError(
            f"{fqn}: a {type(module).__name__} whose parameters {sorted(sharded)} are sharded "
            f"over {tp_axis!r}: no tensor-parallel style derives from that (Linear and "
            "Embedding weights do); give the module a style with the `styles` option, or keep "
            f"its parameters replicated over {tp_axis!r}"
        )
    if kind not in (None, derived):
        raise SpecError(
            f"{fqn}: the spec states style {kind}, but its placements make it {derived}"
        )
    forward = qualified_name(forward_class(type(module)))
    if not runs_torch_forward(forward):
        style = "ColwiseParallel" if derived == "colwise" else "RowwiseParallel"
        raise SpecError(
            f"{fqn}: the spec gives it torch's {style}, but "
            + why_not_torch(qualified_name(type(module)), forward, style)
            + f"; {custom_module_hint(lint=False)}",
            "SS038",
        )
    kwargs = _pattern_kwargs(stated, derived, placements)
    if isinstance(module, nn.Embedding):
        # Token ids are whole on every TP rank (torch's RowwiseParallel would read them as
        # Shard(-1) and all-gather them).
        kwargs.setdefault("input_layouts", Replicate())
    cls = SpecColwise if derived == "colwise" else SpecRowwise
    return cls(placements, **kwargs)


def _style_kwargs(stated: Mapping[str, Any], sequence: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if sequence:
        if "local" in stated:
            out["use_local_output"] = bool(stated["local"])
        return out
    if "input" in stated:
        out["input_layouts"] = _LAYOUTS[stated["input"]]
    if "output" in stated:
        out["output_layouts"] = _LAYOUTS[stated["output"]]
    if "local" in stated:
        out["use_local_output"] = bool(stated["local"])
    return out


def tp_axes(spec: CompiledSpec) -> tuple[str, ...]:
    """The model-parallel axes: every axis but the fsdp one."""
    return tuple(a for a in spec.axes if a != spec.fsdp_axis)


def _owner(fqn: str) -> tuple[str, str]:
    owner, _, leaf = fqn.rpartition(".")
    return owner, leaf


def build_tp_plan(
    spec: CompiledSpec,
    model: nn.Module,
    lmesh: Mesh,
    plans: Mapping[str, ParamPlan],
    styles: Mapping[str, Any] | None = None,
) -> tuple[str | None, dict[str, Any]]:
    """(the TP axis, {module FQN: ParallelStyle}) for ``model``. At most one axis is TP:
    ``parallelize_module`` takes a 1-D mesh."""
    by_module: dict[str, dict[str, ParamPlan]] = {}
    for fqn, plan in plans.items():
        owner, leaf = _owner(fqn)
        by_module.setdefault(owner, {})[leaf] = plan
    candidates = [a for a in tp_axes(spec) if lmesh.size(a) > 1] or list(tp_axes(spec))
    used: set[str] = set()
    for leaves in by_module.values():
        for plan in leaves.values():
            used.update(a for a in plan.sharded_axes() if a != spec.fsdp_axis)
    if len(used) > 1:
        raise SpecError(
            f"parameters are sharded over several model-parallel axes {sorted(used)}; "
            "parallelize applies tensor parallelism on one axis (torch's parallelize_module "
            "takes a 1-D mesh)"
        )
    axis = next(iter(used)) if used else (candidates[0] if candidates else None)
    plan_out: dict[str, Any] = {}
    if axis is None:
        if styles:
            raise SpecError(
                f"styles: the spec's mesh {lmesh.names} has no model-parallel axis to apply "
                f"them on ({', '.join(map(repr, styles))})"
            )
        return None, plan_out
    errors = []
    for owner, leaves in by_module.items():
        if owner in (styles or {}):
            plan_out[owner] = styles[owner]  # type: ignore[index]
            continue
        stated = spec.style_of(next(iter(leaves.values())).rule_fqn)
        module = model.get_submodule(owner) if owner else model
        try:
            style = _style_for(owner or "<root>", module, leaves, axis, stated)
        except SpecError as e:
            errors.append(str(e))
            continue
        if style is not None:
            plan_out[owner] = style
    # Styles for modules that hold no parameter of the spec (PrepareModuleInput on a
    # block, say) are the caller's to add; each must name a module of the model.
    for owner, style in (styles or {}).items():
        if owner in plan_out:
            continue
        try:
            model.get_submodule(owner)
        except AttributeError:
            errors.append(f"styles: the model has no module {owner!r}")
            continue
        plan_out[owner] = style
    if errors:
        raise SpecError("no tensor-parallel plan:\n  " + "\n  ".join(errors))
    return axis, plan_out


# --------------------------------------------------------------------------- FSDP2


def fsdp_dims(spec: CompiledSpec, plans: Mapping[str, ParamPlan]) -> dict[str, int | None]:
    """Per parameter: the tensor dimension the fsdp axis shards (FSDP2's ``Shard(dim)``),
    or ``None`` where the spec replicates it over that axis. Refuses layouts FSDP2 cannot
    give: the fsdp axis must be the innermost on its dimension."""
    axis = spec.fsdp_axis
    out: dict[str, int | None] = {}
    errors = []
    for fqn, plan in plans.items():
        if axis is None or axis not in plan.names:
            out[fqn] = None
            continue
        dims = [i for i, d in enumerate(plan.layout.tensor_dims()) if axis in d.axes]
        if not dims:
            out[fqn] = None
            continue
        d = plan.layout.tensor_dims()[dims[0]]
        if d.axes[-1] != axis:
            errors.append(
                f"{fqn}: {axis!r} is not the innermost axis of dimension {d.name!r} "
                f"({', '.join(d.axes)}); FSDP2 shards the tensor-parallel shard, so it "
                "always comes last"
            )
        out[fqn] = dims[0]
    if errors:
        raise SpecError("FSDP2 cannot give this layout:\n  " + "\n  ".join(errors))
    return out


def make_shard_placement_fn(
    model: nn.Module, dims: Mapping[str, int | None]
) -> Callable[[nn.Parameter], Shard | None]:
    by_id = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if fqn in dims and dims[fqn] is not None:
            by_id[id(p)] = Shard(dims[fqn])  # type: ignore[arg-type]

    def shard_placement_fn(param: nn.Parameter) -> Shard | None:
        return by_id.get(id(param))

    return shard_placement_fn


# Modules that hold a model's repeated blocks: torchtitan's `layers` ModuleDict, HF's
# `model.layers` ModuleList, GPT-2's `h`.
def default_blocks(model: nn.Module) -> list[str]:
    """FSDP units: the members of the outermost ModuleList/ModuleDict whose members are all
    of one class (transformer blocks), in order."""
    out: list[str] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0:
            kinds = {type(m) for m in module.children()}
            if len(kinds) == 1 and any(True for _ in next(iter(module.children())).parameters()):
                out.extend(f"{name}.{k}" if name else k for k, _ in module.named_children())
                taken.append(name)
    return out


def _is_parallelized(model: nn.Module) -> str | None:
    from torch.distributed.fsdp import FSDPModule

    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            return f"module {name or '<root>'} is already wrapped by fully_shard"
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            return f"parameter {name} is already a DTensor"
    return None


def parallelize(
    spec: CompiledSpec,
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: Any = None,
    reshard_after_forward: bool | int | None = None,
    offload_policy: Any = None,
    blocks: Iterable[str] | None = None,
    styles: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Tensor parallelism (``parallelize_module`` with the spec's styles) on the TP axis,
    then FSDP2 (``fully_shard`` per block, the root last) on the spec's fsdp axis, in place.

    ``mp_policy``, ``reshard_after_forward`` and ``offload_policy`` go to every
    ``fully_shard`` call; ``blocks`` names the FSDP units (default: the members of the
    model's outermost list of identical blocks); ``styles`` (module FQN -> ParallelStyle)
    overrides a module's style, or adds one for a module without spec parameters.
    Everything is planned and checked before the model changes; afterwards every parameter
    has exactly the spec's layout (checked with :func:`verify`).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    refuse_views(spec, "parallelize")
    lmesh = spec.layout_mesh(mesh)
    if mesh.get_coordinate() is None:
        raise SpecError("this rank is not part of the mesh")
    already = _is_parallelized(model)
    if already:
        raise SpecError(
            f"the model is already parallelized ({already}); parallelize a fresh model, or "
            "check a model parallelized elsewhere with verify()"
        )
    plans, aliases = plan_params(spec, model, lmesh, mesh)
    axis, tp = build_tp_plan(spec, model, lmesh, plans, styles)
    tied_tp = sorted(
        f"{alias} (= {fqn})"
        for alias, fqn in aliases.items()
        if fqn in plans
        and any(a != spec.fsdp_axis and lmesh.size(a) > 1 for a in plans[fqn].sharded_axes())
    )
    if tied_tp:
        raise SpecError(
            "tied parameters sharded over a model-parallel axis: "
            + ", ".join(tied_tp)
            + "; one weight used by two modules (a tied embedding and head) gets no "
            "tensor-parallel style torch can apply to both; untie them, or keep the "
            "model-parallel axes at size 1"
        )
    if aliases and axis is not None:
        # TP size 1 (larger sizes are refused above): a style would replace its module's
        # parameter with a DTensor of its own, parting a weight tied across two modules,
        # and a module without a style would meet a DTensor weight. Styles do nothing at
        # size 1: leave the modules of tied weights to FSDP alone.
        tied = {_owner(a)[0] for a in aliases} | {_owner(f)[0] for f in aliases.values()}
        tp = {owner: style for owner, style in tp.items() if owner not in tied}
    if styles and axis is not None:
        _check_user_styles(model, submesh(mesh, [axis]), axis, plans, tp, styles)
    dims = fsdp_dims(spec, plans)
    block_names = list(blocks) if blocks is not None else default_blocks(model)
    block_modules = []
    for name in block_names:
        try:
            block_modules.append(model.get_submodule(name))
        except AttributeError:
            raise SpecError(f"blocks: the model has no module {name!r}") from None
    fsdp_kwargs: dict[str, Any] = {}
    if mp_policy is not None:
        fsdp_kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        fsdp_kwargs["offload_policy"] = offload_policy
    if reshard_after_forward is not None:
        fsdp_kwargs["reshard_after_forward"] = reshard_after_forward
    replicated = [fqn for fqn, d in dims.items() if d is None]
    # -- from here on the model changes
    spec.last_mesh = mesh
    if axis is not None and tp:
        parallelize_module(model, submesh(mesh, [axis]), tp)
    if spec.fsdp_axis is not None:
        params = dict(model.named_parameters(remove_duplicate=False))
        ignored = {params[f] for f in replicated if f in params}
        placement_fn = make_shard_placement_fn(model, dims)
        dp = submesh(mesh, [spec.fsdp_axis])
        for block in block_modules:
            fully_shard(
                block,
                mesh=dp,
                shard_placement_fn=placement_fn,
                ignored_params=ignored or None,
                **fsdp_kwargs,
            )
        fully_shard(
            model,
            mesh=dp,
            shard_placement_fn=placement_fn,
            ignored_params=ignored or None,
            **fsdp_kwargs,
        )
        if ignored:
            _average_grads(ignored, dp)
    bad = mismatches(spec, model, mesh)
    if bad:  # torch's machinery did not give the layout it was asked for
        raise SpecError(
            "parallelize did not reach the spec's layout (please report this):\n  "
            + "\n  ".join(bad)
        )
    return model


def _check_user_styles(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    axis: str,
    plans: Mapping[str, ParamPlan],
    plan: Mapping[str, Any],
    styles: Mapping[str, Any],
) -> None:
    """Raise one :class:`SpecError` naming every style of ``styles`` (the caller's) that
    would not give the spec's layout over ``axis``, tried on meta copies of their modules
    (see :mod:`shardspec.runtime.user_styles`); the model is not changed."""
    want = {fqn: p.on(axis) for fqn, p in plans.items()}
    problems = []
    for owner, style in styles.items():
        if owner in plan:  # (a style dropped for a tied weight at tp size 1 is not applied)
            styled = set(plan) - {owner}
            problems += style_problems(owner, style, model, tp_mesh, want, styled)
    if problems:
        raise SpecError(
            "the styles passed to parallelize do not give the spec's layout (the model is "
            "unchanged):\n  "
            + "\n  ".join(problems)
            + "\n  a style in `styles` replaces the spec's for its module: state activation "
            "layouts in the spec's `style` line (`style rowwise output sequence`), or put "
            "hooks such as PrepareModuleOutput on a module without parameters the spec cuts",
            "SS032",
        )


def _average_grads(params: Iterable[nn.Parameter], dp: DeviceMesh) -> None:
    """Parameters the spec replicates over the fsdp axis (FSDP2 leaves them alone): average
    their gradients over it, as DDP would."""
    import torch.distributed as dist

    group = dp.get_group()
    n = dp.size()

    def hook(p: torch.Tensor) -> None:
        if p.grad is None or n == 1:
            return
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(g, group=group)
        g.div_(n)

    for p in params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)


# --------------------------------------------------------------------------- for trainers


def tp_plan(spec: CompiledSpec, mesh: DeviceMesh, model: nn.Module | None = None) -> dict[str, Any]:
    """The plan for ``parallelize_module(model, mesh[tp], plan)``.

    With ``model``: exact module FQNs. Without: one entry per module pattern of the spec's
    rules (``*`` per segment, as ``parallelize_module`` matches), which needs rules whose
    module part is such a pattern."""
    refuse_views(spec, "tp_plan")
    lmesh = spec.layout_mesh(mesh)
    if model is not None:
        plans, _ = plan_params(spec, model, lmesh, mesh)
        return build_tp_plan(spec, model, lmesh, plans)[1]
    return _pattern_plan(spec, lmesh)


def _pattern_plan(spec: CompiledSpec, lmesh: Mesh) -> dict[str, Any]:
    from shardspec.core.layout import build_layout

    if spec.params is None:
        raise SpecError("the spec has no manifest: pass model= to tp_plan")
    sizes = dict(zip(lmesh.names, lmesh.sizes, strict=True))
    by_rule: dict[int, tuple[int, ...]] = {}
    for _, p, _ in spec.params.value_rows():  # one row per kind of parameter, not per name
        by_rule.setdefault(p.rule, p.shape)
    groups: dict[str, dict[str, core.Placement]] = {}
    kinds: dict[str, dict[str, object]] = {}
    axes = tp_axes(spec)
    for i, rule in enumerate(spec.rules):
        shape = by_rule.get(i)
        if shape is None:
            continue
        layout = build_layout(rule, shape, sizes, spec.name_indexed_counts.get(i))
        sub = dtensor_mesh(layout, lmesh)
        placements = dtensor_placements(layout, lmesh)
        on = {n: p for n, p in zip(sub.names, placements, strict=True) if n in axes}
        sharded = {n: p for n, p in on.items() if not isinstance(p, core.Replicate)}
        style = spec.rule_styles.get(i)
        if not sharded and not style:
            continue
        owner, leaf = _owner(rule.pattern)
        if not re.fullmatch(r"[A-Za-z0-9_*]+(\.[A-Za-z0-9_*]+)*", owner) or "**" in owner:
            raise SpecError(
                f"rule {rule.pattern!r}: its module part is not a pattern parallelize_module "
                "matches (one `*` per segment); pass model= to tp_plan"
            )
        placed = next(iter(sharded.values())) if sharded else core.REPLICATE
        groups.setdefault(owner, {})[leaf] = placed
        if style:
            kinds[owner] = style
    out: dict[str, Any] = {}
    for owner, leaves in groups.items():
        stated = dict(kinds.get(owner, {}))
        kind = stated.pop("kind", None)
        stated.pop("derived", None)
        if kind == "sequence_parallel":
            out[owner] = SequenceParallel(**_style_kwargs(stated, sequence=True))
        elif kind == "none":
            out[owner] = SpecPlaced(leaves)
        elif kind in ("colwise", "rowwise"):
            cls = SpecColwise if kind == "colwise" else SpecRowwise
            out[owner] = cls(leaves, **_pattern_kwargs(stated, kind, leaves))
        elif any(not isinstance(p, core.Replicate) for p in leaves.values()):
            raise SpecError(
                f"module pattern {owner!r}: no style is known for it (the manifest records "
                "no module kind, or it is neither a Linear nor an Embedding); state one in "
                "the spec, or pass model= to tp_plan"
            )
    return out


def _pattern_kwargs(
    stated: Mapping[str, Any], kind: str, leaves: Mapping[str, core.Placement]
) -> dict[str, Any]:
    """The style's keyword arguments: the stated activation layouts, and for a
    column-parallel module whose weight's fused output dimension is split per component,
    that layout for its output."""
    kwargs = _style_kwargs(stated)
    weight = leaves.get("weight", core.REPLICATE)
    if kind == "colwise" and isinstance(weight, core.StridedShard) and "output" not in stated:
        # Each rank's output columns are its slice of every component, which is what the
        # module's own forward splits. Keep that layout (torch's default Shard(-1) would
        # permute the columns across ranks).
        kwargs["output_layouts"] = _StridedShard(-1, split_factor=weight.split_factor)
    return kwargs


def shard_placement_fn(
    spec: CompiledSpec, model: nn.Module, mesh: DeviceMesh
) -> Callable[[nn.Parameter], Shard | None]:
    """The ``shard_placement_fn`` for ``fully_shard``: the dimension the spec shards over
    its fsdp axis, per parameter. Call it after tensor parallelism (it keys on the
    parameters the model holds now)."""
    refuse_views(spec, "shard_placement_fn")
    lmesh = spec.layout_mesh(mesh)
    plans, _ = plan_params(spec, model, lmesh, mesh)
    return make_shard_placement_fn(model, fsdp_dims(spec, plans))


def fsdp_ignored(spec: CompiledSpec, model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Parameters the spec replicates over its fsdp axis: ``fully_shard(...,
    ignored_params=...)``; their gradients need averaging over that axis."""
    refuse_views(spec, "fsdp_ignored")
    lmesh = spec.layout_mesh(mesh)
    plans, _ = plan_params(spec, model, lmesh, mesh)
    params = dict(model.named_parameters())
    return {params[f] for f, d in fsdp_dims(spec, plans).items() if d is None and f in params}


__all__ = [
    "SpecColwise",
    "SpecRowwise",
    "fsdp_ignored",
    "mismatches",
    "parallelize",
    "shard_placement_fn",
    "tp_plan",
    "verify",
]
