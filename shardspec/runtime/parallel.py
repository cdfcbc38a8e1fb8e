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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
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
    CONV1D,
    CONV1D_FORWARDS,
    EMBEDDING,
    HEADS,
    HEADS_DIM,
    LINEAR,
    custom_module_hint,
    cuts_tokens,
    derive,
    forward_class,
    qualified_name,
    runs_torch_forward,
    why_not_torch,
)
from shardspec.core.views import Folded
from shardspec.runtime.dtensor import _contiguous_stride, layout_of, submesh, take, to_torch
from shardspec.runtime.spec import CompiledSpec, SpecError
from shardspec.runtime.user_styles import fmt_ranges, style_problems

# --------------------------------------------------------------------------- placements


def _mesh_names(mesh: DeviceMesh, spec: CompiledSpec | None = None) -> tuple[str, ...]:
    """``mesh``'s axis names, in ``spec``'s spelling where given (an alias as its axis)."""
    names = tuple(mesh.mesh_dim_names or ())
    return spec.axis_names(names) if spec is not None else names


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
    # The view whose mesh the layout is on (None: the spec has one mesh).
    view: str | None = None

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
        rule = spec._rule_of(gname.get(fqn, fqn))
        view = spec.view_of_rule(rule)
        vmesh = spec.view_mesh(lmesh, rule)  # (lmesh itself without views)
        sub = dtensor_mesh(layout, vmesh)
        plans[fqn] = ParamPlan(
            fqn,
            layout,
            dtensor_placements(layout, vmesh),
            sub.names,
            gname.get(fqn, fqn),
            rname.get(fqn, fqn),
            view,
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
    plan: ParamPlan,
    value: torch.Tensor,
    lmesh: Mesh,
    mesh: DeviceMesh,
    spec: CompiledSpec | None = None,
) -> str | None:
    """Why ``value`` does not hold ``plan``'s layout on this rank's mesh, or ``None``
    (DeviceMesh axis names read in ``spec``'s spelling where given)."""
    want_shape = module_shape(plan.layout, lmesh)
    if tuple(value.shape) != want_shape:
        return f"global shape {list(value.shape)}, the spec's is {list(want_shape)}"
    if isinstance(value, DTensor):
        dmesh = value.device_mesh
        names = _mesh_names(dmesh, spec)
        if not names:
            return "its DTensor's mesh has no axis names; build meshes from the spec's mesh"
        unknown = [n for n in names if n not in plan.names]
        if unknown:
            local = [n for n in unknown if n in plan.layout.local]
            why = (
                f"{local} is local to this parameter (its module holds its shard, so no "
                "DTensor spans it)"
                if local
                else f"{unknown} is not an axis of {_where(plan, lmesh)}"
            )
            return f"its DTensor spans mesh axes {names}; {why}"
        if not _same_group(dmesh, mesh, names, spec):
            return f"its DTensor mesh {names} groups other ranks than {_where(plan, lmesh)}"
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


def _where(plan: ParamPlan, lmesh: Mesh) -> str:
    """The mesh a parameter is planned on, in words."""
    if plan.view is None:
        return f"the spec's mesh {lmesh.names}"
    return f"view {plan.view!r}'s mesh {lmesh.names}"


def _describe(names: Iterable[str], placements: Iterable[core.Placement]) -> str:
    return "(" + ", ".join(f"{n}={p}" for n, p in zip(names, placements, strict=True)) + ")"


def _same_group(
    dmesh: DeviceMesh, mesh: DeviceMesh, names: tuple[str, ...], spec: CompiledSpec | None
) -> bool:
    """Whether ``dmesh`` (axes ``names``) groups this rank with the same ranks, in the same
    order, as the spec mesh's sub-mesh over ``names``."""
    full = mesh.mesh
    full_names = _mesh_names(mesh, spec)
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


def _coordinate(mesh: Any) -> list[int] | None:
    """This rank's coordinate in ``mesh`` (a DeviceMesh, or views: view -> DeviceMesh);
    :class:`SpecError` for a mesh that is arithmetic only (a Mesh, a dict of sizes)."""
    meshes = list(mesh.values()) if isinstance(mesh, Mapping) else [mesh]
    if not meshes or not all(isinstance(m, DeviceMesh) for m in meshes):
        raise SpecError(
            "parallelize and verify need torch DeviceMeshes, one per view with views; a "
            "Mesh or a dict of axis sizes describes layouts only",
            None,
            "pass build_mesh()'s result",
        )
    return meshes[0].get_coordinate()


def view_meshes(lmesh: Mesh, mesh: Any, view: str | None) -> tuple[Mesh, DeviceMesh]:
    """(the layout Mesh, the DeviceMesh) of view ``view``; the mesh itself for None."""
    if view is None:
        return lmesh, mesh
    assert isinstance(lmesh, Folded)
    return lmesh.view(view), mesh[view]


def on_view(lmesh: Mesh, mesh: Any, plan: ParamPlan) -> tuple[Mesh, DeviceMesh]:
    """(the layout Mesh, the DeviceMesh) ``plan`` is on: its view's, or the mesh itself."""
    return view_meshes(lmesh, mesh, plan.view)


