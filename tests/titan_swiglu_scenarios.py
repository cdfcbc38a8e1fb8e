"""Multi-rank scenarios for ``tests/test_titan_swiglu.py``: checkpoints of torchtitan's
fused SwiGLU overrides exchanged with torchtitan's checkpointer, on 4 gloo CPU ranks, all
in one spawn.

The model is ``examples/models/titan_swiglu.py``: torchtitan's ``FusedSwiGLU`` (``w13``
``[hidden, 2, dim]``, whose state-dict hook writes ``w1.weight``/``w3.weight``) and
``FusedGroupedExperts`` (``w13`` ``[experts, hidden, 2, dim]``, written as
``w1_EFD``/``w3_EFD``), as ``torchtitan/overrides/fused_swiglu.py`` defines them (read in
github:pytorch/torchtitan at commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a). The
checkpointer is reproduced as in ``tests/torchtitan_ckpt_scenarios.py`` (whose optimizer
Stateful and helpers this reuses): ``dcp.save`` of ``model.state_dict()`` at the top level
(through the hooks) next to the flat optimizer state (``w13``'s AdamW state whole, named by
parameter), ``train_state`` and ``lr_scheduler``; ``dcp.load`` of the same, then
``model.load_state_dict`` (the hooks stack ``w1``/``w3`` back into ``w13``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from examples.models import llama, titan_swiglu
from shardspec.runtime import checkpoint as ck
from tests.ckpt_fault_scenarios import _expect_error
from tests.torchtitan_ckpt_scenarios import FlatOptimizer, _differ, _gathered, _stored, run_steps

Failures = list[str]
CHECKED: dict[str, int] = {}
STEP = 10
TT = "torchtitan"
# What torchtitan's checkpoint holds for layer 0's fused parameters (global shapes).
TITAN_KEYS = {
    "layers.0.feed_forward.w1.weight": (32, 16),
    "layers.0.feed_forward.w3.weight": (32, 16),
    "layers.0.moe.experts.w1_EFD": (4, 32, 16),
    "layers.0.moe.experts.w3_EFD": (4, 32, 16),
    "optimizer.state.layers.0.feed_forward.w13.exp_avg": (32, 2, 16),
    "optimizer.state.layers.0.moe.experts.w13.exp_avg_sq": (4, 32, 2, 16),
}


def _count(tag: str) -> None:
    CHECKED[tag] = CHECKED.get(tag, 0) + 1


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (2, 8), generator=g)
    for _ in range(steps):
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on made-up gradients (the spec's placed model has no styles to run
    forward with): every parameter gets AdamW state of its own values."""
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, 0.01 * (1 + seed + len(name)))
    optim.step()
    optim.zero_grad()


