"""Pipeline stages at train time: which stage this rank is, what it holds, and cutting a
whole model down to one stage (torchtitan's way: drop what other stages hold, keep names).

The stage arithmetic is :mod:`shardspec.core.stages`, the very code the compiler checked the
spec's ``pipeline`` block with. A stage model then goes through ``parallelize`` (its
DTensors span the mesh without the pipeline axis) and into
``torch.distributed.pipelining.PipelineStage`` with the pipeline axis's process group.

A folded spec's functions take ``build_mesh()``'s :class:`MeshViews` wherever a mesh is
taken: the pipeline axis is shared by every view and comes first in each (SS105, SS102), so
the stage, the pipeline group and the tie groups are read on the first view's DeviceMesh.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardspec.core.stages import StagePlan, layer_of
from shardspec.runtime.spec import CompiledSpec, MeshViews, SpecError

# A spec's mesh at train time: one DeviceMesh, or a folded spec's views (build_mesh()'s
# MeshViews, or a mapping view -> DeviceMesh in the spec's order of views).
AnyMesh = DeviceMesh | MeshViews | Mapping[str, DeviceMesh]


def stage_mesh(mesh: AnyMesh) -> DeviceMesh:
    """The DeviceMesh whose pipeline axis gives the stages: ``mesh`` itself, or of a
    folded spec's views the first (the spec's default view; the stage functions check
    the views against the spec first). Every view has the pipeline axis, among the shared
    axes that come first with the same sizes in every view (SS102, SS105), so a rank's
    stage, its pipeline group and its peers on other stages are the same whichever view is
    read."""
    if isinstance(mesh, Mapping):
        return next(iter(mesh.values()))
    return mesh


def _plan(spec: CompiledSpec, mesh: object) -> StagePlan:
    sp = spec.stage_plan(mesh)
    if sp is None:
        raise SpecError(f"spec {spec.name!r} declares no pipeline", "SS090")
    return sp


def stage_of(spec: CompiledSpec, mesh: AnyMesh) -> int:
    """This rank's pipeline stage: its coordinate on the pipeline axis."""
    _plan(spec, mesh)
    coord = stage_mesh(mesh).get_coordinate()
    if coord is None:
        raise SpecError("this rank is not part of the mesh")
    stage = spec.stage_of(mesh, coord)
    assert stage is not None
    return stage


def num_stages(spec: CompiledSpec, mesh: object) -> int:
    """The number of pipeline stages on ``mesh``."""
    return _plan(spec, mesh).n_stages


def stage_layers(spec: CompiledSpec, mesh: object, stage: int | None = None) -> list[str]:
    """The global layer values (the split's captures, in order) that ``stage`` holds;
    ``stage`` defaults to this rank's."""
    sp = _plan(spec, mesh)
    s = stage_of(spec, mesh) if stage is None else stage  # type: ignore[arg-type]
    _check_stage(sp, s)
    return list(sp.stage_layers[s])


def stage_params(spec: CompiledSpec, mesh: object, stage: int | None = None) -> list[str]:
    """The global names of the parameters ``stage`` holds (default: this rank's)."""
    sp = _plan(spec, mesh)
    s = stage_of(spec, mesh) if stage is None else stage  # type: ignore[arg-type]
    _check_stage(sp, s)
    return sp.params_of(s)


def _check_stage(sp: StagePlan, stage: int) -> None:
    if not 0 <= stage < sp.n_stages:
        raise SpecError(
            f"stage {stage} is not one of the {sp.n_stages} pipeline stage(s)",
            "SS004",
            f"pass a stage from 0 to {sp.n_stages - 1}, or none for this rank's",
        )