def fsdp_axis_of(spec: CompiledSpec, plan: ParamPlan) -> str | None:
    """The fsdp axis of ``plan``'s view (the spec's, without views)."""
    if plan.view is None or spec.views is None:
        return spec.fsdp_axis
    return spec.views.fsdp_of(plan.view)


def model_parallel_axes(spec: CompiledSpec, plan: ParamPlan) -> tuple[str, ...]:
    """The axes ``plan`` is sharded over, but its view's fsdp axis."""
    fsdp = fsdp_axis_of(spec, plan)
    return tuple(a for a in plan.sharded_axes() if a != fsdp)


def is_expert_parallel(spec: CompiledSpec, plan: ParamPlan) -> bool:
    """Whether ``plan``'s rule states ``style expert_parallel``."""
    return spec.style_of(plan.rule_fqn).get("kind") == "expert_parallel"


def mismatches(spec: CompiledSpec, model: nn.Module, mesh: Any) -> list[str]:
    """Every parameter of ``model`` whose layout differs from the spec's, one line each;
    with views, also every module the spec makes expert-parallel whose tokens nothing
    dispatches."""
    lmesh = spec.layout_mesh(mesh)
    if _coordinate(mesh) is None:
        raise SpecError("this rank is not part of the mesh")
    plans, _ = plan_params(spec, model, lmesh, mesh)
    out = []
    params = dict(model.named_parameters())
    for fqn, plan in plans.items():
        vmesh, dmesh = on_view(lmesh, mesh, plan)
        problem = layout_problem(plan, params[fqn], vmesh, dmesh, spec)
        if problem is not None:
            out.append(f"{fqn}: {problem}")
    from shardspec.runtime.expert_parallel import ExpertParallelModule, MoESequenceParallelModule

    owners = sorted({_owner(f)[0] for f, p in plans.items() if is_expert_parallel(spec, p)})
    for owner in owners:
        module = model.get_submodule(owner) if owner else model
        if not _styled(module, ExpertParallelModule):
            out.append(
                f"{owner}: the spec gives it style expert_parallel, but nothing dispatches its "
                "tokens (it is not shardspec's ExpertParallel module and has no forward hooks "
                "but FSDP2's): each rank would run its own experts on its own tokens only"
            )
    for block in sorted({_owner(o)[0] for o in owners if o} if sequence_parallel(spec) else ()):
        if not _styled(model.get_submodule(block), MoESequenceParallelModule):
            out.append(
                f"{block}: the spec's activations are sequence-parallel and its experts "
                "expert-parallel, but nothing gives this MoE block its rank's own tokens (it "
                "is not shardspec's MoESequenceParallel module and has no forward hooks but "
                "FSDP2's, as torchtitan's PrepareModuleInputOutput installs): its router "
                "would read a sequence-parallel DTensor, or its gradient miss the other tp "
                "ranks' tokens"
            )
    return out


def _styled(module: nn.Module, cls: type) -> bool:
    """Whether ``module`` is shardspec's ``cls`` (a style's mixin), or has forward hooks of
    a style's own (torchtitan's ExpertParallel installs them with ``distribute_module``,
    PrepareModuleInputOutput its own), FSDP2's not counted."""
    if isinstance(module, cls):
        return True
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return any(not type(getattr(h, "__self__", None)).__name__.startswith("FSDP") for h in hooks)


def verify(spec: CompiledSpec, model: nn.Module, mesh: Any) -> None:
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
    contiguous ``Shard(0)`` that would hand one TP rank all of gate and none of up.

    A module cut per component computes on its local shards: torch's input and output
    layouts are kept, but the matmul itself runs on the rank's rows of every component
    (``[gate_r; up_r]``) as plain tensors, exactly what DTensor's sharding propagation does
    where it can. Some torch releases cannot propagate a ``_StridedShard`` parameter through
    the module's ops at all (torch 2.11 transposes it without moving its dimension, then
    fails to plan the redistribution it thinks it needs: ``use_strided_shard_as_shard_order
    ... unable to be interpreted``); the parameters stay DTensors on the spec's layout for
    FSDP2, optimizers and checkpoints, and their gradients reach them through
    ``to_local``."""

    def __init__(self, param_placements: Mapping[str, core.Placement], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.param_placements = dict(param_placements)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self._distribute(module, device_mesh)
        strided = [p for p in self.param_placements.values() if isinstance(p, core.StridedShard)]
        attrs = self._local_attrs(module)
        if strided or attrs is not None:
            module._shardspec_local_compute = []  # type: ignore[assignment]
            module._shardspec_split = strided[0].split_factor if strided else 1  # type: ignore[assignment]
            module._shardspec_local_attrs = attrs or {}  # type: ignore[assignment]
            # Puts the parameters back if the forward raised (the output hook did not run).
            module.register_forward_hook(_restore_params, prepend=True, always_call=True)
        return module

    def _distribute(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """torch's ``ColwiseParallel._apply`` (``distribute_module`` with its hooks)."""
        return super()._apply(module, device_mesh)

    def _local_attrs(self, module: nn.Module) -> dict[str, tuple[int, int]] | None:
        """Attributes the module's forward reads as widths, (this rank's, the whole) each,
        when it computes on its local shards (None: DTensor compute unless fused)."""
        return None

    @staticmethod
    def _prepare_input_fn(
        input_layouts: Any,
        desired_input_layouts: Any,
        mod: nn.Module,
        inputs: Any,
        device_mesh: Any,
    ) -> Any:
        prepared = ColwiseParallel._prepare_input_fn(
            input_layouts, desired_input_layouts, mod, inputs, device_mesh
        )
        stack = getattr(mod, "_shardspec_local_compute", None)
        if stack is None:
            return prepared
        # The module's DTensor parameters become their local shards for this call (the
        # gradient of a local shard reaches the parameter through to_local's backward).
        saved: dict[str, Any] = {}
        for leaf, param in list(mod._parameters.items()):
            if isinstance(param, DTensor):
                saved[leaf] = param
                mod._parameters[leaf] = param.to_local()
        for attr, (local, _whole) in getattr(mod, "_shardspec_local_attrs", {}).items():
            setattr(mod, attr, local)
        stack.append(saved)
        # Every rank's gradient of its replicated input is its part of the sum.
        grad = tuple(Partial() for _ in prepared.placements)
        return prepared.to_local(grad_placements=grad)

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any
    ) -> Any:
        if getattr(mod, "_shardspec_local_compute", None) is None:
            return ColwiseParallel._prepare_output_fn(
                output_layouts, use_local_output, mod, outputs, device_mesh
            )
        _restore_params(mod)
        want = tuple(_normalized(p, outputs.ndim) for p in output_layouts)
        split = int(getattr(mod, "_shardspec_split", 1))
        last = outputs.ndim - 1
        here = (_StridedShard(last, split_factor=split) if split > 1 else Shard(last),)
        if want == here and use_local_output:
            return outputs
        value = DTensor.from_local(outputs, device_mesh, here, run_check=False)
        if want != here:
            value = value.redistribute(placements=want)
        return value.to_local() if use_local_output else value


