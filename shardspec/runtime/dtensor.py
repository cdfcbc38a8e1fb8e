"""Meshes, placements and ``distribute``: putting a model's parameters on the declared
DTensor layout, with torch's own DeviceMesh and DTensor."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardspec.core import layout as core
from shardspec.core.layout import (
    Mesh,
    ParamLayout,
    _dtensor_view,
    dtensor_mesh,
    dtensor_placements,
    module_shape,
    ranges_len,
)
from shardspec.runtime.spec import CompiledSpec, MeshViews, SpecError


def to_torch(p: core.Placement) -> Placement:
    """A layout placement (``shardspec.core.layout``) as a torch placement."""
    if isinstance(p, core.Shard):
        return Shard(p.dim)
    if isinstance(p, core.StridedShard):
        return _StridedShard(p.dim, split_factor=p.split_factor)
    return Replicate()


def from_torch(p: Placement, ndim: int) -> core.Placement | None:
    """A torch placement as a layout placement; ``None`` for kinds a parameter's layout
    cannot have (``Partial``)."""
    if isinstance(p, _StridedShard):
        return core.StridedShard(p.dim % max(ndim, 1), int(p.split_factor))
    if isinstance(p, Shard):
        return core.Shard(p.dim % max(ndim, 1))
    if isinstance(p, Replicate):
        return core.REPLICATE
    return None


def _decodes(value: DTensor, placements: Sequence[Placement]) -> bool:
    """Whether torch reads ``placements``' split factors as a shard order (and so plans a
    redistribute with its shard-order planner, not its greedy fallback)."""
    ours = [from_torch(p, value.ndim) for p in placements]
    if any(p is None for p in ours):  # Partial: not a layout's; torch plans it alone
        return True
    shape = tuple(value.device_mesh.shape)
    return core.torch_shard_order([p for p in ours if p is not None], shape) is not None


def redistribute(value: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``value.redistribute(its mesh, placements)`` with torch's own operations, correct for
    every layout the compiler emits.

    Where either side has a ``_StridedShard`` whose split factor torch cannot read as a shard
    order (a fused dimension split per component), torch plans the move with a greedy
    fallback that can apply a ``_StridedShard`` step before undoing the cuts it sits on and
    return wrong data without an error (torch 2.13). Then the tensor goes through
    ``Replicate``: torch's gather (lint refuses layouts it cannot gather) and a local split.
    That holds the whole tensor on every rank for a moment."""
    mesh = value.device_mesh
    if _decodes(value, value.placements) and _decodes(value, placements):
        return value.redistribute(mesh, placements)
    whole = value.redistribute(mesh, [Replicate()] * mesh.ndim)
    return whole.redistribute(mesh, placements)


def layout_of(value: DTensor) -> tuple[tuple[str, ...], tuple[core.Placement, ...] | None]:
    """A DTensor's (mesh axis names, layout placements or ``None``)."""
    names = tuple(value.device_mesh.mesh_dim_names or ())
    got = tuple(from_torch(p, value.ndim) for p in value.placements)
    if any(g is None for g in got):
        return names, None
    return names, tuple(g for g in got if g is not None)


def device_type() -> str:
    """``cuda`` when GPUs are present, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(spec: CompiledSpec, **sizes: int) -> DeviceMesh | MeshViews:
    """A DeviceMesh with the spec's named axes. Sizes default to the spec's; the rest axis
    takes what is left of the world size. Initializes the default process group (NCCL on
    GPUs, gloo on CPU) from the usual environment variables if nothing did yet.

    A spec with views gets one DeviceMesh per view (:class:`MeshViews`), all over the same
    ranks: a 1-D mesh over the world, unflattened per view with torch's
    ``DeviceMesh._unflatten`` (as torchtitan builds its dense and sparse meshes from its
    world mesh), so rank r has r's row-major coordinate in every view."""
    dev = device_type()
    if dev == "cuda":
        # Pick this rank's GPU before NCCL starts, so its communicators use the right one.
        if "LOCAL_RANK" in os.environ:
            local_rank = int(os.environ["LOCAL_RANK"])
        elif dist.is_initialized():
            local_rank = dist.get_rank() % max(1, torch.cuda.device_count())
        else:
            local_rank = int(os.environ.get("RANK", "0")) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    resolved = spec.sizes(world=dist.get_world_size(), **sizes)
    if spec.views is not None:
        views = view_meshes(spec, dev, resolved)
        spec.last_mesh = views
        return views
    mesh = init_device_mesh(dev, tuple(resolved.values()), mesh_dim_names=spec.axes)
    spec.last_mesh = mesh
    return mesh