def split_stage(
    spec: CompiledSpec, model: nn.Module, mesh: AnyMesh, stage: int | None = None
) -> nn.Module:
    """Cut a whole model (meta, CPU or GPU) down to ``stage`` (default: this rank's), in
    place, as torchtitan's pipeline split does: layers of other stages are deleted from
    their ``ModuleDict`` (names stay global), and modules only other stages hold are set to
    ``None`` (the model's forward must skip a ``None`` module, as torchtitan's do). With
    ``split ... local`` the kept layers are renumbered from 0 (a ``ModuleList`` or
    ``ModuleDict`` rebuilt in order), as Megatron's stages number them.

    Persistent buffers go with their modules: a module that holds only other stages'
    buffers is dropped too.

    Checked before anything changes: the model must hold exactly the manifest's
    parameters, and whole modules must belong to one stage; afterwards
    :meth:`CompiledSpec.global_names` accepts the stage model.
    """
    sp = _plan(spec, mesh)
    s = stage_of(spec, mesh) if stage is None else stage
    _check_stage(sp, s)
    names = [n for n, _ in model.named_parameters() if not spec.is_ignored(n)]
    every = dict(model.named_parameters(remove_duplicate=False))  # tied names too
    _check_ties(sp, every)
    unknown = sorted(set(names) - set(sp.stage))
    missing = sorted(set(sp.stage) - set(names))
    if unknown or missing:
        what = (
            [f"{len(unknown)} parameter(s) the manifest lacks, e.g. {unknown[0]!r}"]
            if unknown
            else []
        )
        what += [f"lacks {len(missing)} of the manifest's, e.g. {missing[0]!r}"] if missing else []
        raise SpecError(
            f"split_stage needs the whole model; this one has {'; and '.join(what)}",
            "SS091",
            "build the whole model (on the meta device, say) and split it, or pass a stage "
            "model built by hand straight to parallelize",
        )
    # The stage model's own names: a tied weight keeps its alias's name on the alias's
    # stage (whose module holds it there), and both names where the stage holds both. A
    # persistent buffer goes with its module (one no declaration covers stays everywhere).
    keep = {sp.alias_on(f, s) or f for f in sp.stored_of(s)}
    keep |= {a for a, st in sp.tie_stage.items() if st == s}
    names = [n for n in every if not spec.is_ignored(n)]
    names += [
        n
        for n, _ in model.named_buffers()
        if spec.stores_buffer(n) and not spec.is_ignored(n) and n not in every
    ]
    # Containers of the split family: "layers" for `layers.{layer}`.
    family: dict[str, nn.Module] = {}
    for n in names:
        value = layer_of(sp.spec, n)
        if value is None:
            continue
        head = _layer_prefix(n, value, sp)
        family.setdefault(head, model.get_submodule(head) if head else model)
    # Drop the outermost module all of whose parameters other stages hold: the first prefix
    # of a name that no kept parameter lies under (one pass, not one scan per prefix).
    held = {".".join(n.split(".")[:k]) for n in keep for k in range(1, n.count(".") + 1)}
    drops: dict[str, tuple[nn.Module, str]] = {}
    for n in names:
        if n in keep or layer_of(sp.spec, n) is not None:
            continue
        parts = n.split(".")
        k = next((k for k in range(1, len(parts)) if ".".join(parts[:k]) not in held), None)
        if k is None:
            raise SpecError(
                f"{n!r} is another stage's, but every module holding it also holds this "
                "stage's parameters",
                "SS092",
                "split_stage drops whole modules: place the module on one stage, or build "
                "the stage model by hand",
            )
        owner = ".".join(parts[: k - 1])
        drops.setdefault(
            ".".join(parts[:k]), (model.get_submodule(owner) if owner else model, parts[k - 1])
        )
    kept = list(sp.stage_layers[s])
    for head, container in family.items():
        if not isinstance(container, (nn.ModuleDict, nn.ModuleList)):
            raise SpecError(
                f"{head or 'the model'} is a {type(container).__name__}: the split family "
                "needs a ModuleDict or ModuleList",
                "SS095",
                "keep the layers in an nn.ModuleDict (as torchtitan does) or nn.ModuleList",
            )
        if isinstance(container, nn.ModuleList) and not sp.spec.local_names:
            raise SpecError(
                f"{head} is a ModuleList: dropping layers renumbers it, but the spec keeps "
                "global names",
                "SS095",
                "use an nn.ModuleDict (as torchtitan does), or `split ... local` for "
                "stage-local numbering",
            )
    for parent, attr in drops.values():
        setattr(parent, attr, None)
    for head, container in family.items():
        assert isinstance(container, (nn.ModuleDict, nn.ModuleList))  # checked above
        layers = [
            container[v] if isinstance(container, nn.ModuleDict) else container[int(v)]
            for v in kept
        ]
        if sp.spec.local_names:
            new: nn.Module = (
                nn.ModuleDict({str(i): m for i, m in enumerate(layers)})
                if isinstance(container, nn.ModuleDict)
                else nn.ModuleList(layers)
            )
        else:
            new = nn.ModuleDict(dict(zip(kept, layers, strict=True)))
        owner, _, attr = head.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, new)
    spec.global_names([n for n, _ in model.named_parameters()], mesh, _coord_for(spec, mesh, s))
    return model


def _check_ties(sp: StagePlan, every: dict[str, nn.Parameter]) -> None:
    """A whole model holds each tie as one tensor under both names."""
    problems = []
    for alias, source in sp.spec.ties:
        if alias not in every:
            problems.append(f"it has no parameter {alias!r}, which the spec ties to {source}")
        elif source in every and every[alias] is not every[source]:
            problems.append(
                f"{alias} is a tensor of its own, but the spec ties it to {source}: tie them "
                f"(model.{alias} = model.{source})"
            )
    if problems:
        raise SpecError(
            "split_stage cannot cut this model: " + "; ".join(problems),
            "SS097",
            "a spec's tie describes a tied model (named_parameters() lists the weight once)",
        )


def _layer_prefix(fqn: str, value: str, sp: StagePlan) -> str:
    """The container of the split family in ``fqn`` (``layers`` of ``layers.3.w``)."""
    from shardspec.core.stages import prefix_glob

    g = prefix_glob(sp.spec.split or "")
    m = g.regex.match(fqn)
    assert m is not None
    a, _ = m.span(g.captures[0])
    return fqn[: max(0, a - 1)]


