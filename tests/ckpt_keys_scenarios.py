"""Multi-rank scenarios for ``tests/test_ckpt_keys.py``: a spec's own checkpoint key layout
(`checkpoint keys torchtitan`) used by its generated module's ``save``/``load`` without
``keys=``, and `stored fused` tensors stored whole, on 4 gloo CPU ranks in one spawn.

torchtitan's checkpointer is reproduced by :class:`tests.torchtitan_ckpt_scenarios.
Torchtitan` (with the torch calls it makes, and the torchtitan file and commit it follows).
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from examples.models import llama, llama3_fused
from tests.torchtitan_ckpt_scenarios import (
    STEP,
    TOKENS,
    Shardspec,
    Torchtitan,
    _differ,
    _stored,
)

Failures = list[str]
CHECKED: dict[str, int] = {}
QKV = "layers.0.attention.qkv_linear.wqkv.weight"
W13 = "layers.1.feed_forward.w13.weight"


def _count(tag: str) -> None:
    CHECKED[tag] = CHECKED.get(tag, 0) + 1


class Placed(Shardspec):
    """:class:`Shardspec` on a mesh of the caller's sizes, with AdamW state made by one step
    on fixed gradients (every parameter has its ``exp_avg``/``exp_avg_sq``)."""

    def __init__(self, mod: Any, seed: int, tp: int) -> None:
        self.mod = mod
        self.mesh = mod.build_mesh(tp=tp)
        self.model = llama3_fused.titan_tiny()
        llama.init_weights(self.model, seed)
        mod.distribute(self.model, self.mesh)
        self.optim = torch.optim.AdamW(self.model.named_parameters(), lr=1e-2)
        self.flat = StateDictOptions(flatten_optimizer_state_dict=True)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                full = torch.randn(tuple(p.shape), generator=g)
                p.grad = _like(p, full)
        self.optim.step()
        self.optim.zero_grad()


def _like(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` placed as ``p`` is (a DTensor with p's mesh and placements, or plain)."""
    if isinstance(p, DTensor):
        return distribute_tensor(full, p.device_mesh, p.placements)
    return full


def generated_keys(mods: dict[str, Any], rank: int, root: str, fail: Failures) -> None:
    """The generated module of a spec saying `checkpoint keys torchtitan`: its ``load``
    without ``keys=`` reads a checkpoint torchtitan's checkpointer wrote at dp_shard 4 into
    the spec's model at tp 2 x dp_shard 2, bitwise (model and AdamW state); its ``save``
    without ``keys=`` (``model.state_dict()``, synchronously, and the parameters by name,
    asynchronously) writes exactly torchtitan's keys and shapes, which torchtitan's loading
    reads back bitwise; ``keys="shardspec"`` overrides the spec's layout."""
    tag = "[generated keys]"
    mod = mods["keys"]
    titan = Torchtitan(seed=1)
    titan.train(3)
    path = titan.save(f"{root}/titan", STEP)
    reference = _stored(path)
    want = titan.full()
    ours = Placed(mod, seed=2, tp=2)
    state = ours.state(hooks=False)
    mod.load(state, path, mesh=ours.mesh)
    set_optimizer_state_dict(ours.model, ours.optim, state["optimizer"], options=ours.flat)
    bad = _differ(want, ours.full())
    if bad:
        fail.append(f"{tag} load without keys= differs from torchtitan's model: {bad[:6]}")
    with torch.no_grad():  # new values everywhere: a stale read cannot pass
        for p in ours.model.parameters():
            p.mul_(1.5).add_(0.25)
            for s in ("exp_avg", "exp_avg_sq"):
                ours.optim.state[p][s].mul_(0.5)
    want = ours.full()
    for hooks in (True, False):
        out = f"{root}/ours-{hooks}/step-20"
        state = ours.state(hooks=hooks)
        state["train_state"] = {"step": 20, "ntokens_seen": TOKENS}
        state["lr_scheduler"] = {"last_epoch": 20}
        if hooks:
            mod.save(state, out, mesh=ours.mesh)
        else:
            mod.save(state, out, mesh=ours.mesh, asynchronous=True).result()
        got = _stored(out)
        if got != reference:
            fail.append(
                f"{tag} hooks={hooks}: keys/shapes differ from torchtitan's: "
                f"{sorted(set(got) ^ set(reference))[:6]}"
            )
        reader = Torchtitan(seed=3)
        reader.train(1)
        reader.load(out)
        bad = _differ(want, reader.full())
        if bad:
            fail.append(f"{tag} hooks={hooks}: torchtitan read back {bad[:6]}")
    own = f"{root}/own"
    mod.save(dict(ours.model.named_parameters()), own, mesh=ours.mesh, keys="shardspec")
    if f"{QKV}.q" not in _stored(own):
        fail.append(f"{tag} keys='shardspec' did not store components: {sorted(_stored(own))[:4]}")
    _count(tag)


