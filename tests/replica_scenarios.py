"""Scenario of tests/test_replicas.py (2 gloo ranks): parameters the spec replicates over
the fsdp axis, as parallelize leaves them (``_replicate_as_dtensors`` + ``_average_grads``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate


class Owner(nn.Module):
    """``a`` plain (parallelize converts it), ``b`` already a Replicate DTensor (as a
    style would leave it): the forward records what it sees."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(3))
        b = DTensor.from_local(torch.full((3,), 2.0), mesh, [Replicate()], run_check=False)
        self.b = nn.Parameter(b)
        self.seen: list[tuple[str, str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((type(self.a).__name__, type(self.b).__name__))
        return x * self.a + x * self.b.to_local()


def run(rank: int, world: int) -> dict[str, Any]:
    from shardspec.runtime.parallel import _average_grads, _replicate_as_dtensors

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = nn.Module()
    model.m = Owner(mesh)
    params = _replicate_as_dtensors(model, ["m.a", "m.b"], mesh)
    _average_grads(params, mesh)
    x = torch.full((3,), float(rank + 1))
    model.m(x).sum().backward()
    a, b = model.m.a, model.m.b
    return {
        "returned": sorted(n for n, p in model.named_parameters() if any(p is q for q in params)),
        "types_after": (type(a).__name__, type(b).__name__),
        "seen": model.m.seen,
        "a_grad": a.grad.to_local().tolist(),
        "b_grad": b.grad.to_local().tolist(),
    }
