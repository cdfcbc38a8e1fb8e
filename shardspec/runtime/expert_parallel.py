"""Expert parallelism with all-to-all token dispatch: :class:`ExpertParallel`, a torch
``ParallelStyle`` for a stacked-experts module (every parameter ``[expert, ...]``).

Applied with torch's ``parallelize_module`` on a 1-D expert-parallel DeviceMesh (or the ep
sub-mesh ``mesh["ep"]`` of a larger one), it

* distributes every parameter of the module as ``Shard(0)`` over the mesh: rank ``r`` of
  ``ep`` holds experts ``r * L .. r * L + L - 1`` (``L = experts // ep``), as a DTensor whose
  gradient stays local;
* dispatches tokens in the module's forward, as torchtitan's ``ExpertParallel`` and
  Megatron-Core's all-to-all dispatcher do: the rows routed to each expert are sorted by
  expert, the per-expert counts are exchanged (``all_to_all_single`` on the counts), the rows
  go to the ranks that own their experts (``all_to_all_single`` from
  ``torch.distributed._functional_collectives``, which is autograd-aware: its backward is the
  reverse all-to-all), are permuted so that each local expert's rows are contiguous, run
  through the local experts, and travel back the same way, ending in the order they left.

Two forward conventions are accepted, read from the forward's signature:

* **transformers** (5.x experts modules such as ``Qwen3MoeExperts``, ``MixtralExperts``):
  ``forward(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]``.
  Each (token, choice) pair is one routed row; ``top_k_index == num_experts`` means "skip"
  (transformers' own convention). The module's *own* forward runs on the received rows with
  the local weights, local expert ids, weights of one and ``num_experts`` seen as the local
  count during the call (restored after, also on error); the routing weights are applied
  where the token lives, after the rows come back, so their gradients (the router's) stay
  on that rank and the all-to-alls move only the rows.
* **grouped** (torchtitan's ``GroupedExperts``):
  ``forward(x [M, H] sorted by expert, num_tokens_per_expert [E]) -> [M, H]``: the caller
  has already routed and sorted the rows; the output rows come back in the input's order.

Per step each all-to-all moves exactly the routed rows (tokens x top-k x hidden x dtype
size, each way) plus the ``E`` int64 counts: the floor. Uneven routing is fine: experts
without tokens, ranks that send or receive nothing, empty batches (zero-size tensors).

:class:`ExpertTensorParallel` adds expert tensor parallelism on a 2-D ``(ep, etp)`` mesh:
each expert's ffn dimension is also cut over etp, and the partial outputs are summed there.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "CONVENTIONS",
    "FFN_DIMS",
    "ExpertParallel",
    "ExpertParallelError",
    "ExpertParallelModule",
    "ExpertTensorParallel",
    "MoESequenceParallel",
    "MoESequenceParallelModule",
    "convention_of",
    "copy_to_group",
    "inverse_permutation",
    "local_order",
    "reduce_from_group",
    "scale_grad",
    "set_grad_scale",
    "sort_routed",
]

TRANSFORMERS = "transformers"
GROUPED = "grouped"
# The forward signatures the style understands: convention -> parameter names after self
# (``None``: any name).
CONVENTIONS: dict[str, tuple[str | None, ...]] = {
    TRANSFORMERS: (None, "top_k_index", "top_k_weights"),
    GROUPED: (None, "num_tokens_per_expert"),
}
_CONVENTION_TEXT = (
    "forward(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k]) as transformers' "
    "experts modules (Qwen3MoeExperts, MixtralExperts), or forward(x [M, H] sorted by expert, "
    "num_tokens_per_expert [E]) as torchtitan's GroupedExperts"
)


class ExpertParallelError(ValueError):
    """A module the expert-parallel style cannot take; the module is left unchanged."""


# ----------------------------------------------------------------------------- routing helpers


def sort_routed(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed (token, choice) slots of ``top_k_index`` [N, k] sorted by expert.

    Returns ``(order, counts)``: ``order`` [S] holds the flat slot indices (``token * k +
    choice``) of every slot whose expert is in ``[0, num_experts)``, grouped by expert in
    ascending order and, within an expert, in slot order (a stable sort); ``counts``
    [num_experts] is the number of slots per expert. Slots equal to ``num_experts`` are
    transformers' "skip" and are left out; any other id is refused.
    """
    flat = top_k_index.reshape(-1)
    if flat.numel() and bool(((flat < 0) | (flat > num_experts)).any()):
        bad = flat[(flat < 0) | (flat > num_experts)][0].item()
        raise ExpertParallelError(
            f"top_k_index holds expert {bad}, outside [0, {num_experts}] "
            f"({num_experts} means 'no expert')"
        )
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    order = torch.argsort(flat, stable=True)[: int(counts.sum())]
    return order, counts


