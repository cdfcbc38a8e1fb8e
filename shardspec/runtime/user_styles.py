"""The styles a caller passes to ``parallelize(..., styles=...)``, checked before the model
changes.

A ``ParallelStyle`` says what it does to a module only by doing it, and torch's own styles
decide by the module's class (``ColwiseParallel`` cuts a Linear's weight on dimension 0 and
an Embedding's on 1). So each user style is tried the way ``parallelize`` will apply it,
with torch's ``parallelize_module``, on a *meta-device copy* of its module: the copy shares
no tensor, hook table or submodule with the model, holds no data, and torch's
``distribute_tensor`` skips its collectives for meta tensors. What the copy's parameters
then are (plain tensors or DTensors on the tensor-parallel mesh, with their placements) is
compared, layout against layout, with what the spec gives each parameter over that axis.
This holds for any ``ParallelStyle`` subclass, torch's or the caller's: a style whose
``_apply`` fails on the copy (it needs real data, or communicates) is refused with its
error, before anything changed.

A style may also leave the parameters alone (``PrepareModuleInput`` on a block): then they
must be replicated over the axis in the spec, or belong to submodules that get their own
style (the spec's, or another of the caller's).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardspec.core import layout as core
from shardspec.core.layout import Mesh, same_layout
from shardspec.runtime.dtensor import layout_of


def meta_copy(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors of the same
    shapes, dtypes and ``requires_grad`` (tied ones stay tied), with its own submodules and
    its own hook tables and other containers (shallow copies), so that applying a style to
    the copy leaves ``module`` as it was."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    new = copy.copy(module)
    memo[id(module)] = new
    for key, value in vars(module).items():
        if isinstance(value, (dict, list, set)):
            new.__dict__[key] = copy.copy(value)
    for name, p in module._parameters.items():
        if p is not None:
            if id(p) not in memo:
                meta = torch.empty_like(p, device="meta")
                memo[id(p)] = nn.Parameter(meta, requires_grad=p.requires_grad)
            new._parameters[name] = memo[id(p)]
    for name, b in module._buffers.items():
        if b is not None:
            if id(b) not in memo:
                memo[id(b)] = torch.empty_like(b, device="meta")
            new._buffers[name] = memo[id(b)]
    for name, child in module._modules.items():
        if child is not None:
            new._modules[name] = meta_copy(child, memo)
    return new


def _describe(axis: str, placement: core.Placement | None) -> str:
    return "a plain tensor (whole on every rank)" if placement is None else f"{axis}={placement}"


def style_problems(
    owner: str,
    style: Any,
    model: nn.Module,
    tp_mesh: DeviceMesh,
    want: Mapping[str, core.Placement],
    styled: set[str],
) -> list[str]:
    """Why the caller's ``style`` for module ``owner`` would not give the spec's layout
    (an empty list when it does). ``want``: each planned parameter's placement over the
    tensor-parallel axis in the spec (by the model's names); ``styled``: the modules whose
    parameters another style places."""
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    axis = (tp_mesh.mesh_dim_names or ("tp",))[0]
    name = f"styles[{owner!r}]: {type(style).__name__}"
    if not isinstance(style, ParallelStyle):
        return [f"{name} is not a torch ParallelStyle"]
    module = model.get_submodule(owner) if owner else model
    trial = meta_copy(module)
    try:
        parallelize_module(trial, tp_mesh, style)
    except Exception as e:  # the style cannot apply to this module: say why, change nothing
        return [
            f"{name} cannot be applied to {owner or '<root>'} ({type(module).__name__}): "
            f"{type(e).__name__}: {e}"
        ]
    one = Mesh((axis,), (tp_mesh.size(),))
    problems = []
    prefix = f"{owner}." if owner else ""
    for rel, value in trial.named_parameters(remove_duplicate=False):
        fqn = prefix + rel
        if fqn not in want:
            continue  # ignored by the spec
        sub = fqn.rpartition(".")[0]
        shape = tuple(value.shape)
        if isinstance(value, DTensor):
            names, got = layout_of(value)
            if got is None or names != (axis,):
                problems.append(
                    f"{name} makes {fqn} a DTensor with placements {tuple(value.placements)} "
                    f"on mesh {names}, not a layout over {axis!r} alone"
                )
                continue
            placement: core.Placement | None = got[0]
        else:
            placement = None
        if sub != owner and sub in styled:
            if placement is not None:
                problems.append(
                    f"{name} also places {fqn} ({_describe(axis, placement)}), whose module "
                    f"{sub} gets its own style: put the style on a module that holds no "
                    "parameter of those"
                )
            continue
        spec_p = want[fqn]
        have = (placement,) if placement is not None else ()
        names_have = (axis,) if placement is not None else ()
        bad = same_layout(shape, one, (spec_p,), names_have, have)
        if bad is None:
            continue
        coord, idx_want, idx_have = bad
        verb = "leaves" if placement is None else "puts"
        problems.append(
            f"{name} {verb} {fqn} as {_describe(axis, placement)}, but the spec gives it "
            f"{axis}={spec_p}: {axis} rank {coord[0]} would hold {fmt_ranges(idx_have)}, the spec "
            f"gives it {fmt_ranges(idx_want)}"
        )
    return problems


def fmt_ranges(ranges: tuple) -> str:
    """Per-dimension index ranges as ``[0:4, 2:3+5:6]`` (``-``: none)."""
    return "[" + ", ".join("+".join(f"{a}:{b}" for a, b in r) or "-" for r in ranges) + "]"