def view_meshes(spec: CompiledSpec, dev: str, sizes: dict[str, int]) -> MeshViews:
    """Every view's DeviceMesh at ``sizes`` (every axis's), unflattened from one 1-D mesh
    over the world.

    The axes every view begins with (``pp``, ``dp_replicate``: shared axes come first, with
    one size, SS102) get one process group each, not one per view: the world is unflattened
    once into them and the rest, and each view unflattens the rest into its own axes
    (torch's ``_unflatten`` keeps the groups of the dimensions it does not split). A view
    whose own axes are one axis is that mesh itself, the rest named after the axis; where
    no view's own axes are one axis, the rest's group is one more that no view uses (so
    one shared axis and two such views make as many groups as before, the shared one
    still once). With three views or more, an axis only some of them share gets a group
    per view."""
    assert spec.views is not None
    world_name = "world"
    while world_name in spec.axes:
        world_name += "_"
    world = init_device_mesh(dev, (dist.get_world_size(),), mesh_dim_names=(world_name,))
    axes_of = dict(spec.views.axes)
    shared = _common_prefix(list(axes_of.values())) if len(axes_of) > 1 else ()
    if not shared:
        return MeshViews(
            {
                v: world._unflatten(0, tuple(sizes[a] for a in axes), axes)
                for v, axes in axes_of.items()
            },
            world,
        )
    own = {v: axes[len(shared) :] for v, axes in axes_of.items()}
    single = next((v for v, axes in own.items() if len(axes) == 1), None)
    rest_name = own[single][0] if single is not None else world_name
    rest = dist.get_world_size() // math.prod(sizes[a] for a in shared)
    base = world._unflatten(0, (*(sizes[a] for a in shared), rest), (*shared, rest_name))
    meshes = {}
    for view, axes in own.items():
        # (every view has an axis of its own: its fsdp axis, never a shared one, SS103)
        if view == single:
            meshes[view] = base
        else:
            meshes[view] = base._unflatten(rest_name, tuple(sizes[a] for a in axes), axes)
    return MeshViews(meshes, world)


def _common_prefix(seqs: list[tuple[str, ...]]) -> tuple[str, ...]:
    out: list[str] = []
    for names in zip(*seqs, strict=False):
        if len(set(names)) != 1:
            break
        out.append(names[0])
    return tuple(out)


def _view_device_mesh(spec: CompiledSpec, mesh: object, lm: Mesh, fqn: str) -> DeviceMesh:
    """The DeviceMesh of ``fqn``'s view (``mesh`` itself without views)."""
    if spec.views is None:
        return mesh  # type: ignore[return-value]
    view = spec.view_of_rule(spec._rule_of(fqn))
    return mesh[view]  # type: ignore[index]


def submesh(mesh: DeviceMesh, names: Sequence[str], spec: CompiledSpec | None = None) -> DeviceMesh:
    """``mesh``'s sub-mesh over axes ``names``, in ``spec``'s spelling where given (an axis
    the mesh calls by an alias is found by it)."""
    if spec is not None:
        names = spec.mesh_names(mesh, names)
    if tuple(names) == tuple(mesh.mesh_dim_names or ()):
        return mesh
    return mesh[tuple(names)]


def placements(spec: CompiledSpec, fqn: str, mesh: DeviceMesh, shape=None) -> tuple[Placement, ...]:
    """Torch placements of ``fqn``'s DTensor, on ``mesh`` minus the parameter's local axes."""
    return tuple(to_torch(p) for p in spec.abstract_placements(fqn, mesh, shape))


def take(t: torch.Tensor, ranges: Sequence[tuple[tuple[int, int], ...]]) -> torch.Tensor:
    """The sub-tensor of ``t`` at the given per-dim index ranges (a copy)."""
    out = t
    for d, r in enumerate(ranges):
        if len(r) == 1:
            a, b = r[0]
            if (a, b) != (0, out.shape[d]):
                out = out.narrow(d, a, b - a)
        elif not r:
            out = out.narrow(d, 0, 0)
        else:
            out = torch.cat([out.narrow(d, a, b - a) for a, b in r], dim=d)
    if t.numel() and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
        return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


def shard_for_rank(
    layout: ParamLayout, lmesh: Mesh, coord: Sequence[int], module_tensor: torch.Tensor
) -> torch.Tensor:
    """This rank's DTensor local tensor, cut from the module's tensor."""
    view = _dtensor_view(layout, lmesh, coord)
    if module_tensor.is_meta:
        shape = [ranges_len(r) for r in view]
        return torch.empty(shape, dtype=module_tensor.dtype, device="meta")
    return take(module_tensor, view)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(1, s)
    return tuple(reversed(stride))


