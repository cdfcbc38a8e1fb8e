"""Multi-rank scenarios for ``tests/test_conv1d_tp.py``: transformers' GPT-2 (Conv1D
weights ``[in, out]``, q|k|v fused in ``c_attn``) trained with tensor parallelism through
``specs/gpt2.shard``, against the same model in a single process, and loaded from a GPT-2
checkpoint written by transformers.

Scenarios append failure strings instead of raising (see ``dist_scenarios``), so the parent
sees every difference at once.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from examples.models import hf as hfm

# Dropout off: the single process and the ranks must compute the same function.
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
BATCH, SEQ, STEPS, LR = 4, 12, 2, 1e-3  # 2 AdamW steps: the second reads the first's moments
# Not bitwise: a row-parallel Conv1D sums its ranks' partial products (all-reduce over tp),
# FSDP2 averages gradients by reduce-scatter over dp_shard, and the single process sums
# each dot product in one pass: fp32 sums in another order differ in the last bits
# (measured: logits and losses ~5e-7, gradients ~1e-7). AdamW divides each gradient by
# its running RMS, so a near-zero gradient's last-bit difference can move its parameter by
# a good part of LR: parameters after STEPS steps get PARAM_TOL (measured ~1e-5 at LR).
TOL, PARAM_TOL = 1e-5, 1e-4


@dataclass
class Item:
    label: str
    fail: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def gpt2(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return hfm.gpt2_tiny(**NO_DROPOUT)


def tp_styles(model: nn.Module) -> dict[str, Any]:
    """GPT-2's attention splits c_attn's output by ``split_size``: each rank's width."""
    from shardspec.runtime.conv1d import LocalWidth

    n = len(model.transformer.h)  # type: ignore[union-attr, arg-type]
    return {f"transformer.h.{i}.attn": LocalWidth("split_size") for i in range(n)}


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def train(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> list[Any]:
    """(logits before training, the losses of STEPS AdamW steps, the first gradients)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    first = None
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for _ in range(STEPS):
        logits = model(inputs).logits
        first = logits.detach() if first is None else first
        loss = loss_of(logits, labels)
        losses.append(loss.detach())
        loss.backward()
        if not grads:
            grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return [first, losses, grads]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max().item()) if a.numel() else 0.0


def train_case(item: Item, sizes: dict[str, int]) -> None:
    """GPT-2 parallelized by the spec on a (dp_shard, tp) mesh against a single process:
    forward logits, the losses and the parameters after STEPS AdamW steps. Each dp_shard
    rank trains on its own rows of the batch; the single process on all of them (the mean
    of the per-rank mean losses is the batch's mean: every rank has as many tokens)."""
    import generated.gpt2 as mod

    mesh = mod.build_mesh(**sizes)
    ref = gpt2(seed=5)
    inputs, labels = batch()
    want_logits, want_losses, want_grads = train(ref, inputs, labels)
    model = gpt2(seed=5)
    item.extra["styles"] = sorted({type(s).__name__ for s in mod.tp_plan(mesh, model).values()})
    mod.parallelize(model, mesh, styles=tp_styles(model))
    mod.verify(model, mesh)
    dp = mesh["dp_shard"].get_local_rank()
    rows = slice(dp * BATCH // sizes["dp_shard"], (dp + 1) * BATCH // sizes["dp_shard"])
    got_logits, got_losses, got_grads = train(model, inputs[rows], labels[rows])
    d = max_diff(got_logits, want_logits[rows])
    item.extra["logits"] = d
    if not d <= TOL:
        item.fail.append(f"{item.label}: logits differ from the single process by {d:.3g}")
    mean = torch.stack(got_losses)
    dist.all_reduce(mean, group=mesh["dp_shard"].get_group())
    mean /= sizes["dp_shard"]
    d = max_diff(mean, torch.stack(want_losses))
    item.extra["losses"] = d
    if not d <= TOL:
        item.fail.append(f"{item.label}: losses {mean.tolist()} vs {want_losses} ({d:.3g})")
    if sorted(got_grads) != sorted(want_grads):
        item.fail.append(f"{item.label}: gradients of {sorted(got_grads)} vs {sorted(want_grads)}")
    worst = 0.0
    for fqn in sorted(set(got_grads) & set(want_grads)):
        d = max_diff(got_grads[fqn], want_grads[fqn])
        worst = max(worst, d)
        if not d <= TOL:
            item.fail.append(f"{item.label}: {fqn}'s first gradient differs by {d:.3g}")
    item.extra["grads"] = worst
    want = dict(ref.named_parameters())
    worst = 0.0
    for fqn, p in model.named_parameters():
        d = max_diff(full(p), want[fqn])
        worst = max(worst, d)
        if not d <= PARAM_TOL:
            item.fail.append(f"{item.label}: {fqn} after {STEPS} AdamW steps differs by {d:.3g}")
    item.extra["params"] = worst


def load_case(item: Item, root: str, sizes: dict[str, int]) -> None:
    """load_hf of transformers' own GPT-2 checkpoint into the TP model (parallelized with
    other values): every parameter and buffer bitwise transformers' own."""
    import transformers

    import generated.gpt2 as mod

    mesh = mod.build_mesh(**sizes)
    model = gpt2(seed=11)
    mod.parallelize(model, mesh, styles=tp_styles(model))
    mod.load_hf(model, os.path.join(root, "hf"), mesh)
    owner = transformers.GPT2LMHeadModel.from_pretrained(
        os.path.join(root, "hf"), dtype=torch.float32, **NO_DROPOUT
    )
    theirs = {**dict(owner.named_parameters()), **dict(owner.named_buffers())}
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if sorted(ours) != sorted(theirs):
        item.fail.append(f"{item.label}: names {sorted(set(ours) ^ set(theirs))} differ")
    for name in sorted(set(ours) & set(theirs)):
        a, b = full(ours[name]), theirs[name].detach()
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            item.fail.append(f"{item.label}: {name} differs from transformers' after load_hf")
    item.extra["checked"] = len(ours)
    inputs, _ = batch()
    with torch.no_grad():
        d = max_diff(model(inputs).logits, owner(inputs).logits)
    item.extra["logits"] = d
    if not d <= 1e-5:
        item.fail.append(f"{item.label}: logits differ from transformers' by {d:.3g}")


MESHES = {"dp_shard 2 x tp 2": {"dp_shard": 2, "tp": 2}, "tp 4": {"dp_shard": 1, "tp": 4}}


def run_all(rank: int, world: int, root: str) -> dict[str, Item]:
    """Every scenario on every mesh of MESHES (one spawn): label -> Item."""
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, or they thrash
    out: dict[str, Item] = {}
    for label, sizes in MESHES.items():
        cases: tuple[tuple[str, Any, tuple], ...] = (
            ("train", train_case, (sizes,)),
            ("load_hf", load_case, (root, sizes)),
        )
        for what, fn, args in cases:
            item = out.setdefault(f"{what} {label}", Item(f"{what} {label}"))
            try:
                fn(item, *args)
            except Exception:
                item.fail.append(f"{item.label} raised:\n{traceback.format_exc()}")
            dist.barrier()
    return out