def stored_fused(mods: dict[str, Any], rank: int, root: str, fail: Failures) -> None:
    """A spec whose `fuse` items say `stored fused` (wqkv in whole groups over tp, w13 whole
    over tp): the generated ``save`` at tp 2 x dp_shard 2 stores each fused tensor whole under
    its parameter's name, its AdamW state too (no per-component key), and plain
    ``dcp.load`` of the fused tensor reads it; ``load`` at dp_shard 4 reshards it, bitwise
    equal to the tensors torch gathers whole."""
    tag = "[stored fused]"
    mod = mods["stored"]
    ours = Placed(mod, seed=5, tp=2)
    want = ours.full()
    path = f"{root}/stored"
    state = {**dict(ours.model.named_parameters()), "optimizer": ours.optim_state()}
    mod.save(state, path, mesh=ours.mesh)
    got = _stored(path)
    wants = {
        QKV: (128, 64),
        W13: (192, 64),
        f"optimizer.state.{QKV}.exp_avg": (128, 64),
        f"optimizer.state.{W13}.exp_avg_sq": (192, 64),
    }
    wrong = {k: got.get(k) for k, v in wants.items() if got.get(k) != v}
    parts = [k for k in got if k.endswith((".q", ".k", ".v", ".gate", ".up"))]
    if wrong or parts:
        fail.append(f"{tag} stored keys: wrong {wrong}, per component {parts[:4]}")
    plain = {QKV: torch.zeros(128, 64), f"optimizer.state.{W13}.exp_avg": torch.zeros(192, 64)}
    dcp.load(plain, checkpoint_id=path)
    if not torch.equal(plain[QKV], want[QKV]) or not torch.equal(
        plain[f"optimizer.state.{W13}.exp_avg"], want[f"{W13}:exp_avg"]
    ):
        fail.append(f"{tag} plain dcp.load of the fused tensors differs")
    other = Placed(mod, seed=6, tp=1)  # dp_shard 4
    state = {**dict(other.model.named_parameters()), "optimizer": other.optim_state()}
    mod.load(state, path, mesh=other.mesh)
    set_optimizer_state_dict(other.model, other.optim, state["optimizer"], options=other.flat)
    bad = _differ(want, other.full())
    if bad:
        fail.append(f"{tag} loaded at dp_shard 4 differs: {bad[:6]}")
    _count(tag)


def _module(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_all(rank: int, world: int, root: str) -> tuple[Failures, dict[str, int]]:
    mods = {
        n: _module(os.path.join(root, "out", f"{n}.py"), f"layout_{n}") for n in ("keys", "stored")
    }
    fail: Failures = []
    for name, step in (("generated keys", generated_keys), ("stored fused", stored_fused)):
        try:
            step(mods, rank, root, fail)
        except Exception:
            fail.append(f"[{name}] raised:\n{traceback.format_exc()}")
        dist.barrier()
    return fail, dict(CHECKED)