def distribute(spec: CompiledSpec, model: nn.Module, mesh: DeviceMesh | MeshViews) -> nn.Module:
    """Convert ``model``'s parameters to DTensors on the spec's layout, in place.

    Works for a full model (each rank cuts its shard locally, no communication), a
    meta-device model (meta DTensors; then ``to_empty`` and initialise, torchtitan style),
    and modules that already hold local model-parallel shards (Megatron style: only the
    remaining axes become DTensor placements). Ignored parameters, and parameters whose
    every mesh axis is local to them, are left alone. Tied parameters (one tensor under
    several names) stay tied, and their names must agree on the layout. Every parameter is
    planned and converted before any is replaced, so an error leaves the model untouched.
    A spec with views takes :class:`MeshViews` (``build_mesh()``'s): each parameter becomes
    a DTensor on its view's DeviceMesh.
    """
    lmesh = spec.layout_mesh(mesh)
    if mesh.get_coordinate() is None:
        raise SpecError("this rank is not part of the mesh")
    spec.last_mesh = mesh
    named = list(model.named_parameters(remove_duplicate=False))
    # A pipeline stage's model: its names -> the whole model's (raises, naming what the
    # stage model lacks or should not hold). Identity without a pipeline.
    gname = spec.global_names([f for f, _ in model.named_parameters()], mesh)
    table = spec.table(lmesh)
    counts = spec.name_indexed_counts_of(f for f, _ in named) if table is None else {}
    plans: dict[int, tuple[str, nn.Parameter, ParamLayout]] = {}
    errors: list[str] = []
    problems: set[tuple[str | None, core.LayoutProblem | None]] = set()
    for fqn, p in named:
        if spec.is_ignored(fqn):
            continue
        tied = plans.get(id(p))
        fqn = gname.get(fqn, fqn)
        if tied is not None and table is not None and fqn not in table:
            continue  # a tied alias the manifest leaves out (state dicts hold it once)
        if tied is None and (
            isinstance(p, DTensor) or isinstance(getattr(p, "data", None), DTensor)
        ):
            errors.append(f"{fqn}: already a DTensor")
            continue
        try:
            layout = spec.layout(fqn, lmesh, tuple(p.shape), counts.get(fqn))
        except SpecError as e:
            errors.append(str(e))
            problems.add((e.code, e.problem))
            continue
        if tied is not None:
            if layout != tied[2]:
                errors.append(
                    f"{fqn} is the same tensor as {tied[0]} (tied), but the spec gives the "
                    "two names different layouts"
                )
            continue
        plans[id(p)] = (fqn, p, layout)
    if table is not None and spec.pipeline is None:  # (stage models: global_names checked)
        seen = {f for f, _ in named}
        missing = sorted(f for f in table if f not in seen)
        if missing:
            errors.append(
                f"the model lacks {len(missing)} parameter(s) of the manifest, e.g. {missing[0]!r}"
            )
    if errors:
        # One problem keeps its kind (a rule that does not fit, say).
        code, problem = (
            problems.pop() if len(problems) == 1 and len(errors) == 1 else ("SS031", None)
        )
        raise SpecError("cannot distribute:\n  " + "\n  ".join(errors), code, problem=problem)
    new: dict[int, nn.Parameter] = {}
    meshes: dict[tuple[int, tuple[str, ...]], DeviceMesh] = {}
    for key, (fqn, p, layout) in plans.items():
        vmesh = spec.mesh_of(fqn, lmesh)  # its view's (lmesh itself without views)
        dmesh = _view_device_mesh(spec, mesh, lmesh, fqn)
        names = dtensor_mesh(layout, vmesh).names
        if not names:
            continue  # every axis is local to it: the module already holds its only copy
        if (id(dmesh), names) not in meshes:
            meshes[(id(dmesh), names)] = submesh(dmesh, names, spec)
        sub = meshes[(id(dmesh), names)]
        coord = dmesh.get_coordinate()
        assert coord is not None
        local = shard_for_rank(layout, vmesh, coord, p.detach())
        if not local.is_meta and dmesh.device_type != local.device.type:
            local = local.to(dmesh.device_type)
        gshape = module_shape(layout, vmesh)
        dt = DTensor.from_local(
            local,
            sub,
            [to_torch(x) for x in dtensor_placements(layout, vmesh)],
            run_check=False,
            shape=torch.Size(gshape),
            stride=_contiguous_stride(gshape),
        )
        new[key] = nn.Parameter(dt, requires_grad=p.requires_grad)
    for fqn, p in named:
        if id(p) not in new:
            continue
        owner, _, leaf = fqn.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._parameters[leaf] = new[id(p)]
    return model


def expected_local(spec: CompiledSpec, fqn: str, mesh: DeviceMesh, shape=None):
    """(local shape, placements) the compiled layout gives this rank, for verification."""
    lmesh = spec.layout_mesh(mesh)
    layout = spec.layout(fqn, lmesh, shape)
    vmesh = spec.mesh_of(fqn, lmesh)
    coord = _view_device_mesh(spec, mesh, lmesh, fqn).get_coordinate()
    if coord is None:
        raise SpecError(f"{fqn}: this rank is not in the mesh it is verified on")
    view = _dtensor_view(layout, vmesh, coord)
    return tuple(ranges_len(r) for r in view), tuple(
        to_torch(x) for x in dtensor_placements(layout, vmesh)
    )


__all__ = [
    "build_mesh",
    "device_type",
    "distribute",
    "expected_local",
    "from_torch",
    "layout_of",
    "placements",
    "shard_for_rank",
    "submesh",
    "take",
    "to_torch",
]
