"""Multi-rank scenarios for ``tests/test_torchtitan_ckpt.py``: checkpoints exchanged with
torchtitan's checkpointer, on 4 gloo CPU ranks, all in one spawn.

torchtitan itself is not installed here (its wheel, torchtitan 0.3.0, imports ``tyro`` and
``spmd_types``, which pull packages this project does not use), so :class:`Torchtitan`
reproduces what its checkpointer writes and reads, with the torch calls it makes. Read in
github:pytorch/torchtitan at commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (the same in
the 0.3.0 wheel):

* ``torchtitan/components/checkpointer/dcp.py`` (``DCPCheckpointManager``): ``_save``
  calls ``dcp.save(self._flattened_model_states_sd(), checkpoint_id=<folder>/step-N)``
  (``dcp.async_save`` in the async modes), where the flattened state is the model's
  entries at the top level, *no* ``model.`` prefix, next to the ``optimizer``,
  ``lr_scheduler``, ``dataloader`` and ``train_state`` Statefuls; ``_load`` calls
  ``dcp.load`` on the same flattened dict, then ``ModelWrapper.load_state_dict`` (which
  is ``model.load_state_dict(state, strict=False)``).
* ``torchtitan/components/checkpointer/base.py`` (``ModelWrapper``): the model's entries
  are ``model.state_dict()`` itself, not torch's ``get_model_state_dict`` (which fails on
  the fused model: ``'FusedQKVLinear' object has no attribute 'wq'``), so the fused
  ``wqkv`` is stored as its state-dict hooks present it.
* ``torchtitan/models/common/attention.py`` (``FusedQKVLinear``): ``wqkv`` rows are
  ``[n_kv_heads, heads_per_kv + 2, head_dim]``; ``_split_qkv_on_save`` gathers the DTensor
  to replicated and writes ``qkv_linear.wq.weight``, ``wk`` and ``wv``; ``_merge_qkv_on_load``
  joins them back (``examples/models/llama3_fused.py:titan_tiny`` is that module).
* ``torchtitan/components/optimizer/utils.py`` (``get_flat_optim_state_dict``): optimizer
  state under ``state.{fqn}.{name}`` and ``param_groups.{fqn}.{key}``, named by
  *parameter* (so ``wqkv`` whole), inside the ``optimizer`` Stateful: stored as
  ``optimizer.state.<fqn>.exp_avg``.
* ``torchtitan/trainer.py``: ``train_state`` is ``{"step", "ntokens_seen"}``;
  ``lr_scheduler`` (``LRSchedulersContainer``) is ``{"last_epoch"}``. The ``dataloader``
  entry (one key per data-parallel rank) is left out here (``exclude_from_loading``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from examples.models import llama, llama3_fused
from shardspec.runtime import checkpoint as ck
from tests.ckpt_fault_scenarios import _expect_error

Failures = list[str]
CHECKED: dict[str, int] = {}
STEP, TOKENS = 10, 4096
TT = "torchtitan"


def _count(tag: str) -> None:
    CHECKED[tag] = CHECKED.get(tag, 0) + 1


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _gathered(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and its AdamW state, gathered whole by torch, by parameter name."""
    out = {n: _full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for s in ("exp_avg", "exp_avg_sq"):
            out[f"{n}:{s}"] = _full(optim.state[p][s])
    return out


# ----------------------------------------------------------------------------- torchtitan


class FlatOptimizer(Stateful):
    """torchtitan's ``OptimizersContainer`` state: ``get_flat_optim_state_dict`` and
    ``load_flat_optim_state_dict`` of ``torchtitan/components/optimizer/utils.py`` (the
    optimizer built from ``model.named_parameters()``, so its groups carry ``param_names``)."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim

    def state_dict(self) -> dict[str, Any]:
        sd = self.optim.state_dict()
        flat: dict[str, Any] = {}
        ids = {}
        for group in sd["param_groups"]:
            ids.update(zip(group["params"], group["param_names"], strict=True))
            for fqn in group["param_names"]:
                for key, value in group.items():
                    if key not in ("params", "param_names"):
                        flat[f"param_groups.{fqn}.{key}"] = value
        for pid, state in sd["state"].items():
            for name, value in state.items():
                flat[f"state.{ids[pid]}.{name}"] = value
        return flat

    def load_state_dict(self, flat: dict[str, Any]) -> None:
        state, groups, pid = {}, [], 0
        for group in self.optim.param_groups:
            ids = []
            for fqn, param in zip(group["param_names"], group["params"], strict=True):
                ids.append(pid)
                if param in self.optim.state:
                    state[pid] = {n: flat[f"state.{fqn}.{n}"] for n in self.optim.state[param]}
                pid += 1
            new = {"params": ids, "param_names": group["param_names"]}
            for key in group:
                if key not in ("params", "param_names"):
                    new[key] = flat[f"param_groups.{group['param_names'][0]}.{key}"]
            groups.append(new)
        self.optim.load_state_dict({"state": state, "param_groups": groups})


class Torchtitan:
    """A torchtitan trainer's checkpointing of a fused-QKV Llama 3 on FSDP2 over a 1-D
    ``dp_shard`` mesh of every rank (``fully_shard`` per block and on the root, as
    torchtitan's ``apply_fsdp``)."""

    def __init__(self, seed: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        self.model = llama3_fused.titan_tiny()
        llama.init_weights(self.model, seed)
        for block in self.model.layers.values():
            fully_shard(block, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.optim = torch.optim.AdamW(self.model.named_parameters(), lr=1e-2)
        self.optimizer = FlatOptimizer(self.optim)
        self.train_state = {"step": 0, "ntokens_seen": 0}
        self.lr_scheduler = {"last_epoch": 0}

    def train(self, steps: int) -> None:
        """A few AdamW steps on a fixed batch (every rank the same)."""
        g = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, 256, (2, 16), generator=g)
        for _ in range(steps):
            logits = self.model(tokens)
            loss = nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()
            )
            loss.backward()
            self.optim.step()
            self.optim.zero_grad()
        self.train_state = {"step": steps, "ntokens_seen": steps * tokens.numel()}
        self.lr_scheduler = {"last_epoch": steps}

    def states(self) -> dict[str, Any]:
        """``DCPCheckpointManager._flattened_model_states_sd``: the model's
        ``state_dict()`` at the top level, the other states by name."""
        return {
            **self.model.state_dict(),
            "optimizer": self.optimizer,
            "train_state": self.train_state,
            "lr_scheduler": self.lr_scheduler,
        }

    def save(self, folder: str, step: int) -> str:
        path = os.path.join(folder, f"step-{step}")
        dcp.save(self.states(), checkpoint_id=path)
        return path

    def load(self, path: str) -> None:
        """``DCPCheckpointManager.dcp_load``: ``dcp.load`` of the flattened states, then
        the model's own ``load_state_dict`` (its hooks join ``wq``/``wk``/``wv``)."""
        states = self.states()
        dcp.load(states, checkpoint_id=path)
        self.model.load_state_dict(
            {
                k: v
                for k, v in states.items()
                if k not in ("optimizer", "train_state", "lr_scheduler")
            },
            strict=False,
        )
        self.train_state = states["train_state"]
        self.lr_scheduler = states["lr_scheduler"]

    def full(self) -> dict[str, torch.Tensor]:
        return _gathered(self.model, self.optim)


# ----------------------------------------------------------------------------- shardspec


class Shardspec:
    """The same model placed by the spec (tp 2 x dp_shard 2), its optimizer state taken as
    torch gives it (``get_optimizer_state_dict`` with flattened keys: the names torchtitan
    uses), its model state as ``model.state_dict()`` (the hooks' keys) or the parameters
    under their own names."""

    def __init__(self, mod: Any, seed: int) -> None:
        self.mod = mod
        self.mesh = mod.build_mesh(tp=2)
        self.model = llama3_fused.titan_tiny()
        llama.init_weights(self.model, seed)
        mod.distribute(self.model, self.mesh)
        self.optim = torch.optim.AdamW(self.model.named_parameters(), lr=1e-2)
        self.flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def optim_state(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim, options=self.flat)

    def state(self, hooks: bool) -> dict[str, Any]:
        model = self.model.state_dict() if hooks else dict(self.model.named_parameters())
        return {
            **model,
            "optimizer": self.optim_state(),
            "train_state": {"step": 0, "ntokens_seen": 0},
            "lr_scheduler": {"last_epoch": 0},
        }

    def full(self) -> dict[str, torch.Tensor]:
        return _gathered(self.model, self.optim)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    missing = sorted(set(a) ^ set(b))
    return missing + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]


def _stored(path: str) -> dict[str, tuple[int, ...]]:
    """A checkpoint's tensor keys and global shapes."""
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size")}


# ----------------------------------------------------------------------------- scenarios


def torchtitan_to_shardspec(mod: Any, rank: int, root: str, fail: Failures) -> None:
    """A checkpoint torchtitan's checkpointer wrote at dp_shard 4 (step-10: the hooks'
    ``wq``/``wk``/``wv``, optimizer state by parameter name, the train state) loads with
    ``keys="torchtitan"`` into the spec's model at tp 2 x dp_shard 2: every parameter and
    its AdamW state bitwise equal to torchtitan's, gathered whole by torch; the train state
    and the learning-rate schedule as saved. Without ``keys`` the load refuses it, with a
    hint that names ``keys="torchtitan"``."""
    tag = "[torchtitan->shardspec]"
    titan = Torchtitan(seed=1)
    titan.train(3)
    path = titan.save(f"{root}/titan", STEP)
    want = titan.full()
    ours = Shardspec(mod, seed=2)
    state = ours.state(hooks=False)
    err = _expect_error(
        lambda: ck.load(mod.SPEC, state, path, mesh=ours.mesh),
        "missing: layers.0.attention.qkv_linear.wqkv.weight.q",
        "hint: the checkpoint stores layers.",
        "as torchtitan does; load with keys='torchtitan'",
    )
    if err:
        fail.append(f"{tag} without keys=: {err}")
    state = ours.state(hooks=False)
    ck.load(mod.SPEC, state, path, mesh=ours.mesh, keys="torchtitan")
    set_optimizer_state_dict(ours.model, ours.optim, state["optimizer"], options=ours.flat)
    bad = _differ(want, ours.full())
    if bad:
        fail.append(f"{tag} differs from torchtitan's model: {bad[:6]}")
    if state["train_state"] != {"step": 3, "ntokens_seen": 96} or state["lr_scheduler"] != {
        "last_epoch": 3
    }:
        fail.append(f"{tag} train state {state['train_state']}, {state['lr_scheduler']}")
    _count(tag)


def shardspec_to_torchtitan(mod: Any, rank: int, root: str, fail: Failures) -> None:
    """The reverse: the spec's model at tp 2 x dp_shard 2 (trained weights, changed again
    so that nothing is left of the first checkpoint) saved with ``keys="torchtitan"``, both
    from the parameters under their own names and from ``model.state_dict()`` (the hooks'
    keys: saved without ``strict=False`` and without a warning, asynchronously), has
    torchtitan's keys and shapes, and torchtitan's own loading (``dcp.load`` of its
    flattened states, then the model's ``load_state_dict``) at dp_shard 4 gives the same
    parameters and AdamW state, bitwise."""
    tag = "[shardspec->torchtitan]"
    titan = Torchtitan(seed=1)
    titan.train(3)
    reference = _stored(titan.save(f"{root}/titan-ref", STEP))
    ours = Shardspec(mod, seed=2)
    state = ours.state(hooks=False)
    ck.load(mod.SPEC, state, f"{root}/titan/step-{STEP}", mesh=ours.mesh, keys="torchtitan")
    set_optimizer_state_dict(ours.model, ours.optim, state["optimizer"], options=ours.flat)
    with torch.no_grad():  # new values everywhere: a stale read cannot pass
        for p in ours.model.parameters():
            p.mul_(1.5).add_(0.25)
            for s in ("exp_avg", "exp_avg_sq"):
                ours.optim.state[p][s].mul_(0.5)
    want = ours.full()
    for hooks in (False, True):
        path = f"{root}/ours-{hooks}/step-20"
        state = ours.state(hooks=hooks)
        state["train_state"] = {"step": 20, "ntokens_seen": TOKENS}
        state["lr_scheduler"] = {"last_epoch": 20}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # model.state_dict() asynchronously: the staged save plans with the layout too
            done = ck.save(mod.SPEC, state, path, mesh=ours.mesh, keys=TT, asynchronous=hooks)
            if hooks:
                done.result()
        said = [
            str(w.message) for w in caught if issubclass(w.category, ck.UncoveredEntriesWarning)
        ]
        if said:
            fail.append(f"{tag} hooks={hooks}: save warned {said[:1]}")
        got = _stored(path)
        if got != reference:
            shapes = [(k, got[k], v) for k, v in reference.items() if got.get(k, v) != v]
            fail.append(
                f"{tag} hooks={hooks}: keys/shapes differ from torchtitan's: "
                f"{sorted(set(got) ^ set(reference))[:6]} {shapes[:3]}"
            )
        reader = Torchtitan(seed=3)
        reader.train(1)  # optimizer state exists, other values
        reader.load(path)
        bad = _differ(want, reader.full())
        if bad:
            fail.append(f"{tag} hooks={hooks}: torchtitan read back {bad[:6]}")
        if reader.train_state != {"step": 20, "ntokens_seen": TOKENS}:
            fail.append(f"{tag} hooks={hooks}: train state {reader.train_state}")
        _count(tag)


def hooked_state_dicts(mod: Any, rank: int, root: str, fail: Failures) -> None:
    """What torch and shardspec do with the hooked model's state dicts: torch's
    ``get_model_state_dict`` fails on it (the hooks' ``wq`` is no attribute of the fused
    module), which shardspec's save and load never call; shardspec's own layout refuses
    ``model.state_dict()``'s hook keys (unless strict=False), ``keys="torchtitan"`` takes
    them (see :func:`shardspec_to_torchtitan`). Errors that name the cause: an unknown key
    layout; a model whose hooks write other keys than the layout's (the manifest's
    ``state_dict`` section: llama3_fused's first model hooks ``attention`` itself, and
    writes ``attention.wq.weight``); a fused tensor stored whole that a rank holds in two
    blocks (``w13``'s gate and up slices over tp)."""
    tag = "[hooked]"
    ours = Shardspec(mod, seed=2)
    try:
        get_model_state_dict(ours.model)
        fail.append(f"{tag} get_model_state_dict no longer fails on the fused model")
    except AttributeError as e:
        if "'FusedQKVLinear' object has no attribute 'wq'" not in str(e):
            fail.append(f"{tag} get_model_state_dict failed otherwise: {e}")
    state = ours.state(hooks=True)
    err = _expect_error(
        lambda: ck.save(mod.SPEC, state, f"{root}/refused", mesh=ours.mesh),
        "layers.0.attention.qkv_linear.wq.weight (written by a state-dict hook",
        "strict=False",
    )
    if err:
        fail.append(f"{tag} shardspec's layout with the hooks' keys: {err}")
    err = _expect_error(
        lambda: ck.save(mod.SPEC, state, f"{root}/refused", mesh=ours.mesh, keys="megatron"),
        "keys='megatron' is no checkpoint key layout",
        "'torchtitan'",
    )
    if err:
        fail.append(f"{tag} an unknown key layout: {err}")
    other = importlib.import_module("tests.cases.state_dict_hooks.expected")
    mesh = other.build_mesh()  # dp_shard 2 x tp 2
    model = llama3_fused.tiny()
    other.distribute(model, mesh)
    wqkv = {k: v for k, v in model.named_parameters() if "wqkv" in k}
    err = _expect_error(
        lambda: ck.save(other.SPEC, wqkv, f"{root}/refused", mesh=mesh, keys=TT),
        "layers.0.attention.qkv_linear.wqkv.weight: keys='torchtitan' stores component 'q' as "
        "layers.0.attention.qkv_linear.wq.weight, but the model's state-dict hooks",
    )
    if err:
        fail.append(f"{tag} hooks that write other keys: {err}")
    w13 = {k: v for k, v in model.named_parameters() if "w13" in k}
    err = _expect_error(
        lambda: ck.save(other.SPEC, w13, f"{root}/refused", mesh=mesh, keys=TT),
        "layers.0.feed_forward.w13.weight: keys='torchtitan' stores this fused tensor whole",
        "not one block",
    )
    if err:
        fail.append(f"{tag} a fused tensor in two blocks: {err}")
    if os.path.exists(f"{root}/refused") or os.path.exists(f"{root}/refused.partial"):
        fail.append(f"{tag} a refused save left a folder")
    _count(tag)


def _module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("titan_layout", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_steps(rank: int, root: str, steps: list[tuple[str, Any]]) -> Failures:
    """Run each scenario ``step(mod, rank, root, fail)`` on the module compiled to
    ``root/out/titan.py``, a barrier after each; an exception is a failure, not the end."""
    mod = _module(os.path.join(root, "out", "titan.py"))
    fail: Failures = []
    for name, step in steps:
        try:
            step(mod, rank, root, fail)
        except Exception:
            fail.append(f"[{name}] raised:\n{traceback.format_exc()}")
        dist.barrier()
    return fail


def run_all(rank: int, world: int, root: str) -> tuple[Failures, dict[str, int]]:
    steps = [
        ("torchtitan->shardspec", torchtitan_to_shardspec),
        ("shardspec->torchtitan", shardspec_to_torchtitan),
        ("hooked", hooked_state_dicts),
    ]
    return run_steps(rank, root, steps), dict(CHECKED)