def local_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """The permutation that groups received rows by local expert.

    ``recv_counts`` [ep, L]: rows received from source rank ``s`` for local expert ``j``.
    The received rows come in (source, expert) blocks; ``rows[local_order(recv_counts)]``
    puts them in (expert, source) order, so each local expert's rows are contiguous.
    """
    ep, n_local = recv_counts.shape
    block = torch.arange(ep * n_local, device=recv_counts.device)
    # Block s * L + j sorts under key j * ep + s.
    key = (block % n_local) * ep + block // n_local
    return torch.argsort(torch.repeat_interleave(key, recv_counts.reshape(-1)), stable=True)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``x[perm][inv] == x``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


# ----------------------------------------------------------------------------- the exchange


RunLocal = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _all_to_all(
    rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` of ``rows`` (its backward is the reverse
    exchange), waited for."""
    out = funcol.all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group)
    return funcol.wait_tensor(out)


def dispatch_and_combine(
    rows: torch.Tensor, counts: torch.Tensor, group: Any, ep: int, run_local: RunLocal
) -> torch.Tensor:
    """Send ``rows`` [S, H], sorted by global expert with ``counts`` [E] rows per expert, to
    the ranks of ``group`` (``ep`` of them) that own their experts; run ``run_local(rows
    [M, H] grouped by local expert, rows per local expert [L], local expert id per row
    [M])`` there; bring the results back. Returns [S, H] in the order of ``rows``.
    """
    n_local = counts.numel() // ep
    counts = counts.to(torch.int64).contiguous()
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    recv_counts = recv.view(ep, n_local)
    send_splits, recv_splits = torch.stack(
        [counts.view(ep, n_local).sum(1), recv_counts.sum(1)]
    ).tolist()
    received = _all_to_all(rows, recv_splits, send_splits, group)
    perm = local_order(recv_counts)
    per_expert = recv_counts.sum(0)
    local_ids = torch.repeat_interleave(
        torch.arange(n_local, device=rows.device), per_expert.to(rows.device)
    )
    out = run_local(received[perm], per_expert, local_ids)
    if out.shape != (perm.numel(), rows.shape[-1]):
        raise ExpertParallelError(
            f"the experts returned {tuple(out.shape)} for {perm.numel()} rows of width "
            f"{rows.shape[-1]}; expected one output row per input row"
        )
    return _all_to_all(out[inverse_permutation(perm)], send_splits, recv_splits, group)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group`` (Megatron's copy to a
    tensor-parallel region: each rank's slice of the experts reads the same rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Sum over ``group`` forward (each rank's ffn slice gives a partial output); identity
    backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged; its gradient multiplied by ``scale`` (``x`` itself at 1)."""
    if scale == 1.0:
        return x
    out: torch.Tensor = _ScaleGrad.apply(x, scale)
    return out


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` unchanged; its gradient summed over ``group`` (the ranks of ``group`` read the
    same ``x``, each for part of the work)."""
    out: torch.Tensor = _CopyToGroup.apply(x, group)
    return out


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over ``group`` (each rank's partial result); the gradient unchanged."""
    out: torch.Tensor = _ReduceFromGroup.apply(x, group)
    return out


# ----------------------------------------------------------------------------- the module


def convention_of(module: nn.Module) -> str:
    """The forward convention of ``module`` (:data:`CONVENTIONS`), read from its forward's
    signature; :class:`ExpertParallelError` naming the module when it has neither."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    for convention, want in CONVENTIONS.items():
        if len(names) == len(want) and all(
            w in (None, n) for w, n in zip(want, names, strict=True)
        ):
            return convention
    raise ExpertParallelError(
        f"{type(module).__qualname__}.forward{names} is not an experts forward the "
        f"expert-parallel style can dispatch tokens for; it takes {_CONVENTION_TEXT}"
    )


@contextmanager
def _local_view(module: nn.Module, n_local: int, grad_scale: float = 1.0) -> Iterator[None]:
    """Within the block, ``module``'s stacked parameters are their local shards (plain
    tensors, differentiable back to the DTensors, their gradients multiplied by
    ``grad_scale``) and its ``num_experts`` (where it has one) is the local count; both
    restored on exit, also on error."""
    saved: list[tuple[nn.Module, str, Any]] = []
    had_count = "num_experts" in vars(module)
    count = vars(module).get("num_experts")
    try:
        for owner in module.modules():
            for name, p in list(owner._parameters.items()):
                if isinstance(p, DTensor):
                    saved.append((owner, name, p))
                    owner._parameters[name] = scale_grad(p.to_local(), grad_scale)
        if had_count:
            setattr(module, "num_experts", n_local)  # noqa: B010 (an nn.Module attribute)
        yield
    finally:
        for owner, name, p in reversed(saved):
            owner._parameters[name] = p
        if had_count:
            setattr(module, "num_experts", count)  # noqa: B010


@functools.cache
def _forward_signature(forward: Callable[..., Any]) -> inspect.Signature:
    """The signature of an experts class's own forward without ``self``, read once per
    class (the style's forward binds every call's arguments to it)."""
    sig = inspect.signature(forward)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


class ExpertParallelModule(nn.Module):
    """Mixed into the class of a module the style parallelized (as FSDP2's
    ``FSDPModule``): its forward dispatches the tokens and runs the class's own forward on
    the local experts."""

    # The mesh (ep) or (ep, etp): a DeviceMesh, not its process groups, so that the module
    # deep-copies (a DeviceMesh pickles; a ProcessGroup does not).
    _ep_mesh: DeviceMesh
    _ep_size: int
    _ep_experts: int
    _ep_convention: str
    # What the local experts' gradients are multiplied by (see :func:`set_grad_scale`).
    _ep_grad_scale: float = 1.0

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        own = super().forward  # the experts module's own forward
        n_local = self._ep_experts // self._ep_size
        group = self._ep_mesh.get_group(0)

        def call_experts(rows: torch.Tensor, *call_args: Any) -> torch.Tensor:
            etp = self._ep_mesh.get_group(1) if self._ep_mesh.ndim == 2 else None
            with _local_view(self, n_local, self._ep_grad_scale):
                if etp is not None:
                    rows = copy_to_group(rows, etp)
                out: torch.Tensor = own(rows, *call_args)
                if rows.shape[0] == 0:
                    # No rows for this rank. A forward that then returns a fresh zero tensor
                    # would cut the graph: tie the output to the rows (so that the backward
                    # runs this rank's half of the reverse all-to-all, which the other ranks
                    # wait for) and to the weights (a zero gradient, as a single process has).
                    tied = [rows, *self.parameters()]
                    out = out + sum(t.reshape(-1)[:0].sum() for t in tied)
            if etp is not None:
                out = reduce_from_group(out, etp)
            return out

        bound = _forward_signature(own.__func__).bind(*args, **kwargs)  # type: ignore[attr-defined]
        x, second = list(bound.arguments.values())[:2]
        if self._ep_convention == GROUPED:
            counts = second
            if counts.shape != (self._ep_experts,) or int(counts.sum()) != x.shape[0]:
                raise ExpertParallelError(
                    f"num_tokens_per_expert has shape {tuple(counts.shape)} and sums to "
                    f"{int(counts.sum())}; expected ({self._ep_experts},), one count per "
                    f"expert, summing to the {x.shape[0]} rows of x"
                )

            def run_grouped(rows: torch.Tensor, per_expert: torch.Tensor, _: Any) -> Any:
                return call_experts(rows, per_expert.to(counts.device, counts.dtype))

            return dispatch_and_combine(x, counts, group, self._ep_size, run_grouped)

        top_k_index, top_k_weights = second, list(bound.arguments.values())[2]
        n, k = top_k_index.shape
        order, counts = sort_routed(top_k_index, self._ep_experts)

        def run_routed(rows: torch.Tensor, _: Any, local_ids: torch.Tensor) -> Any:
            ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            return call_experts(rows, local_ids[:, None], ones)

        back = dispatch_and_combine(x[order // k], counts, group, self._ep_size, run_routed)
        # Each slot's expert output, zero for skipped slots, weighted where the token lives.
        slots = back.new_zeros(n * k, x.shape[-1]).index_copy(0, order, back)
        out = (slots.view(n, k, x.shape[-1]) * top_k_weights[..., None]).sum(1)
        return out.to(x.dtype)


_CLASSES: dict[tuple[type, type], type] = {}


def _mixed_class(mixin: type, cls: type, prefix: str) -> type:
    """``cls`` with ``mixin``'s forward in front (one class per pair, as FSDP2 does)."""
    if (mixin, cls) not in _CLASSES:
        _CLASSES[mixin, cls] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    return _CLASSES[mixin, cls]