class Torchtitan:
    """A torchtitan trainer's checkpointing of the fused-SwiGLU model on FSDP2 over a 1-D
    ``dp_shard`` mesh of every rank (``fully_shard`` per block and on the root)."""

    def __init__(self, seed: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        self.model = titan_swiglu.tiny()
        llama.init_weights(self.model, seed)
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optim = torch.optim.AdamW(self.model.named_parameters(), lr=1e-2)
        self.optimizer = FlatOptimizer(self.optim)
        self.train_state = {"step": 0, "ntokens_seen": 0}

    def states(self) -> dict[str, Any]:
        return {
            **self.model.state_dict(),
            "optimizer": self.optimizer,
            "train_state": self.train_state,
            "lr_scheduler": {"last_epoch": self.train_state["step"]},
        }

    def save(self, path: str) -> str:
        dcp.save(self.states(), checkpoint_id=path)
        return path

    def load(self, path: str) -> None:
        states = self.states()
        dcp.load(states, checkpoint_id=path)
        rest = ("optimizer", "train_state", "lr_scheduler")
        self.model.load_state_dict({k: v for k, v in states.items() if k not in rest})
        self.train_state = states["train_state"]


class Shardspec:
    """The same model placed by the spec at tp 2 x dp_shard 2 (``w13``'s hidden dimension
    over tp and, FSDP's, dp_shard), its optimizer state as torch flattens it."""

    def __init__(self, mod: Any, seed: int) -> None:
        self.mesh = mod.build_mesh(tp=2)
        self.model = titan_swiglu.tiny()
        llama.init_weights(self.model, seed)
        mod.distribute(self.model, self.mesh)
        self.optim = torch.optim.AdamW(self.model.named_parameters(), lr=1e-2)
        self.flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def state(self, hooks: bool = False, step: int = 0) -> dict[str, Any]:
        model = self.model.state_dict() if hooks else dict(self.model.named_parameters())
        return {
            **model,
            "optimizer": get_optimizer_state_dict(self.model, self.optim, options=self.flat),
            "train_state": {"step": step, "ntokens_seen": 0},
            "lr_scheduler": {"last_epoch": step},
        }

    def set_optimizer(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, state["optimizer"], options=self.flat)


# ----------------------------------------------------------------------------- scenarios


def torchtitan_to_shardspec(mod: Any, rank: int, root: str, fail: Failures) -> None:
    """torchtitan's checkpoint at dp_shard 4 (the hooks' ``w1.weight``/``w3.weight`` and
    ``w1_EFD``/``w3_EFD``, squeezed; ``w13``'s AdamW state whole) loads through the spec
    (its `checkpoint keys torchtitan`: the generated ``load`` without ``keys=``) at tp 2 x
    dp_shard 2: every parameter and AdamW state bitwise equal to torchtitan's, gathered
    whole by torch. In shardspec's own layout the load refuses it, naming the missing
    squeezed component and the ``keys=`` that reads it."""
    tag = "[torchtitan->shardspec]"
    titan = Torchtitan(seed=1)
    _train(titan.model, titan.optim, 3)
    titan.train_state = {"step": 3, "ntokens_seen": 48}
    path = titan.save(f"{root}/titan/step-{STEP}")
    stored = _stored(path)
    shapes = {k: stored.get(k) for k in TITAN_KEYS}
    if shapes != TITAN_KEYS:
        fail.append(f"{tag} torchtitan's checkpoint holds {shapes}")
    want = _gathered(titan.model, titan.optim)
    ours = Shardspec(mod, seed=2)
    err = _expect_error(
        lambda: ck.load(mod.SPEC, ours.state(), path, mesh=ours.mesh, keys="shardspec"),
        "missing: layers.0.feed_forward.w13.w1 (global shape [32, 16])",
        "hint: the checkpoint stores layers.",
        "as torchtitan does; load with keys='torchtitan'",
    )
    if err:
        fail.append(f"{tag} keys='shardspec': {err}")
    state = ours.state()
    mod.load(state, path, mesh=ours.mesh)
    ours.set_optimizer(state)
    bad = _differ(want, _gathered(ours.model, ours.optim))
    if bad:
        fail.append(f"{tag} differs from torchtitan's model: {bad[:6]}")
    if state["train_state"] != {"step": 3, "ntokens_seen": 48}:
        fail.append(f"{tag} train state {state['train_state']}")
    _count(tag)


def shardspec_to_torchtitan(mod: Any, rank: int, root: str, fail: Failures) -> None:
    """The reverse: the spec's model at tp 2 x dp_shard 2, with new values, saved by the
    generated ``save`` (torchtitan's keys by the spec) from its parameters under their own
    names and from ``model.state_dict()`` (the hooks' own keys), has torchtitan's keys and
    shapes exactly, and torchtitan's loading at dp_shard 4 (plain ``dcp.load``, then the
    hooks' ``load_state_dict``) gives the same parameters and AdamW state, bitwise."""
    tag = "[shardspec->torchtitan]"
    reference = _stored(f"{root}/titan/step-{STEP}")
    ours = Shardspec(mod, seed=2)
    _step(ours.model, ours.optim, 2)  # AdamW state on every parameter
    with torch.no_grad():  # values nothing else holds: a stale read cannot pass
        for p in ours.model.parameters():
            p.mul_(1.5).add_(0.25)
    want = _gathered(ours.model, ours.optim)
    for hooks in (False, True):
        path = f"{root}/ours-{hooks}/step-20"
        mod.save(ours.state(hooks=hooks, step=20), path, mesh=ours.mesh)
        got = _stored(path)
        if got != reference:
            differ = [(k, got.get(k), v) for k, v in reference.items() if got.get(k) != v]
            fail.append(
                f"{tag} hooks={hooks}: keys/shapes differ from torchtitan's: "
                f"{sorted(set(got) ^ set(reference))[:6]} {differ[:3]}"
            )
        reader = Torchtitan(seed=3)
        _train(reader.model, reader.optim, 1)
        reader.load(path)
        bad = _differ(want, _gathered(reader.model, reader.optim))
        if bad:
            fail.append(f"{tag} hooks={hooks}: torchtitan read back {bad[:6]}")
        if reader.train_state != {"step": 20, "ntokens_seen": 0}:
            fail.append(f"{tag} hooks={hooks}: train state {reader.train_state}")
        _count(tag)


def own_layout(mod: Any, rank: int, root: str, fail: Failures) -> None:
    """``keys="shardspec"``: each squeezed component under ``<name>.<component>`` as the
    hooks shape it (``w13.w1`` ``[32, 16]``, ``w13.w1`` of the experts ``[4, 32, 16]``),
    the optimizer state per component alike, and a load into another placement of the
    same spec (fresh values) gives the saved tensors back, bitwise."""
    tag = "[own]"
    ours = Shardspec(mod, seed=4)
    _step(ours.model, ours.optim, 4)
    want = _gathered(ours.model, ours.optim)
    path = f"{root}/own/step-1"
    mod.save(ours.state(), path, mesh=ours.mesh, keys="shardspec")
    got = _stored(path)
    expect = {
        "layers.0.feed_forward.w13.w1": (32, 16),
        "layers.0.feed_forward.w13.w3": (32, 16),
        "layers.1.moe.experts.w13.w3": (4, 32, 16),
        "optimizer.state.layers.0.moe.experts.w13.w1.exp_avg": (4, 32, 16),
    }
    shapes = {k: got.get(k) for k in expect}
    if shapes != expect or any(k.endswith(".w13") for k in got):
        fail.append(f"{tag} stored {shapes}; whole w13: {[k for k in got if k.endswith('w13')]}")
    other = Shardspec(mod, seed=5)
    _step(other.model, other.optim, 5)
    state = other.state()
    mod.load(state, path, mesh=other.mesh, keys="shardspec")
    other.set_optimizer(state)
    bad = _differ(want, _gathered(other.model, other.optim))
    if bad:
        fail.append(f"{tag} read back {bad[:6]}")
    _count(tag)


def run_all(rank: int, world: int, root: str) -> tuple[Failures, dict[str, int]]:
    steps = [
        ("torchtitan->shardspec", torchtitan_to_shardspec),
        ("shardspec->torchtitan", shardspec_to_torchtitan),
        ("own", own_layout),
    ]
    return run_steps(rank, root, steps), dict(CHECKED)