def _coord_for(spec: CompiledSpec, mesh: AnyMesh, stage: int) -> tuple[int, ...]:
    lm = spec.layout_mesh(mesh)  # a folded spec's: its first view's axes
    coord = list(stage_mesh(mesh).get_coordinate() or (0,) * len(lm.names))
    coord[lm.names.index(spec.pipeline.axis)] = stage  # type: ignore[union-attr]
    return tuple(coord)


def pipeline_group(spec: CompiledSpec, mesh: AnyMesh):
    """The process group of the pipeline axis (``PipelineStage(..., group=...)``); of a
    folded spec's views, the first view's (the same ranks in every view)."""
    _plan(spec, mesh)
    return stage_mesh(mesh).get_group(spec.pipeline.axis)  # type: ignore[union-attr]


# --------------------------------------------------------------------------- tied weights


def _tie_group(spec: CompiledSpec, views: AnyMesh, stages: tuple[int, ...]):
    """The process group of this rank and its peers on ``stages`` (same coordinate on
    every other axis of the stage mesh, see :func:`stage_mesh`). The pipeline axis's own
    group where the stages are all of them; otherwise groups made once, by every rank
    (``new_group`` is collective)."""
    import torch.distributed as dist

    mesh = stage_mesh(views)
    axis = spec.pipeline.axis  # type: ignore[union-attr]
    names = tuple(mesh.mesh_dim_names or ())
    ax = names.index(axis)
    ranks = mesh.mesh
    if len(stages) == ranks.shape[ax]:
        return mesh.get_group(axis)
    # Cached with the mesh (and gone with it: a module-level cache would keep the groups,
    # and their threads, alive after the process groups are destroyed).
    cache = _TIE_GROUPS.setdefault(mesh, {})
    if stages not in cache:
        lines = ranks.movedim(ax, -1).reshape(-1, ranks.shape[ax])[:, list(stages)].tolist()
        me = dist.get_rank()
        mine = None
        for line in lines:  # every rank creates every group, in the same order
            g = dist.new_group(line)
            if me in line:
                mine = g
        cache[stages] = mine
    return cache[stages]


_TIE_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ties(spec: CompiledSpec, model: nn.Module, mesh: AnyMesh):
    """``(tensor's local part, param, source stage, group)`` for every weight tied across
    stages that this rank holds, in the spec's order; every rank must call (groups)."""
    from torch.distributed.tensor import DTensor

    sp = _plan(spec, mesh)
    s = stage_of(spec, mesh)
    params = dict(model.named_parameters())
    out = []
    for _alias, source in sp.spec.ties:
        stages = sp.stages_of(source)
        if len(stages) < 2:
            continue  # one stage holds both names: the model ties them itself
        group = _tie_group(spec, mesh, stages)
        if s not in stages:
            continue
        name = sp.local_name(source, s)
        p = params.get(name)
        if p is None:
            raise SpecError(
                f"the model has no parameter {name!r}: stage {s} holds the tied weight "
                f"{source} under that name",
                "SS091",
                "pass the stage model that parallelize was given",
            )
        local = p.to_local() if isinstance(p, DTensor) else p
        out.append((local, p, sp.stage[source], group))
    return out


def reduce_tied_grads(spec: CompiledSpec, model: nn.Module, mesh: AnyMesh) -> None:
    """Sum the gradients of weights tied across pipeline stages (the embedding on the
    first stage, its alias in the output head on the last), as the whole model's single
    tensor would accumulate both uses. Call on every rank after the schedule's step (after
    FSDP's reduce-scatter) and before the optimizer step; other stages' ranks only take
    part in making the groups, once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for local, p, _, group in _ties(spec, model, mesh):
        g = p.grad
        if g is None:  # this stage did not use it: the sum is the other stage's
            buf = torch.zeros_like(local)
        else:
            buf = g.to_local() if isinstance(g, DTensor) else g
        dist.all_reduce(buf, group=group)
        if g is None:
            p.grad = (
                DTensor.from_local(buf, p.device_mesh, p.placements, run_check=False)
                if isinstance(p, DTensor)
                else buf
            )


def broadcast_tied(spec: CompiledSpec, model: nn.Module, views: AnyMesh) -> None:
    """Copy every tied weight from its source's stage to its alias's (as Megatron does
    at start-up): for stage models initialized apart. Call on every rank. A checkpoint or
    ``load_hf`` gives both copies the stored value already."""
    import torch
    import torch.distributed as dist

    mesh = stage_mesh(views)
    axis = spec.pipeline.axis  # type: ignore[union-attr]
    names = tuple(mesh.mesh_dim_names or ())
    coord = list(mesh.get_coordinate() or ())
    for local, _, src_stage, group in _ties(spec, model, views):
        at = list(coord)
        at[names.index(axis)] = src_stage
        src = int(mesh.mesh[tuple(at)].item())
        with torch.no_grad():
            dist.broadcast(local, src=src, group=group)