class ExpertParallel(ParallelStyle):
    """Expert parallelism with all-to-all token dispatch for a stacked-experts module.

    Use with torch's ``parallelize_module(experts, mesh["ep"], ExpertParallel())`` (or in a
    plan keyed by the experts module's FQN). Every parameter of the module must be stacked
    on dimension 0 over the same number of experts, divisible by the mesh size; the forward
    must follow one of :data:`CONVENTIONS`. Everything is checked before the module
    changes: a refusal (:class:`ExpertParallelError`) leaves it as it was.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        experts = check_experts(module, device_mesh, 1)
        convention = convention_of(module)

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                shard = distribute_tensor(
                    p.detach(), mesh, [Shard(0)], src_data_rank=self.src_data_rank
                )
                mod.register_parameter(pname, nn.Parameter(shard, p.requires_grad))

        distribute_module(module, device_mesh, partition)
        return _install(module, device_mesh, experts, convention)


# The ffn dimension of the stacked tensors that expert tensor parallelism cuts, by parameter
# name: (dimension, components). A fused tensor's components (gate|up) are cut each.
FFN_DIMS: dict[str, tuple[int, int]] = {
    "gate_up_proj": (1, 2),  # transformers: [E, 2F, H], gate then up
    "up_proj": (1, 1),  # transformers without a gate: [E, F, H]
    "down_proj": (2, 1),  # transformers: [E, H, F]
    "w1": (1, 1),  # torchtitan and the example MoE: [E, F, H] (gate)
    "w3": (1, 1),  # [E, F, H] (up)
    "w2": (2, 1),  # [E, H, F] (down)
}


class ExpertTensorParallel(ExpertParallel):
    """:class:`ExpertParallel` with expert tensor parallelism: on a 2-D mesh ``(ep, etp)``
    (in that order), experts are split over ep as there and each expert's ffn dimension over
    etp (``ffn_dims``: parameter name -> (dimension, components), :data:`FFN_DIMS` by
    default; a fused gate|up is cut per component, torch's ``_StridedShard``). The ranks of
    an etp group must see the same tokens (the MoE's input replicated over etp, as tensor
    parallelism leaves it): each dispatches them over its ep group, runs its slice of the
    local experts, and the partial outputs are summed over etp (Megatron's copy to and
    reduce from a tensor-parallel region). Bias-free experts only: a bias would be added
    etp times."""

    def __init__(self, ffn_dims: dict[str, tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.ffn_dims = dict(FFN_DIMS if ffn_dims is None else ffn_dims)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        experts = check_experts(module, device_mesh, 2)
        convention = convention_of(module)
        etp = device_mesh.size(1)
        cuts = {pname: self._cut(module, pname, p, etp) for pname, p in module.named_parameters()}
        for pname, (dim, components) in cuts.items():
            owner, _, leaf = pname.rpartition(".")
            mod = module.get_submodule(owner)
            p = mod.get_parameter(leaf)
            # Rank 0's values (src_data_rank) over ep, then each rank keeps its etp slice.
            local = distribute_tensor(
                p.detach(), device_mesh, [Shard(0), Replicate()], src_data_rank=self.src_data_rank
            ).to_local()
            pieces = local.chunk(components * etp, dim=dim)
            rank = device_mesh.get_local_rank(1)
            local = torch.cat([pieces[c * etp + rank] for c in range(components)], dim=dim)
            etp_place = (
                Shard(dim) if components == 1 else _StridedShard(dim, split_factor=components)
            )
            shard = DTensor.from_local(
                local, device_mesh, [Shard(0), etp_place], shape=p.shape, stride=p.stride()
            )
            mod.register_parameter(leaf, nn.Parameter(shard, p.requires_grad))
        return _install(module, device_mesh, experts, convention)

    def _cut(self, module: nn.Module, pname: str, p: torch.Tensor, etp: int) -> tuple[int, int]:
        name = type(module).__qualname__
        leaf = pname.rpartition(".")[2]
        if leaf not in self.ffn_dims:
            raise ExpertParallelError(
                f"{name}.{pname} {list(p.shape)}: expert tensor parallelism does not know its "
                f"ffn dimension; name it in ffn_dims (known: {sorted(self.ffn_dims)}); biases "
                "are not supported"
            )
        dim, components = self.ffn_dims[leaf]
        if not 0 < dim < p.dim() or p.shape[dim] % (components * etp) != 0:
            raise ExpertParallelError(
                f"{name}.{pname} {list(p.shape)}: its ffn dimension {dim} ({components} "
                f"component(s)) does not split over etp {etp}"
            )
        return dim, components


def _install(module: nn.Module, mesh: DeviceMesh, experts: int, convention: str) -> nn.Module:
    """Make ``module`` dispatch tokens over ``mesh``'s first dimension (ep) and, on a 2-D
    mesh, sum its partial outputs over the second (etp)."""
    module.__class__ = _mixed_class(ExpertParallelModule, type(module), "ExpertParallel")
    assert isinstance(module, ExpertParallelModule)
    module._ep_mesh = mesh
    module._ep_size = mesh.size(0)
    module._ep_experts = experts
    module._ep_convention = convention
    return module


def set_grad_scale(module: nn.Module, scale: float) -> None:
    """Multiply the gradients of an expert-parallel ``module``'s local experts by ``scale``
    in its backward, before any reduction (FSDP2's reduce-scatter over the expert view's
    fsdp axis comes after). ``parallelize`` uses it to give the experts the single
    process's mean-loss gradient, which FSDP2's own divide factor over the expert mesh
    does not (torchtitan sets that factor with ``set_gradient_divide_factor``, which needs
    NCCL's ``PREMUL_SUM``; a multiplication in autograd works on every backend)."""
    if not isinstance(module, ExpertParallelModule):
        raise ExpertParallelError(f"{type(module).__qualname__} is not expert-parallel")
    module._ep_grad_scale = float(scale)


# ----------------------------------------------------------------------------- sequence parallelism


@contextmanager
def _summed_over(module: nn.Module, group: Any) -> Iterator[None]:
    """Within the block, every plain parameter of ``module`` outside its expert-parallel
    submodules reads as itself with its gradient summed over ``group`` (Megatron's copy to
    a model-parallel region); restored on exit, also on error. DTensor parameters are left
    to DTensor."""
    saved: list[tuple[nn.Module, str, Any]] = []
    skip: list[str] = []
    try:
        for name, owner in module.named_modules():
            if any(name == s or name.startswith(s + ".") for s in skip):
                continue
            if isinstance(owner, ExpertParallelModule):
                skip.append(name)
                continue
            for pname, p in list(owner._parameters.items()):
                if p is not None and not isinstance(p, DTensor) and p.requires_grad:
                    saved.append((owner, pname, p))
                    owner._parameters[pname] = copy_to_group(p, group)
        yield
    finally:
        for owner, pname, p in reversed(saved):
            owner._parameters[pname] = p


class MoESequenceParallelModule(nn.Module):
    """Mixed into the class of an MoE block :class:`MoESequenceParallel` parallelized: its
    forward runs the class's own forward on this rank's sequence slice."""

    _sp_mesh: DeviceMesh

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(_local_tokens(a) for a in args)
        kwargs = {k: _local_tokens(v) for k, v in kwargs.items()}
        with _summed_over(self, self._sp_mesh.get_group()):
            return super().forward(*args, **kwargs)


def _local_tokens(x: Any) -> Any:
    """A DTensor activation as this rank's slice of the sequence (dimension 1) of it; any
    other argument as it is (a plain tensor is the rank's slice already, as sequence
    parallelism's residual stream is)."""
    if not isinstance(x, DTensor):
        return x
    if x.device_mesh.ndim != 1:
        raise ExpertParallelError(
            f"the MoE block's input is a DTensor on a {x.device_mesh.ndim}-D mesh "
            f"{x.device_mesh.mesh_dim_names}; sequence parallelism gives it on the 1-D tp mesh"
        )
    return x.redistribute(x.device_mesh, [Shard(1)]).to_local()


class MoESequenceParallel(ParallelStyle):
    """The MoE block (the module that routes and calls an expert-parallel experts module)
    under sequence parallelism, as torchtitan runs it when ep borrows ranks from tp: each tp
    rank routes its own slice of the sequence.

    Use with ``parallelize_module(moe_block, mesh["tp"], MoESequenceParallel())`` (the dense
    view's tp). The block's input, sequence-parallel (a DTensor ``Shard(1)`` over tp, as
    torch's ``SequenceParallel`` norms give it, or this rank's plain slice ``[B, T/tp,
    ...]``), reaches its own forward as the rank's plain slice; the router, shared experts
    and anything else in the block compute on those tokens only, so every parameter of the
    block outside its expert-parallel experts (replicated over tp) has its gradient summed
    over tp in autograd (each rank's part is its own tokens'); the experts module
    (:class:`ExpertParallel`) dispatches the slice over ep; the output is the rank's plain
    slice, as torch's ``RowwiseParallel(output_layouts=Shard(1))`` leaves the residual
    stream. The block's parameters must be plain (no tensor-parallel style on them).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(module).__qualname__
        if isinstance(module, MoESequenceParallelModule):
            raise ExpertParallelError(f"{name} is already sequence-parallel")
        if device_mesh.ndim != 1:
            raise ExpertParallelError(
                f"MoESequenceParallel needs the 1-D tp mesh, got {device_mesh.ndim} dimensions "
                f"{device_mesh.mesh_dim_names}"
            )
        module.__class__ = _mixed_class(MoESequenceParallelModule, type(module), "SequenceParallel")
        assert isinstance(module, MoESequenceParallelModule)
        module._sp_mesh = device_mesh
        return module


def check_experts(module: nn.Module, device_mesh: DeviceMesh, ndim: int) -> int:
    """The number of experts of ``module``, after checking that the style can take it on
    ``device_mesh`` (``ndim`` dimensions: ep, or ep and etp): :class:`ExpertParallelError`
    otherwise (nothing changed)."""
    name = type(module).__qualname__
    if isinstance(module, ExpertParallelModule):
        raise ExpertParallelError(f"{name} is already expert-parallel")
    if device_mesh.ndim != ndim:
        want = "a 1-D mesh" if ndim == 1 else "a 2-D mesh (ep, etp)"
        sub = "mesh['ep']" if ndim == 1 else "mesh['ep', 'etp']"
        raise ExpertParallelError(
            f"the expert-parallel style needs {want}, got {device_mesh.ndim} dimensions "
            f"{device_mesh.mesh_dim_names}; pass the sub-mesh, e.g. {sub}"
        )
    params = list(module.named_parameters())
    if not params:
        raise ExpertParallelError(f"{name} has no parameters: nothing to place on experts")
    shapes = {pname: tuple(p.shape) for pname, p in params}
    for pname, p in params:
        if isinstance(p, DTensor):
            raise ExpertParallelError(
                f"{name}.{pname} is already a DTensor on {p.device_mesh}; apply the "
                "expert-parallel style before any other (FSDP2 last)"
            )
    firsts = {s[0] if s else None for s in shapes.values()}
    if len(firsts) != 1 or None in firsts:
        listed = ", ".join(f"{k} {list(v)}" for k, v in shapes.items())
        raise ExpertParallelError(
            f"{name}'s parameters are not stacked on dimension 0 over one expert count "
            f"({listed}); the expert-parallel style takes modules whose every parameter is "
            "[expert, ...]"
        )
    experts = int(next(iter(firsts)))  # type: ignore[arg-type]
    count = getattr(module, "num_experts", experts)
    if count != experts:
        raise ExpertParallelError(
            f"{name}.num_experts is {count} but its parameters stack {experts} experts"
        )
    ep = device_mesh.size(0)
    if experts % ep != 0:
        raise ExpertParallelError(
            f"{name} has {experts} experts, not divisible by the expert-parallel mesh size "
            f"{ep}; choose an ep size that divides {experts}"
        )
    convention_of(module)
    return experts
