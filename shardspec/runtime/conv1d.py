"""Tensor-parallel styles for transformers' ``Conv1D`` (GPT-2's attention and MLP): a
Linear whose weight is stored transposed, ``[in, out]``, computing ``y = x @ W + b``.

torch's ``ColwiseParallel`` and ``RowwiseParallel`` refuse any module but ``nn.Linear`` and
``nn.Embedding``, and would cut a Conv1D's weight on the wrong dimension (a Linear's
``[out, in]``). These styles keep torch's machinery (``distribute_module``, the input and
output redistribution hooks of the two styles) and cut the parameters as the spec says:

* :class:`Conv1DColwise`: the weight's ``out`` dimension (dim 1) and the bias (dim 0),
  per component where the spec fuses ``out`` (GPT-2's ``c_attn``, q|k|v); the input is
  replicated, each rank computes its output columns ``x @ W[:, cols] + b[cols]`` on its
  local shards, and the output is sharded on its last dimension (per component for a fused
  one: the rank's slice of q, of k and of v, one after another).
* :class:`Conv1DRowwise`: the weight's ``in`` dimension (dim 0), the bias replicated; the
  input is sharded on its last dimension, each rank's ``x_r @ W[rows_r]`` is a partial sum
  (DTensor's ``addmm`` adds the bias on one rank only), reduced to the output layout.

:class:`LocalWidth` is for the module that reads a column-parallel output: GPT-2's
attention splits ``c_attn``'s output into q, k and v by ``split_size``, a global width; on
a tensor-parallel rank it must be the rank's width (the heads then follow from ``-1`` in
its own ``view``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from shardspec.core import layout as core
from shardspec.runtime.parallel import SpecColwise, SpecRowwise, _partition
from shardspec.runtime.spec import SpecError


def _distribute(style: Any, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """torch's ``ColwiseParallel._apply`` / ``RowwiseParallel._apply`` for a Conv1D: the
    parameters cut as the spec says, torch's own input and output hooks."""
    return distribute_module(
        module,
        device_mesh,
        lambda _name, mod, mesh: _partition(style, mod, mesh) if mod is module else None,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class Conv1DColwise(SpecColwise):
    """Column-parallel ``Conv1D``: weight ``[in, out]`` cut on ``out`` (dim 1), bias on
    dim 0, as the spec's placements say (``param_placements``: leaf -> placement on the
    TP axis). The module computes on its local shards (its ``nf``, the output width its
    forward reshapes to, is the rank's for the call), and the output is the rank's
    columns: ``Shard(-1)``, or per component for a fused ``out`` (``_StridedShard``)."""

    def __init__(self, param_placements: Mapping[str, core.Placement], **kwargs: Any) -> None:
        super().__init__(param_placements, **kwargs)
        weight = self.param_placements.get("weight", core.REPLICATE)
        if not (isinstance(weight, (core.Shard, core.StridedShard)) and weight.dim == 1):
            raise SpecError(
                f"Conv1DColwise cuts a Conv1D weight [in, out] on out (dim 1); the spec "
                f"gives it {weight}"
            )

    def _distribute(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _distribute(self, module, device_mesh)

    def _local_attrs(self, module: nn.Module) -> dict[str, tuple[int, int]] | None:
        weight = module.weight
        assert isinstance(weight, DTensor)
        return {"nf": (int(weight.to_local().shape[1]), int(weight.shape[1]))}


class Conv1DRowwise(SpecRowwise):
    """Row-parallel ``Conv1D``: weight ``[in, out]`` cut on ``in`` (dim 0), bias
    replicated; input ``Shard(-1)``, output the reduced sum (``Replicate`` unless the
    spec's style states another layout)."""

    def __init__(self, param_placements: Mapping[str, core.Placement], **kwargs: Any) -> None:
        super().__init__(param_placements, **kwargs)
        weight = self.param_placements.get("weight", core.REPLICATE)
        bias = self.param_placements.get("bias", core.REPLICATE)
        if not (isinstance(weight, core.Shard) and weight.dim == 0) or not isinstance(
            bias, core.Replicate
        ):
            raise SpecError(
                f"Conv1DRowwise cuts a Conv1D weight [in, out] on in (dim 0) and keeps its "
                f"bias whole; the spec gives weight {weight}, bias {bias}"
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Shard

        self.desired_input_layouts = (Shard(-1),)  # as torch's RowwiseParallel for a Linear
        return _distribute(self, module, device_mesh)


class LocalWidth(ParallelStyle):
    """A module whose forward splits a column-parallel output by widths it stores as
    attributes (GPT-2's attention: ``split_size``, one of q, k, v): each attribute divided
    by the TP axis's size, so that the module splits its rank's columns. No parameter or
    activation changes."""

    def __init__(self, *attrs: str) -> None:
        super().__init__()
        if not attrs:
            raise SpecError("LocalWidth needs the names of the attributes to divide")
        self.attrs = attrs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        n = device_mesh.size()
        widths = {a: getattr(module, a, None) for a in self.attrs}
        good = {a: w for a, w in widths.items() if isinstance(w, int) and w % n == 0}
        bad = [f"{a}={w!r}" for a, w in widths.items() if a not in good]
        if bad:
            raise SpecError(
                f"LocalWidth: {type(module).__name__} attributes {', '.join(bad)} are not "
                f"widths divisible by the TP size {n}"
            )
        for a, w in good.items():
            setattr(module, a, w // n)
        return module

    def __repr__(self) -> str:
        return f"LocalWidth({', '.join(map(repr, self.attrs))})"


def global_splits(model: nn.Module, plan: Mapping[str, Any], tp: int) -> list[str]:
    """Modules that would split a per-component column-parallel Conv1D's output by a global
    width: a parent with a ``split_size`` attribute equal to one component of its child's
    fused output (GPT-2's attention and ``c_attn``) and no style of its own in ``plan``. Its
    forward would split the rank's q|k|v columns at the wrong places; one line each."""
    out = []
    for owner, style in plan.items():
        placement = getattr(style, "param_placements", {}).get("weight")
        if tp < 2 or not isinstance(style, Conv1DColwise):
            continue
        if not isinstance(placement, core.StridedShard):
            continue
        parent = owner.rpartition(".")[0]
        module = model.get_submodule(parent) if parent else model
        width = getattr(module, "split_size", None)
        weight = model.get_submodule(owner).weight
        assert isinstance(weight, torch.Tensor)
        nf = int(weight.shape[1])
        if parent in plan or width != nf // placement.split_factor:
            continue
        out.append(
            f"{parent or '<root>'}: splits {owner}'s output by split_size={width}, a global "
            f"width, but each tp rank computes its {nf // tp} columns (its slice of each "
            f"component); pass styles={{{parent!r}: LocalWidth('split_size')}} "
            "(shardspec.runtime.conv1d) to parallelize, one per such module"
        )
    return out


__all__ = ["Conv1DColwise", "Conv1DRowwise", "LocalWidth", "global_splits"]