def _restore_params(mod: nn.Module, *_: Any) -> None:
    """Put back the DTensor parameters a per-component :class:`SpecColwise` module
    computes with as local shards during its forward."""
    stack = getattr(mod, "_shardspec_local_compute", None)
    if stack:
        for leaf, param in stack.pop().items():
            mod._parameters[leaf] = param
        for attr, (_local, whole) in getattr(mod, "_shardspec_local_attrs", {}).items():
            setattr(mod, attr, whole)


def _normalized(p: Any, ndim: int) -> Any:
    """``p`` with a negative shard dimension made positive (``_StridedShard`` kept)."""
    dim = getattr(p, "dim", None)
    if dim is None or dim >= 0:
        return p
    if isinstance(p, _StridedShard):
        return _StridedShard(dim + ndim, split_factor=p.split_factor)
    return Shard(dim + ndim)


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
    stated.pop("module", None)
    sharded = {leaf: p for leaf, p in placements.items() if not isinstance(p, core.Replicate)}
    if kind == "sequence_parallel":
        if sharded:
            raise SpecError(f"{fqn}: sequence parallelism needs parameters replicated over tp")
        return SequenceParallel(**_style_kwargs(stated, sequence=True))
    if not sharded:
        return None
    if kind == "none":
        return SpecPlaced(placements)
    forward = qualified_name(forward_class(type(module)))
    module_kind = (
        LINEAR
        if isinstance(module, nn.Linear)
        else EMBEDDING
        if isinstance(module, nn.Embedding)
        else CONV1D
        if forward in CONV1D_FORWARDS
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
    if (
        derived == "colwise"
        and module_kind in (LINEAR, CONV1D)
        and isinstance(bias, core.Replicate)
    ):
        raise SpecError(
            f"{fqn}: a column-parallel {type(module).__name__} whose bias is replicated "
            f"over {tp_axis!r}: each rank's output columns need their own slice of the "
            "bias; shard the bias's out dimension over {tp_axis!r} too"
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
    if module_kind == CONV1D:
        return _colwise_rowwise(derived, module_kind, placements, stated)
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
        if stated.get("input") == HEADS:
            # Per-head activations [..., heads, head_dim] cut by heads: the module's output
            # goes on as the rank's local heads unless `dtensor` is stated.
            out["sequence_dim"] = HEADS_DIM
            out["use_local_output"] = True
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


def tp_axes(spec: CompiledSpec, view: str | None = None) -> tuple[str, ...]:
    """The model-parallel axes: the axes some rule (of view ``view``) shards a dimension
    over, but the fsdp one and the pipeline axis (its ranks hold other stages, not other
    parts of a tensor). An axis no rule shards (dp_replicate) holds whole replicas: it is
    no tensor-parallel axis, whatever its size."""
    pp = spec.pipeline.axis if spec.pipeline is not None else None
    sharded = {
        a
        for i, rule in enumerate(spec.rules)
        if view is None or spec.view_of_rule(i) == view
        for _, axes in rule.shard
        for a in axes
    }
    if view is not None and spec.views is not None:
        fsdp, axes = spec.views.fsdp_of(view), spec.views.axes_of(view)
    else:
        fsdp, axes = spec.fsdp_axis, spec.axes
    return tuple(a for a in axes if a in sharded and a not in (fsdp, pp))


def _owner(fqn: str) -> tuple[str, str]:
    owner, _, leaf = fqn.rpartition(".")
    return owner, leaf


def build_tp_plan(
    spec: CompiledSpec,
    model: nn.Module,
    lmesh: Mesh,
    plans: Mapping[str, ParamPlan],
    styles: Mapping[str, Any] | None = None,
    view: str | None = None,
) -> tuple[str | None, dict[str, Any]]:
    """(the TP axis, {module FQN: ParallelStyle}) for ``model``. At most one axis is TP:
    ``parallelize_module`` takes a 1-D mesh. With views: ``plans`` of view ``view``, whose
    mesh ``lmesh`` is."""
    by_module: dict[str, dict[str, ParamPlan]] = {}
    for fqn, plan in plans.items():
        owner, leaf = _owner(fqn)
        by_module.setdefault(owner, {})[leaf] = plan
    axes = tp_axes(spec, view)
    candidates = [a for a in axes if lmesh.size(a) > 1] or list(axes)
    used: set[str] = set()
    for leaves in by_module.values():
        for plan in leaves.values():
            used.update(model_parallel_axes(spec, plan))
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
    out: dict[str, int | None] = {}
    errors = []
    for fqn, plan in plans.items():
        axis = fsdp_axis_of(spec, plan)
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
    mesh: Any,
    *,
    mp_policy: Any = None,
    reshard_after_forward: bool | int | None = None,
    offload_policy: Any = None,
    blocks: Iterable[str] | None = None,
    styles: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Tensor parallelism (``parallelize_module`` with the spec's styles) on the TP axis,
    then FSDP2 (``fully_shard`` per block, the root last) on the spec's fsdp axis, in place.

    A spec with views takes ``build_mesh()``'s views (or a mapping view -> DeviceMesh over
    the same ranks, a trainer's own): tensor parallelism on the dense view (the view of
    every parameter outside the experts modules) and FSDP2 over its fsdp axis; each module
    whose rules state ``style expert_parallel`` gets
    :class:`~shardspec.runtime.expert_parallel.ExpertParallel` (all-to-all token dispatch)
    over its view's expert-parallel axis (``ExpertTensorParallel`` over (ep, etp) where the
    rules also cut each expert's ffn dimension over etp), then its own ``fully_shard`` over
    that view's fsdp axis before the blocks', as torchtitan does. The experts' gradients
    end as a single process's mean-loss gradient (each rank's loss the mean over its own
    tokens): see :func:`expert_grad_scale`. Under token sequence parallelism (a `style
    sequence_parallel` rule) each MoE block (an expert-parallel module's parent) gets
    :class:`~shardspec.runtime.expert_parallel.MoESequenceParallel` over the dense tp: it
    routes its tp rank's own slice of the sequence, as torchtitan does when ep borrows tp
    (see :func:`moe_blocks`).

    ``mp_policy``, ``reshard_after_forward`` and ``offload_policy`` go to every
    ``fully_shard`` call; ``blocks`` names the FSDP units (default: the members of the
    model's outermost list of identical blocks); ``styles`` (module FQN -> ParallelStyle)
    overrides a module's style, or adds one for a module without spec parameters.
    Everything is planned and checked before the model changes; afterwards every parameter
    has exactly the spec's layout (checked with :func:`verify`).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from shardspec.runtime.expert_parallel import (
        ExpertParallel,
        ExpertTensorParallel,
        set_grad_scale,
    )

    lmesh = spec.layout_mesh(mesh)
    if _coordinate(mesh) is None:
        raise SpecError("this rank is not part of the mesh")
    already = _is_parallelized(model)
    if already:
        raise SpecError(
            f"the model is already parallelized ({already}); parallelize a fresh model, or "
            "check a model parallelized elsewhere with verify()"
        )
    plans, aliases = plan_params(spec, model, lmesh, mesh)
    experts = expert_modules(spec, model, lmesh, mesh, plans)
    dense = {f: p for f, p in plans.items() if _owner(f)[0] not in experts}
    view = dense_view(spec, dense)
    vmesh, vdmesh = view_meshes(lmesh, mesh, view)
    axis, tp = build_tp_plan(spec, model, vmesh, dense, styles, view)
    tied_tp = sorted(
        f"{alias} (= {fqn})"
        for alias, fqn in aliases.items()
        if fqn in plans
        and any(
            on_view(lmesh, mesh, plans[fqn])[0].size(a) > 1
            for a in model_parallel_axes(spec, plans[fqn])
        )
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
    if axis is not None:
        from shardspec.runtime.conv1d import global_splits

        split = global_splits(model, tp, vmesh.size(axis))
        if split:
            raise SpecError("no tensor-parallel plan:\n  " + "\n  ".join(split))
    sp_blocks = moe_blocks(spec, dense, experts, axis, tp)
    if sp_blocks:
        # Each tp rank routes its own slice of its data group's tokens (expert_grad_scale).
        assert axis is not None
        tp = with_moe_blocks(tp, sp_blocks)
        experts = {o: (m, f, s * vmesh.size(axis)) for o, (m, f, s) in experts.items()}
    clash = sorted(o for o in (styles or {}) if o in experts)
    if clash:
        raise SpecError(
            f"styles: {', '.join(clash)} is expert-parallel in the spec (style "
            "expert_parallel); parallelize gives it ExpertParallel over its view's ep axis, "
            "and `styles` are tensor-parallel styles of the dense view"
        )
    if styles and axis is not None:
        own = spec.mesh_names(vdmesh, [axis])[0]  # the tp axis as the mesh spells it
        _check_user_styles(model, submesh(vdmesh, [own]), own, dense, tp, styles)
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
    # Parameters FSDP2 leaves alone (replicated over their fsdp axis), by that axis's mesh.
    replicated: dict[int, tuple[DeviceMesh, list[str]]] = {}
    for fqn, d in dims.items():
        fsdp = fsdp_axis_of(spec, plans[fqn])
        if d is None and fsdp is not None:
            dp_mesh = submesh(on_view(lmesh, mesh, plans[fqn])[1], [fsdp], spec)
            replicated.setdefault(id(dp_mesh), (dp_mesh, []))[1].append(fqn)
    fsdp_axis = spec.views.fsdp_of(view) if spec.views is not None and view else spec.fsdp_axis
    # -- from here on the model changes
    spec.last_mesh = mesh
    if axis is not None and tp:
        parallelize_module(model, submesh(vdmesh, [axis], spec), tp)
    for owner, (ep_mesh, _, scale) in experts.items():
        module = model.get_submodule(owner)
        style = ExpertParallel() if ep_mesh.ndim == 1 else ExpertTensorParallel()
        parallelize_module(module, ep_mesh, style)
        set_grad_scale(module, scale)
    params = dict(model.named_parameters(remove_duplicate=False))
    ignored = {params[f] for _, fqns in replicated.values() for f in fqns if f in params}
    placement_fn = make_shard_placement_fn(model, dims)
    # FSDP2 units, innermost first: the experts on the expert view's fsdp mesh (torchtitan's
    # order), then the blocks and the root on the dense view's.
    units = [(model.get_submodule(o), efsdp) for o, (_, efsdp, _) in experts.items()]
    if fsdp_axis is not None:
        dp = submesh(vdmesh, [fsdp_axis], spec)
        units += [(block, dp) for block in [*block_modules, model]]
    for unit, unit_mesh in units:
        fully_shard(
            unit,
            mesh=unit_mesh,
            shard_placement_fn=placement_fn,
            ignored_params=ignored or None,
            **fsdp_kwargs,
        )
    for dp_mesh, fqns in replicated.values():
        converted = _replicate_as_dtensors(model, [f for f in fqns if f in params], dp_mesh)
        _average_grads(converted, dp_mesh)
    bad = mismatches(spec, model, mesh)
    if bad:  # torch's machinery did not give the layout it was asked for
        raise SpecError(
            "parallelize did not reach the spec's layout (please report this):\n  "
            + "\n  ".join(bad)
        )
    return model


def dense_view(spec: CompiledSpec, dense: Mapping[str, ParamPlan]) -> str | None:
    """The view of every parameter outside the experts modules (None without views);
    :class:`SpecError` where they are on several (FSDP2 wraps a block on one mesh)."""
    if spec.views is None:
        return None
    views = sorted({p.view for p in dense.values() if p.view is not None})
    if len(views) > 1:
        by_view = {v: next(f for f, p in dense.items() if p.view == v) for v in views}
        raise SpecError(
            "parallelize wraps each block in FSDP2 over one view's fsdp axis, but the "
            "parameters outside the expert-parallel modules are on views "
            + ", ".join(f"{v} (e.g. {f})" for v, f in by_view.items()),
            None,
            "put every rule but the experts' (style expert_parallel) on the dense view",
        )
    return views[0] if views else spec.views.default


def expert_grad_scale(efsdp: int, world: int) -> float:
    """What the expert-parallel style multiplies the local experts' gradients by, so that
    after FSDP2's reduce-scatter over the expert view's fsdp axis (the sum over its
    ``efsdp`` ranks, divided by ``efsdp``) they are a single process's mean-loss gradient.

    Each rank's loss is the mean over its own tokens; the single process's is the mean over
    the data-parallel groups. An expert's gradient on its ep rank sums the contributions of
    the tokens its ep group dispatched to it, and FSDP2 adds those of the efsdp ranks that
    hold the same expert: every rank of the world once (the expert view factors the world
    as ep x efsdp). Ranks that hold the same tokens (the dense view's tp ranks, without
    sequence parallelism) add the same contribution: a data group's tokens count
    world / dp times. So the sum is divided by the world: by ``efsdp`` in FSDP2, by
    ``world / efsdp`` here, in autograd (with expert tensor parallelism ``world`` is the
    world over etp: the ranks of an etp group hold slices of the same experts, and add
    nothing to each other's gradients). torchtitan's ``set_gradient_divide_factor`` needs
    NCCL's PREMUL_SUM, which gloo lacks; this works on both.

    Under sequence parallelism (``MoESequenceParallel`` on the MoE block) the dense tp ranks
    hold *different* tokens: each routes its own slice of its data group's sequence, so
    every token reaches its expert once per data group, not tp times, and the sum counts
    each data group once: ``parallelize`` multiplies this scale by the dense tp size
    (``efsdp * tp / world``, i.e. ``efsdp / dp``), wherever ep sits in the expert view."""
    return efsdp / world


def sequence_parallel(spec: CompiledSpec) -> bool:
    """Whether a rule's style cuts the activations by tokens over tp (`style
    sequence_parallel`, not `input heads`)."""
    return any(cuts_tokens(k) for k in spec.rule_styles.values())


def moe_blocks(
    spec: CompiledSpec,
    plans: Mapping[str, ParamPlan],
    experts: Iterable[str],
    axis: str | None,
    tp: Mapping[str, Any],
) -> list[str]:
    """Under token sequence parallelism, the MoE blocks (the parent of each expert-parallel
    module) that :class:`~shardspec.runtime.expert_parallel.MoESequenceParallel` runs on
    each tp rank's own tokens, as torchtitan does when ep borrows tp; none without
    sequence parallelism. :class:`SpecError` naming each block it cannot take: one
    without a parent module, or whose other parameters (the router, shared experts) are
    cut over ``axis`` (the dense view's tp) or have a style in ``tp`` (the tensor-parallel
    plan): they compute on the rank's own tokens and are summed over tp."""
    experts = sorted(experts)
    if not experts or not sequence_parallel(spec):
        return []
    blocks: list[str] = []
    errors: list[str] = []
    for owner in experts:
        block = _owner(owner)[0]
        if axis is None or not owner or "." not in owner:
            why = (
                "the dense view has no tensor-parallel axis"
                if axis is None
                else "it has no parent module to route its tokens"
            )
            errors.append(f"{owner}: expert parallelism under sequence parallelism: {why}")
            continue
        inside = [
            f
            for f, p in plans.items()
            if f.startswith(block + ".") and not any(f.startswith(e + ".") for e in experts)
        ]
        cut = [f for f in inside if not isinstance(plans[f].on(axis), core.Replicate)]
        styled = [o for o in tp if o == block or o.startswith(block + ".")]
        if cut or styled:
            what = ", ".join([*(f"{f} (cut over {axis})" for f in cut), *styled])
            errors.append(
                f"{block}: under sequence parallelism each {axis} rank routes its own tokens "
                f"through this MoE block, so its parameters outside the experts (router, "
                f"shared experts) must be whole on every {axis} rank, with no "
                f"tensor-parallel style (their gradients are summed over {axis}): {what}"
            )
            continue
        if block not in blocks:
            blocks.append(block)
    if errors:
        raise SpecError(
            "parallelize cannot apply the expert-parallel style under sequence parallelism "
            "(the model is unchanged):\n  " + "\n  ".join(errors)
        )
    return blocks


def with_moe_blocks(tp: Mapping[str, Any], blocks: Iterable[str]) -> dict[str, Any]:
    """The tensor-parallel plan ``tp`` with ``MoESequenceParallel`` on each of ``blocks``."""
    from shardspec.runtime.expert_parallel import MoESequenceParallel

    return {**tp, **{b: MoESequenceParallel() for b in blocks}}


def _etp_problems(
    owner: str, module: nn.Module, leaves: Mapping[str, ParamPlan], etp: str, size: int
) -> list[str]:
    """Where ``ExpertTensorParallel`` would not cut ``module``'s parameters over ``etp`` as
    the spec does (each one's ffn dimension, per component: its ``FFN_DIMS``)."""
    from shardspec.runtime.expert_parallel import FFN_DIMS, ExpertTensorParallel

    style = ExpertTensorParallel()
    out = []
    for leaf, plan in sorted(leaves.items()):
        dim, components = style._cut(module, leaf, module.get_parameter(leaf), size)
        want = core.Shard(dim) if components == 1 else core.StridedShard(dim, components)
        if plan.on(etp) != want:
            out.append(
                f"{owner}.{leaf}: the spec cuts it {etp}={plan.on(etp)}; expert tensor "
                f"parallelism cuts its ffn dimension, {etp}={want} ({sorted(FFN_DIMS)} by name)"
            )
    return out


def expert_modules(
    spec: CompiledSpec, model: nn.Module, lmesh: Mesh, mesh: Any, plans: Mapping[str, ParamPlan]
) -> dict[str, tuple[DeviceMesh, DeviceMesh, float]]:
    """The modules whose rules state ``style expert_parallel``: FQN -> (the DeviceMesh the
    style runs on: ep, or (ep, etp) where the rules also cut each expert's ffn dimension
    over one more axis of the view, expert tensor parallelism; the expert view's fsdp
    DeviceMesh; the gradient scale). Checks everything the style and FSDP2 will need,
    before anything changes."""
    from shardspec.runtime.expert_parallel import (
        ExpertParallelError,
        check_experts,
    )

    owners: dict[str, dict[str, ParamPlan]] = {}
    for fqn, plan in plans.items():
        owner, leaf = _owner(fqn)
        owners.setdefault(owner, {})[leaf] = plan
    out: dict[str, tuple[DeviceMesh, DeviceMesh, float]] = {}
    errors: list[str] = []
    for owner, leaves in owners.items():
        marked = sorted(leaf for leaf, p in leaves.items() if is_expert_parallel(spec, p))
        if not marked:
            continue
        if spec.views is None:
            errors.append(
                f"{owner}: style expert_parallel on a spec of one mesh: declare the experts' "
                "own view (`mesh expert {{ ep: ...  efsdp: * }}` beside the dense one), so "
                "that every dense parameter keeps one data-parallel group (parallelize runs "
                "the expert-parallel style on views only)"
            )
            continue
        if len(marked) != len(leaves):
            errors.append(
                f"{owner}: {marked} are expert-parallel but "
                f"{sorted(set(leaves) - set(marked))} are not; the style places every "
                "parameter of its module"
            )
            continue
        view = {p.view for p in leaves.values()}
        if len(view) != 1:
            errors.append(f"{owner}: its parameters are on views {sorted(map(str, view))}")
            continue
        plan = next(iter(leaves.values()))
        vmesh, vdmesh = on_view(lmesh, mesh, plan)
        fsdp = fsdp_axis_of(spec, plan)
        first = plan.layout.tensor_dims()[0].axes
        ep = next((a for a in first if a != fsdp), None)
        others = {a for p in leaves.values() for a in model_parallel_axes(spec, p)} - {ep}
        if ep is None or first[0] != ep:
            errors.append(
                f"{owner}: the expert dimension (the first) of {plan.fqn} is not sharded over "
                "an expert-parallel axis first; state `shard expert over ep`"
            )
            continue
        axes = vmesh.names
        etp = next(iter(others)) if len(others) == 1 else None
        if others and (etp is None or axes.index(etp) < axes.index(ep)):
            errors.append(
                f"{owner}: its parameters are also sharded over {sorted(others)}: expert "
                f"tensor parallelism takes one axis after {ep!r} in view {plan.view!r} "
                f"({', '.join(axes)}), cutting each expert's ffn dimension"
            )
            continue
        if fsdp is None:
            errors.append(
                f"{owner}: view {plan.view!r} has no fsdp axis; parallelize wraps the "
                "experts in FSDP2 over it"
            )
            continue
        if etp is not None and sequence_parallel(spec):
            errors.append(
                f"{owner}: expert tensor parallelism under sequence parallelism is not "
                f"applied by parallelize: the ranks of an {etp} group must hold the same "
                "tokens, and sequence parallelism gives each tp rank its own; drop "
                f"`shard ffn over {etp}`, or the `style sequence_parallel` rules"
            )
            continue
        module = model.get_submodule(owner)
        ep_mesh = submesh(vdmesh, [ep] if etp is None else [ep, etp], spec)
        try:
            check_experts(module, ep_mesh, ep_mesh.ndim)
            if etp is not None:
                errors += _etp_problems(owner, module, leaves, etp, vmesh.size(etp))
        except ExpertParallelError as e:
            errors.append(f"{owner}: {e}")
            continue
        # The ranks of one pipeline stage: the others hold other layers' experts.
        pp = spec.pipeline.axis if spec.pipeline is not None else None
        world = 1
        for a, n in zip(vmesh.names, vmesh.sizes, strict=True):
            world *= n if a != pp else 1
        # The ranks of an etp group hold slices of the same experts: they add nothing to
        # each other's gradients.
        ranks = world // (vmesh.size(etp) if etp is not None else 1)
        out[owner] = (
            ep_mesh,
            submesh(vdmesh, [fsdp], spec),
            expert_grad_scale(vmesh.size(fsdp), ranks),
        )
    if errors:
        raise SpecError(
            "parallelize cannot apply the expert-parallel style (the model is unchanged):\n  "
            + "\n  ".join(errors)
        )
    return out


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


def _replicate_as_dtensors(model: nn.Module, fqns: list[str], dp: DeviceMesh) -> list[nn.Parameter]:
    """The parameters the spec replicates over the fsdp axis (FSDP2 leaves them alone) as
    ``Replicate`` DTensors on ``dp``, so that every parameter of the model is a DTensor:
    torch's optimizers default to ``foreach`` kernels on CUDA, which cannot take plain
    tensors and DTensors in one call ("got mixed torch.Tensor and DTensor"). Their modules
    compute with the local tensors (a forward pre-hook puts them in place, a hook restores
    the DTensors, also when the forward raises), so the module's own forward, which mixes
    them with plain activations, runs as before; the gradient reaches the DTensor through
    ``to_local`` and is averaged over ``dp`` (:func:`_average_grads`)."""
    out: dict[int, nn.Parameter] = {}
    for fqn in fqns:
        owner, _, leaf = fqn.rpartition(".")
        module = model.get_submodule(owner)
        param = module._parameters[leaf]
        if param is None:
            continue
        if isinstance(param, DTensor):  # a style made it one: its gradient still averages
            out.setdefault(id(param), param)
            continue
        new = out.get(id(param))
        if new is None:
            value = DTensor.from_local(param.detach(), dp, [Replicate()], run_check=False)
            new = out[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
        module._parameters[leaf] = new
        # A list, in the model's order: every rank must swap (and so reach the gradient
        # hooks' all-reduces) in the same order, which a set of names, hashed differently
        # in each process, does not keep.
        replicas = module.__dict__.setdefault("_shardspec_replicas", [])
        if not replicas:  # hooks once per module
            module.__dict__.setdefault("_shardspec_local_compute", [])
            module.register_forward_pre_hook(_replicas_to_local)
            module.register_forward_hook(_restore_params, prepend=True, always_call=True)
        if leaf not in replicas:
            replicas.append(leaf)
    return list(out.values())


def _replicas_to_local(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of :func:`_replicate_as_dtensors`: the parameters it made
    ``Replicate`` DTensors become their local tensors for this call (the module's other
    DTensor parameters, a style's, stay as they are)."""
    saved: dict[str, Any] = {}
    for leaf in module._shardspec_replicas:  # type: ignore[union-attr]
        param = module._parameters[leaf]
        if isinstance(param, DTensor):
            saved[leaf] = param
            grad = tuple(Replicate() for _ in param.placements)
            module._parameters[leaf] = param.to_local(grad_placements=grad)
    module._shardspec_local_compute.append(saved)  # type: ignore[union-attr,operator]


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


def tp_plan(spec: CompiledSpec, mesh: Any, model: nn.Module | None = None) -> dict[str, Any]:
    """The plan for ``parallelize_module(model, mesh[tp], plan)``. With views (``model``
    needed): the dense view's plan, for ``mesh[dense][tp]``, without the modules that
    ``style expert_parallel`` places (give those ``ExpertParallel`` over ``mesh[expert][ep]``).

    With ``model``: exact module FQNs. Without: one entry per module pattern of the spec's
    rules (``*`` per segment, as ``parallelize_module`` matches), which needs rules whose
    module part is such a pattern."""
    lmesh = spec.layout_mesh(mesh)
    if spec.views is not None:
        if model is None:
            raise SpecError(
                f"spec {spec.name!r} has views: pass model= to tp_plan (the plan is the dense "
                "view's, without the expert-parallel modules)"
            )
        plans, _ = plan_params(spec, model, lmesh, mesh)
        experts = {_owner(f)[0] for f, p in plans.items() if is_expert_parallel(spec, p)}
        dense = {f: p for f, p in plans.items() if _owner(f)[0] not in experts}
        view = dense_view(spec, dense)
        axis, plan = build_tp_plan(
            spec, model, view_meshes(lmesh, mesh, view)[0], dense, None, view
        )
        return with_moe_blocks(plan, moe_blocks(spec, dense, experts, axis, plan))
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
        module = stated.pop("module", None)
        if kind == "sequence_parallel":
            out[owner] = SequenceParallel(**_style_kwargs(stated, sequence=True))
        elif kind == "none":
            out[owner] = SpecPlaced(leaves)
        elif kind in ("colwise", "rowwise"):
            out[owner] = _colwise_rowwise(kind, str(module) if module else None, leaves, stated)
        elif any(not isinstance(p, core.Replicate) for p in leaves.values()):
            raise SpecError(
                f"module pattern {owner!r}: no style is known for it (the manifest records "
                "no module kind, or it is neither a Linear nor an Embedding); state one in "
                "the spec, or pass model= to tp_plan"
            )
    return out


def _colwise_rowwise(
    kind: str, module: str | None, leaves: Mapping[str, core.Placement], stated: Mapping[str, Any]
) -> ParallelStyle:
    """The spec's ``kind`` ("colwise" or "rowwise") style for a module of kind ``module``:
    :class:`SpecColwise` / :class:`SpecRowwise`, or for transformers' Conv1D (weight
    ``[in, out]``) :mod:`shardspec.runtime.conv1d`'s."""
    if module == CONV1D:
        from shardspec.runtime.conv1d import Conv1DColwise, Conv1DRowwise

        conv = Conv1DColwise if kind == "colwise" else Conv1DRowwise
        return conv(leaves, **_pattern_kwargs(stated, kind, leaves))
    cls = SpecColwise if kind == "colwise" else SpecRowwise
    return cls(leaves, **_pattern_kwargs(stated, kind, leaves))


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
    spec: CompiledSpec, model: nn.Module, mesh: Any
) -> Callable[[nn.Parameter], Shard | None]:
    """The ``shard_placement_fn`` for ``fully_shard``: the dimension the spec shards over
    its fsdp axis, per parameter (with views: over its own view's fsdp axis; one function
    serves every view's ``fully_shard``). Call it after tensor and expert parallelism (it
    keys on the parameters the model holds now)."""
    lmesh = spec.layout_mesh(mesh)
    plans, _ = plan_params(spec, model, lmesh, mesh)
    return make_shard_placement_fn(model, fsdp_dims(spec, plans))


def fsdp_ignored(spec: CompiledSpec, model: nn.Module, mesh: Any) -> set[nn.Parameter]:
    """Parameters the spec replicates over its fsdp axis (with views: over their own view's):
    ``fully_shard(..., ignored_params=...)``; their gradients need averaging over that
    axis."""
    lmesh = spec.layout_mesh(mesh)
    plans, _ = plan_params(spec, model, lmesh, mesh)
    params = dict(model.named_parameters())
    return {params[f] for f, d in fsdp_dims(spec, plans).items() if d is None and f in params}


__all__ = [
    "SpecColwise",
    "SpecRowwise",
    "expert_grad_scale",
    "fsdp_ignored",
    "mismatches",
    "parallelize",
    "shard_placement_fn",
    "tp_plan",
    "verify",
]
