"""Multi-rank scenarios of the expert-parallel style (run by tests/test_expert_parallel.py).

One spawn of 4 gloo ranks runs them all. Each training scenario applies
:class:`~shardspec.runtime.expert_parallel.ExpertParallel` with torch's own
``parallelize_module`` to the experts module of an MoE block and compares one forward and
backward with a single process computing the same global batch (each rank's tokens are its
slice of it): outputs, the loss, and the gradients of the inputs, the router and every
expert, within tests/test_parallel.py's fp32 tolerance. The routing is skewed: experts
2, 6 and 7 get no token (so on ep 4 rank 3 receives nothing), and rank 1's batch is empty
(it sends nothing). A dispatch mode counts the bytes every collective moves: exactly one
exchange of the ``E`` int64 counts and two all-to-alls of the routed rows per forward, two
per backward, each moving tokens x top-k x hidden x 4 bytes (the floor), nothing else.

* ``example ep4``: the example MoE's block (examples/models/moe.py), ep 4 on a 1-D mesh.
* ``example ep2``: the same on the ep sub-mesh of a dp 2 x ep 2 mesh (two data groups; the
  expert gradients summed over dp, as FSDP would, equal the single process's).
* ``qwen3 ep4``: transformers' ``Qwen3MoeSparseMoeBlock`` from a tiny config, its own
  ``Qwen3MoeExperts`` used as it is.
* ``grouped ep4``: an in-test MoE in torchtitan's convention (``GroupedExperts.forward(x
  sorted by expert, num_tokens_per_expert)``, scores applied after the experts).
* ``refusals``: modules the style cannot take are refused with the module unchanged.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from examples.models import moe
from shardspec.runtime.expert_parallel import (
    ExpertParallel,
    ExpertParallelError,
    ExpertTensorParallel,
)
from shardspec.testing import Checks

DIM, FFN, EXPERTS, TOP_K = 16, 8, 8, 2
ROWS = (5, 0, 7, 4)  # tokens per rank: rank 1 sends nothing
SUPPRESSED = (2, 6, 7)  # experts that no token picks
TOL = 1e-5


# ----------------------------------------------------------------------------- the modules


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts convention: rows sorted by expert, a count per expert."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.zeros(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.zeros(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.zeros(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            h = F.silu(rows @ self.w1[e].T) * (rows @ self.w3[e].T)
            outs.append(h @ self.w2[e].T)
        return torch.cat(outs)


class GroupedMoE(nn.Module):
    """torchtitan's MoE shape: route, sort the (token, choice) rows by expert, run the
    grouped experts, weight the rows by their scores, scatter-add back to the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = GroupedExperts(DIM, FFN, EXPERTS)

    def route(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.router(rows), dim=-1, dtype=torch.float32)
        return torch.topk(probs, TOP_K, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, DIM)
        scores, idx = self.route(rows)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        out = self.experts(rows[order // TOP_K], torch.bincount(flat, minlength=EXPERTS))
        out = out * scores.reshape(-1, 1)[order]
        return torch.zeros_like(rows).index_add(0, order // TOP_K, out).view_as(x)


def build_example() -> nn.Module:
    return moe.MoE(moe.MoEConfig(dim=DIM, moe_ffn_dim=FFN, n_experts=EXPERTS, top_k=TOP_K))


def build_qwen3() -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=DIM, moe_intermediate_size=FFN, num_experts=EXPERTS, num_experts_per_tok=TOP_K
    )
    return Qwen3MoeSparseMoeBlock(config)


# name -> (builder, the router's weight FQN, the routing: rows -> expert ids [N, k])
Routing = Callable[[nn.Module, torch.Tensor], torch.Tensor]
MODELS: dict[str, tuple[Callable[[], nn.Module], str, Routing]] = {
    "example": (build_example, "router.weight", lambda m, x: m.route(x)[1]),
    "qwen3": (build_qwen3, "gate.weight", lambda m, x: m.gate(x)[2]),
    "grouped": (GroupedMoE, "router.weight", lambda m, x: m.route(x)[1]),
}


def build(name: str) -> nn.Module:
    """The model ``name`` with seeded weights and a router that never picks SUPPRESSED
    (every input has feature 0 equal to 3, where their router rows are -20)."""
    factory, router, _ = MODELS[name]
    model = factory()
    moe.init_weights(model, seed=7, std=0.2)
    with torch.no_grad():
        model.get_parameter(router)[list(SUPPRESSED), 0] = -20.0
    return model


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(ROWS), DIM, generator=gen)
    x[:, 0] = 3.0
    return x, torch.randn(sum(ROWS), DIM, generator=gen)


# ----------------------------------------------------------------------------- counting bytes


class CollectiveBytes(TorchDispatchMode):
    """Records every collective dispatched while active: ``(phase, op, bytes sent,
    bytes received)``; ``phase`` is set by the caller (forward, backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.calls: list[tuple[str, str, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d" and name == "alltoall_base_":
            self.calls.append((self.phase, name, args[1].nbytes, args[0].nbytes))
        elif ns == "_c10d_functional" and name == "all_to_all_single":
            self.calls.append((self.phase, name, args[0].nbytes, out.nbytes))
        elif ns in ("c10d", "_c10d_functional") and not name.startswith(("wait", "_wrap")):
            self.calls.append((self.phase, name, -1, -1))
        return out


# ----------------------------------------------------------------------------- training check


def close(c: Checks, tag: str, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        c.check(tag, False, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
        return
    delta = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    c.check(tag, delta <= TOL * scale + 1e-9, f"{what}: delta {delta} (max {scale})")


def grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    if isinstance(g, DTensor):
        g = g.to_local()
    local = p.to_local() if isinstance(p, DTensor) else p
    return torch.zeros_like(local) if g is None else g


def scenario_train(
    c: Checks, tag: str, name: str, mesh: DeviceMesh, *, fsdp: bool = False, etp: bool = False
) -> None:
    """One forward and backward of model ``name`` with the experts expert-parallel over
    ``mesh["ep"]`` against a single process on the global batch. With ``fsdp``, FSDP2 over
    ``mesh["dp"]`` on top. With ``etp``, expert tensor parallelism over ``mesh["etp"]`` (a
    2 x 2 (ep, etp) mesh): the two ranks of an etp group see the same tokens (the slices of
    ROWS merged in pairs)."""
    rank = dist.get_rank()
    ep_mesh = mesh["ep"]
    ref = build(name)
    model = copy.deepcopy(ref)
    if etp:
        parallelize_module(model, mesh["ep", "etp"], {"experts": ExpertTensorParallel()})
    else:
        parallelize_module(model, ep_mesh, {"experts": ExpertParallel()})
    if fsdp:
        fully_shard(model.experts, mesh=mesh["dp"])
    x, target = global_batch()
    # Each rank's data: a slice of the global batch (data group: the rank, or its ep
    # coordinate under etp).
    sizes = [ROWS[0] + ROWS[1], ROWS[2] + ROWS[3]] if etp else list(ROWS)
    bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
    data_of = (lambda r: r // 2) if etp else (lambda r: r)
    lo, hi = bounds[data_of(rank)]
    copies = 2 if etp else 1  # ranks that compute the same loss

    # The skew is real: the suppressed experts get no token, the others some.
    routed = MODELS[name][2](ref, x)
    picked = torch.bincount(routed.reshape(-1), minlength=EXPERTS)
    c.check(tag, all(picked[e] == 0 for e in SUPPRESSED), f"skew failed: {picked.tolist()}")
    c.check(tag, int(picked.sum()) == x.shape[0] * TOP_K, f"{picked.tolist()}")

    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref[None])
    loss_ref = ((out_ref - target[None]) ** 2).sum()
    loss_ref.backward()

    x_loc = x[lo:hi].clone().requires_grad_()
    with CollectiveBytes() as counter:
        out = model(x_loc[None])
        loss = ((out - target[None, lo:hi]) ** 2).sum()
        counter.phase = "backward"
        loss.backward()

    close(c, tag, "output", out[0].detach(), out_ref[0, lo:hi].detach())
    if not fsdp:  # the module deep-copies (its mesh, not process groups), and runs the same
        with torch.no_grad():
            again = copy.deepcopy(model)(x_loc[None])
        c.check(tag, torch.equal(again, out.detach()), "a deep copy computes otherwise")
    # After the call the module is as it was: its DTensors and its expert count.
    count = getattr(model.experts, "num_experts", EXPERTS)
    restored = all(isinstance(p, DTensor) for p in model.experts.parameters())
    c.check(tag, restored and count == EXPERTS, f"not restored: {count}")
    total = loss.detach().clone()
    dist.all_reduce(total)
    total /= copies
    c.check(tag, abs(total - loss_ref).item() <= TOL * abs(loss_ref).item(), f"loss {total}")
    assert x_loc.grad is not None and x_ref.grad is not None
    close(c, tag, "input grad", x_loc.grad, x_ref.grad[lo:hi])

    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    n_local = EXPERTS // ep
    ref_params = dict(ref.named_parameters())
    for fqn, p in model.named_parameters():
        grad = grad_or_zeros(p).clone()
        want = grad_or_zeros(ref_params[fqn])
        if fqn.startswith("experts.") and etp:  # over (ep, etp), ffn cut per component
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor)
            c.check(tag, torch.equal(p.full_tensor(), ref_params[fqn]), f"{fqn} layout")
            grad = p.grad.full_tensor()
        elif fqn.startswith("experts.") and fsdp:  # FSDP2 reduce-scattered it over dp
            c.check(tag, isinstance(p, DTensor) and p.device_mesh.ndim == 2, fqn)
            assert isinstance(p.grad, DTensor)
            grad = p.grad.full_tensor() * mesh["dp"].size()  # FSDP2 averages over dp
        elif fqn.startswith("experts."):
            c.check(tag, isinstance(p, DTensor) and p.to_local().shape[0] == n_local, fqn)
            if mesh.ndim > 1:  # summed over the data groups, as FSDP would
                dist.all_reduce(grad, group=mesh["dp"].get_group())
            want = want[ep_rank * n_local : (ep_rank + 1) * n_local]
        else:  # replicated: the sum over every rank's tokens
            dist.all_reduce(grad)
            grad /= copies
        close(c, tag, f"{fqn} grad", grad, want)

    # Bytes: the floor. This rank sends its routed rows and receives those routed to its
    # experts from its ep group; the counts exchange moves E int64 each way.
    group = sorted(dist.get_process_group_ranks(ep_mesh.get_group()))
    mine = range(ep_rank * n_local, (ep_rank + 1) * n_local)
    sent = int((routed[lo:hi].reshape(-1) >= 0).sum()) * DIM * 4
    received = sum(
        int(sum((routed[slice(*bounds[data_of(r)])] == e).sum() for e in mine)) for r in group
    )
    received *= DIM * 4
    if ep == 4:
        c.check(tag, (received == 0) == (rank == 3), f"rank {rank} receives {received} bytes")
    a2a = "all_to_all_single"
    want_calls = [
        ("forward", "alltoall_base_", EXPERTS * 8, EXPERTS * 8),
        ("forward", a2a, sent, received),
        ("forward", a2a, received, sent),
        ("backward", a2a, sent, received),
        ("backward", a2a, received, sent),
    ]
    # FSDP2's own all-gathers and reduce-scatters come on top of the all-to-alls; under etp
    # one all-reduce of the partial outputs forward, one of the rows' gradients backward.
    if etp:
        reduces = [call[:2] for call in counter.calls if call[1] == "allreduce_"]
        c.check(tag, reduces == [("forward", "allreduce_"), ("backward", "allreduce_")], "")
    only_a2a = fsdp or etp
    calls = [call for call in counter.calls if not only_a2a or call[1] in (a2a, "alltoall_base_")]
    backward = sorted(call for call in calls if call[0] == "backward")
    got = [call for call in calls if call[0] == "forward"] + backward
    c.check(tag, got == want_calls[:3] + sorted(want_calls[3:]), f"collectives {got}")


# ----------------------------------------------------------------------------- refusals


class NotExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Uneven(GroupedExperts):
    def __init__(self) -> None:
        super().__init__(4, 4, 8)
        self.extra = nn.Parameter(torch.randn(4, 4))


class Exploding(nn.Module):
    """transformers' convention; records what its forward sees, then fails."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.w = nn.Parameter(torch.zeros(EXPERTS, DIM))
        self.seen: tuple[int, bool, tuple[int, ...]] | None = None

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        self.seen = (self.num_experts, isinstance(self.w, DTensor), tuple(self.w.shape))
        raise RuntimeError("boom")


def snapshot(module: nn.Module) -> tuple[Any, ...]:
    return (
        type(module),
        [(n, id(p), p.detach().clone()) for n, p in module.named_parameters()],
        dict(vars(module)).keys(),
    )


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (
        a[0] is b[0]
        and a[2] == b[2]
        and len(a[1]) == len(b[1])
        and all(
            x[0] == y[0] and x[1] == y[1] and torch.equal(x[2], y[2])
            for x, y in zip(a[1], b[1], strict=True)
        )
    )


def scenario_refusals(c: Checks, tag: str, ep_mesh: DeviceMesh, mesh: DeviceMesh) -> None:
    ep, etp = ExpertParallel(), ExpertTensorParallel()
    cases: list[tuple[str, ExpertParallel, nn.Module, DeviceMesh, str]] = [
        ("no convention", ep, NotExperts(), ep_mesh, "NotExperts.forward('x',) is not"),
        ("not stacked", ep, Uneven(), ep_mesh, "not stacked on dimension 0"),
        ("indivisible", ep, GroupedExperts(4, 4, 6), ep_mesh, "6 experts, not divisible"),
        ("2-D mesh", ep, GroupedExperts(4, 4, 8), mesh, "pass the sub-mesh, e.g. mesh['ep']"),
        ("etp 1-D", etp, GroupedExperts(4, 4, 8), ep_mesh, "needs a 2-D mesh (ep, etp)"),
        ("etp name", etp, Exploding(), mesh, "Exploding.w [8, 16]: expert tensor parallelism"),
        ("etp ffn", etp, GroupedExperts(4, 3, 8), mesh, "dimension 1 (1 component(s)) does not"),
    ]
    for what, style, module, on, needle in cases:
        before = snapshot(module)
        try:
            style._apply(module, on)
            c.check(tag, False, f"{what}: accepted")
        except ExpertParallelError as e:
            c.check(tag, needle in str(e), f"{what}: {e}")
        c.check(tag, same(before, snapshot(module)), f"{what}: module changed")
    # Applied twice; a routing index out of range (refused before any collective).
    block = build("example")
    parallelize_module(block, ep_mesh, {"experts": ExpertParallel()})
    before = snapshot(block.experts)
    try:
        ExpertParallel()._apply(block.experts, ep_mesh)
        c.check(tag, False, "twice: accepted")
    except ExpertParallelError as e:
        c.check(tag, "already expert-parallel" in str(e), f"twice: {e}")
    c.check(tag, same(before, snapshot(block.experts)), "twice: module changed")
    rows = torch.randn(3, DIM)
    try:
        block.experts(rows, torch.full((3, TOP_K), EXPERTS + 1), torch.ones(3, TOP_K))
        c.check(tag, False, "index out of range: accepted")
    except ExpertParallelError as e:
        c.check(tag, "outside [0, 8]" in str(e), f"index: {e}")
    c.check(tag, same(before, snapshot(block.experts)), "index: module changed")

    # An error in the experts' forward: they saw the local view; it is restored.
    exploding = Exploding()
    ExpertParallel()._apply(exploding, ep_mesh)
    try:
        exploding(rows, torch.zeros(3, TOP_K, dtype=torch.int64), torch.ones(3, TOP_K))
        c.check(tag, False, "exploding: no error")
    except RuntimeError as e:
        c.check(tag, str(e) == "boom", f"exploding: {e}")
    want_seen = (EXPERTS // ep_mesh.size(), False, (EXPERTS // ep_mesh.size(), DIM))
    c.check(tag, exploding.seen == want_seen, f"exploding saw {exploding.seen}")
    ok = exploding.num_experts == EXPERTS and isinstance(exploding.w, DTensor)
    c.check(tag, ok, "exploding: not restored")

    # On the meta device (as parallelize tries styles on meta copies): no collective.
    with torch.device("meta"):
        on_meta = GroupedExperts(DIM, FFN, EXPERTS)
    ExpertParallel()._apply(on_meta, ep_mesh)
    shapes = [tuple(p.to_local().shape) for p in on_meta.parameters() if isinstance(p, DTensor)]
    c.check(tag, shapes == [(2, FFN, DIM), (2, DIM, FFN), (2, FFN, DIM)], f"meta: {shapes}")


# ----------------------------------------------------------------------------- any routing


def scenario_any_routing(c: Checks, tag: str, ep_mesh: DeviceMesh) -> None:
    """Hypothesis draws routings (any expert per slot, transformers' skip index included,
    any batch size per rank down to none) for the experts modules alone (the example's and
    transformers' Qwen3MoeExperts); the expert-parallel module's output and gradients
    (rows, routing weights, experts) equal the module's own forward on the global batch.
    Every rank draws the same examples (derandomized; a failed check is recorded, never
    raised, so no rank shrinks alone and the collectives stay in step)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    rank, ep = dist.get_rank(), ep_mesh.size()
    n_local = EXPERTS // ep
    experts_of = {"example": lambda m: m.experts, "qwen3": lambda m: m.experts}

    @settings(
        max_examples=30,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def check(data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(experts_of)))
        sizes = [data.draw(st.integers(0, 5)) for _ in range(ep)]
        n = sum(sizes)
        flat = data.draw(st.lists(st.integers(0, EXPERTS), min_size=n * TOP_K, max_size=n * TOP_K))
        seed = data.draw(st.integers(0, 2**16))
        index = torch.tensor(flat, dtype=torch.int64).reshape(n, TOP_K)
        gen = torch.Generator().manual_seed(seed)
        rows, weights = torch.randn(n, DIM, generator=gen), torch.rand(n, TOP_K, generator=gen)
        ref = experts_of[name](build(name))
        model = copy.deepcopy(ref)
        ExpertParallel()._apply(model, ep_mesh)
        lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        what = f"{name} sizes {sizes} index {flat} seed {seed}"

        def run(m: nn.Module, a: torch.Tensor, i: torch.Tensor, w: torch.Tensor) -> Any:
            a, w = a.clone().requires_grad_(), w.clone().requires_grad_()
            out = m(a, i, w)
            loss = (out * out).sum()
            if loss.requires_grad:  # transformers' forward on no rows returns a constant
                loss.backward()
            return out.detach(), grad_or_zeros(a), grad_or_zeros(w)

        want = run(ref, rows, index, weights)
        got = run(model, rows[lo:hi], index[lo:hi], weights[lo:hi])
        for label, g, w in zip(("output", "rows grad", "weights grad"), got, want, strict=True):
            close(c, tag, f"{what}: {label}", g, w[lo:hi])
        ref_params = dict(ref.named_parameters())
        for fqn, p in model.named_parameters():
            full = grad_or_zeros(ref_params[fqn])[rank * n_local : (rank + 1) * n_local]
            close(c, tag, f"{what}: {fqn} grad", grad_or_zeros(p), full)

    check()


# ----------------------------------------------------------------------------- entry point


def run_all(rank: int, world: int) -> tuple[list[str], dict[str, int]]:
    c = Checks()
    ep4 = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    dp2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
    etp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "etp"))
    scenarios: list[tuple[str, Callable[[], None]]] = [
        ("example ep4", lambda: scenario_train(c, "example ep4", "example", ep4)),
        ("example ep2", lambda: scenario_train(c, "example ep2", "example", dp2)),
        (
            "example ep2 fsdp",
            lambda: scenario_train(c, "example ep2 fsdp", "example", dp2, fsdp=True),
        ),
        ("qwen3 ep4", lambda: scenario_train(c, "qwen3 ep4", "qwen3", ep4)),
        ("example etp", lambda: scenario_train(c, "example etp", "example", etp, etp=True)),
        ("qwen3 etp", lambda: scenario_train(c, "qwen3 etp", "qwen3", etp, etp=True)),
        ("grouped ep4", lambda: scenario_train(c, "grouped ep4", "grouped", ep4)),
        ("refusals", lambda: scenario_refusals(c, "refusals", ep4, dp2)),
        ("any routing", lambda: scenario_any_routing(c, "any routing", ep4)),
    ]
    for name, fn in scenarios:
        try:
            fn()
        except Exception:
            c.fail.append(f"[{name}] raised:\n{traceback.format_exc()}")
    return c.fail, c.count


__all__ = ["run_all"]
