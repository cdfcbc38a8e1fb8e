"""The MoE benchmark's baseline: what a torchtitan user writes by hand to train the example
MoE (``examples/models/moe.py``) with tensor, expert and fully-sharded data parallelism
folded over the same ranks. Independent of shardspec (nothing here imports it), so that
``bench/bench_train.py --model moe`` measures shardspec's side against it.

* meshes (:func:`build_meshes`): a 1-D mesh over the world, unflattened with torch's
  ``DeviceMesh._unflatten`` into a dense mesh ``(fsdp, tp)`` and a sparse mesh
  ``(ep, efsdp)``, as torchtitan builds its dense and sparse meshes;
* attention over tp with torch's ``ColwiseParallel`` (``wq``, ``wk``, ``wv``: heads),
  ``RowwiseParallel`` (``wo``) and ``SequenceParallel`` over the heads dimension for the
  per-head ``q_norm`` and ``k_norm`` (their weight's gradient summed over tp); the other
  norms, the router, the embedding and the head whole on every tp rank;
* the stacked experts with this module's own :class:`ExpertParallel` over ep, written after
  torchtitan's ``torchtitan/distributed/expert_parallel.py``: a ``ParallelStyle`` whose
  ``distribute_module`` input hook routes and sorts the (token, choice) rows by expert,
  exchanges the counts and the rows with ``all_to_all_single`` (the rows with the
  autograd-aware ``all_to_all_single_autograd``), groups them by local expert, and whose
  output hook undoes it all; the experts run grouped (:func:`grouped_experts_forward`, a
  loop over the local experts on their contiguous rows, torchtitan's for-loop path);
* FSDP2: ``fully_shard`` on each block's experts over efsdp first, then on each block and
  the root over fsdp (torchtitan's order).

Gradient scale: each rank's loss is the mean over its tokens, and the tp ranks of a dense
group hold the same tokens. An expert's gradient after the reverse all-to-all sums the
losses of its ep group, and the reduce-scatter over efsdp sums those of every ep group: the
losses of all ``world`` ranks, ``world / dp`` times each data shard's. FSDP2 would divide
by the efsdp size; the global mean needs a division by ``world`` (torchtitan sets the
experts' divide factor in the same way, to its data-parallel degree, where its tp ranks
hold different tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
    wait_tensor,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["ExpertParallel", "build_meshes", "grouped_experts_forward", "parallelize_moe"]


def build_meshes(world: int, tp: int, ep: int, device: str = "cpu") -> tuple[Any, Any]:
    """``(dense, sparse)``: DeviceMeshes ``(fsdp, tp)`` and ``(ep, efsdp)`` over the same
    ``world`` ranks, unflattened from one 1-D mesh."""
    if world % tp or world % ep:
        raise ValueError(f"tp ({tp}) and ep ({ep}) must divide the world ({world})")
    flat = init_device_mesh(device, (world,), mesh_dim_names=("world",))
    dense = flat._unflatten(0, (world // tp, tp), ("fsdp", "tp"))
    sparse = flat._unflatten(0, (ep, world // ep), ("ep", "efsdp"))
    return dense, sparse


def grouped_experts_forward(
    experts: nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """The local experts on rows ``x`` grouped by local expert (``num_tokens_per_expert``
    rows each, in order): a SwiGLU per expert on its rows, outputs in the same order."""

    def local(name: str) -> torch.Tensor:
        w = experts.get_parameter(name)
        return w.to_local() if isinstance(w, DTensor) else w

    w1, w2, w3 = local("w1"), local("w2"), local("w3")
    outs = []
    for e, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
        outs.append(F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e]))
    return torch.cat(outs)


class ExpertParallel(ParallelStyle):
    """Expert parallelism with all-to-all token dispatch for the example MoE's stacked
    ``Experts``, whose forward the MoE calls as ``experts(rows [N, H], top_k_index [N, k],
    top_k_weights [N, k])``: every parameter ``Shard(0)`` over the ep mesh; the input hook
    dispatches, the module runs :func:`grouped_experts_forward` on its local experts, the
    output hook combines and weights. One instance per experts module (it keeps the
    layer's splits between its input and output hooks, as torchtitan's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.input_splits: list[int] = []
        self.output_splits: list[int] = []
        self.order: torch.Tensor | None = None
        self.unpermute: torch.Tensor | None = None
        self.shape: tuple[int, int, int] = (0, 0, 0)
        self.scores: torch.Tensor | None = None

    def _partition_fn(self, name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(
                pname, nn.Parameter(distribute_tensor(p.detach(), device_mesh, [Shard(0)]))
            )

    def _token_dispatch(
        self, mod: nn.Module, inputs: tuple[torch.Tensor, ...], device_mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, top_k_index, top_k_weights = inputs
        n_experts = mod.get_parameter("w1").shape[0]
        ep = device_mesh.size()
        n_local = n_experts // ep
        group = device_mesh.get_group()
        # torchtitan's MoE: the (token, choice) rows sorted by expert, counted per expert.
        flat = top_k_index.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.shape = (x.shape[0], top_k_index.shape[1], x.shape[1])
        self.scores = top_k_weights.reshape(-1)[self.order]
        counts = torch.bincount(flat, minlength=n_experts)
        routed = x[self.order // top_k_index.shape[1]]
        with torch.no_grad():
            received = wait_tensor(all_to_all_single(counts, None, None, group=group))
            self.input_splits = counts.view(ep, n_local).sum(1).tolist()
            self.output_splits = received.view(ep, n_local).sum(1).tolist()
        routed = wait_tensor(
            all_to_all_single_autograd(routed, self.output_splits, self.input_splits, group)
        )
        # Received in (source rank, local expert) blocks: regroup them by local expert.
        per_source = received.view(ep, n_local)
        starts = (per_source.reshape(-1).cumsum(0) - per_source.reshape(-1)).view(ep, n_local)
        blocks = [
            torch.arange(int(starts[s, j]), int(starts[s, j] + per_source[s, j]))
            for j in range(n_local)
            for s in range(ep)
        ]
        permute = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)
        self.unpermute = torch.empty_like(permute)
        self.unpermute[permute] = torch.arange(permute.numel())
        return routed[permute], per_source.sum(0)

    def _token_combine(
        self, mod: nn.Module, routed_output: torch.Tensor, device_mesh: DeviceMesh
    ) -> torch.Tensor:
        assert self.order is not None and self.unpermute is not None and self.scores is not None
        back = wait_tensor(
            all_to_all_single_autograd(
                routed_output[self.unpermute],
                self.input_splits,
                self.output_splits,
                device_mesh.get_group(),
            )
        )
        n, k, h = self.shape
        tokens = (self.order // k)[:, None].expand(-1, h)
        out = back.new_zeros(n, h).scatter_add(0, tokens, back * self.scores[:, None])
        self.order = self.unpermute = self.scores = None
        return out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def forward(x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
            return grouped_experts_forward(module, x, num_tokens_per_expert)

        module.forward = forward
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition_fn,
            input_fn=self._token_dispatch,  # type: ignore[arg-type]
            output_fn=self._token_combine,  # type: ignore[arg-type]
        )


def parallelize_moe(model: nn.Module, dense: DeviceMesh, sparse: DeviceMesh) -> nn.Module:
    """TP on attention over ``dense["tp"]``, :class:`ExpertParallel` on every block's
    experts over ``sparse["ep"]``, then ``fully_shard``: the experts over
    ``sparse["efsdp"]`` (gradients divided by the world size, see the module docstring),
    each block and the root over ``dense["fsdp"]``. In place."""
    from torch.distributed.fsdp import fully_shard

    plan: dict[str, ParallelStyle] = {}
    for name, _ in model.get_submodule("layers").named_children():
        for w in ("wq", "wk", "wv"):
            plan[f"layers.{name}.attn.{w}"] = ColwiseParallel()
        plan[f"layers.{name}.attn.wo"] = RowwiseParallel()
        # q_norm and k_norm normalize each rank's heads with a weight every rank holds
        # whole: as DTensors (heads Shard(2)) their weight gradient is summed over tp.
        for norm in ("q_norm", "k_norm"):
            plan[f"layers.{name}.attn.{norm}"] = SequenceParallel(
                sequence_dim=2, use_local_output=True
            )
    parallelize_module(model, dense["tp"], plan)
    world = dense.size()
    for block in model.get_submodule("layers").children():
        parallelize_module(block.get_submodule("moe.experts"), sparse["ep"], ExpertParallel())
        experts = fully_shard(block.get_submodule("moe.experts"), mesh=sparse["efsdp"])
        experts.set_gradient_divide_factor(float(world))
        if sparse.device_type == "cpu" and sparse["efsdp"].size() > 1:
            # gloo has no PREMUL_SUM: divide, then sum. (Not at efsdp 1, where no
            # reduce-scatter runs: torch 2.13's FSDP2 would then divide twice.)
            experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dense["fsdp"])
    fully_shard(model, mesh=dense["fsdp"])
    return model
