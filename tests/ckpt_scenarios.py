"""Checkpoint scenarios for ``tests/test_checkpoint.py``, run on gloo CPU ranks by
:func:`shardspec.testing.run_ranks` (module level, so spawned ranks can import them).

Every scenario trains a model a few Adam steps under one mesh (or loads it), and compares
every parameter and every optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``) bitwise
with a single-process reference: the same model, unsharded, trained the same steps in this
process. Two oracles per tensor, neither of which needs communication:

* this rank's local shard against the reference at the compiler's global indices
  (``SPEC.rank_table``: the very arithmetic the checkpoint uses);
* the local shard against torch's own cut of the reference in the module's form
  (``distribute_tensor(..., src_data_rank=None)`` with the DTensor's placements; the module
  form is cut by ``local_tp_state``/``local_expert_state`` for Megatron-style models).

Pipeline-parallel specs (``llama_pp``: specs/llama_pp.shard, a 4-layer llama) run the same
way on stage models: each rank builds the whole model on meta, ``split_stage`` cuts it to
the rank's stage, and ``distribute`` places the rest on the mesh without the pipeline axis.
The loss is elementwise, so a stage trained alone reproduces the reference's parameters
bitwise. Each rank checks its own stage's parameters and states, and that it holds nothing
else (:func:`check_stage`: no other stage's parameter in its model, or in the state dict it
saves or loads). Their optimizer state dicts are flattened (``flatten_optimizer_state_dict``,
named by parameter): a plain ``param_groups`` list differs per stage, and ``save`` refuses it.

Scenarios append failure strings instead of raising, so one rank's failed check never leaves
the others waiting in a collective; :func:`run_all` returns, per plan item, its failures, how
many tensors it checked (so an item that checked nothing is caught by the parent) and extras.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from examples.models import llama, moe
from shardspec.runtime.dtensor import take

SEED = 1234  # the run that is saved
TARGET_SEED = 77  # a model that loads starts from other values
STEPS = 2  # Adam steps before a matrix checkpoint
LR = 1e-3
CONTINUE_STEPS, CONTINUE_SAVE_AT = 4, 2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # pipeline stages' optimizer state
Failures = list[str]


# --------------------------------------------------------------------------- spec kinds


@dataclass(frozen=True)
class Kind:
    """How to build, and what to compare, for one spec."""

    module: str  # generated module, importable by name
    family: str  # the single-process reference model: "llama", "llama4", "llama_gqa4", "moe"
    local_axis: str | None = None  # Megatron style: the axis whose shard a module holds
    pipeline: bool = False  # each rank's model is its pipeline stage's (split_stage)


# ``llama_gqa4`` is specs/llama.shard with 4 GQA groups instead of 2, compiled by the test
# into ``<root>/gen``: the example's 2 groups cannot split over tp=4.
GQA4_ARGS = {"n_kv_heads": 4}
KINDS: dict[str, Kind] = {
    "llama": Kind("generated.llama", "llama"),
    "llama_local": Kind("generated.llama_local", "llama", "tp"),
    "deepseek_moe": Kind("generated.deepseek_moe", "moe"),
    "deepseek_moe_local": Kind("generated.deepseek_moe_local", "moe", "ep"),
    "llama_gqa4": Kind("llama_gqa4", "llama_gqa4"),
    "llama_pp": Kind("generated.llama_pp", "llama4", pipeline=True),
}


def generated(kind: Kind) -> Any:
    return importlib.import_module(kind.module)


def global_model(family: str) -> nn.Module:
    """The unsharded model every spec of ``family`` describes, with global names."""
    if family == "llama":
        return llama.tiny()
    if family == "llama4":
        return llama.tiny4()
    if family == "llama_gqa4":
        return llama.tiny(**GQA4_ARGS)
    return moe.tiny()


def init_fn(family: str) -> Callable[..., None]:
    return moe.init_weights if family == "moe" else llama.init_weights


def axis_coord(mesh: DeviceMesh, axis: str) -> tuple[int, int]:
    """(this rank's coordinate on ``axis``, the axis size)."""
    names = tuple(mesh.mesh_dim_names or ())
    coord = mesh.get_coordinate()
    assert coord is not None
    return coord[names.index(axis)], mesh.size(names.index(axis))


def module_form(kind: Kind, mesh: DeviceMesh, state: Mapping[str, Any]) -> dict[str, Any]:
    """A global-form state dict as this rank's modules hold it (Megatron style: cut by the
    model's own helpers, not by the compiler)."""
    if kind.local_axis == "tp":
        tp_rank, tp = axis_coord(mesh, "tp")
        return llama.local_tp_state(dict(state), tp_rank, tp, llama.LlamaConfig())
    if kind.local_axis == "ep":
        ep_rank, ep = axis_coord(mesh, "ep")
        return moe.local_expert_state(dict(state), ep_rank, ep, moe.MoEConfig())
    return dict(state)


LOCAL_EXPERT = re.compile(r"layers\.(\d+)\.moe\.local_experts\.(\d+)\.(w[123])\.weight")


def global_key(fqn: str) -> tuple[str, int | None]:
    """The reference tensor a module parameter belongs to, and its position in the rank's
    block of a name-indexed dimension (local expert ``j``)."""
    m = LOCAL_EXPERT.fullmatch(fqn)
    if m is None:
        return fqn, None
    return f"layers.{m[1]}.moe.experts.{m[3]}", int(m[2])


def build(kind: Kind, mesh: DeviceMesh, seed: int) -> nn.Module:
    """The model for ``kind`` on ``mesh``, initialised like the reference with ``seed``.

    DTensor-style models are built on meta, distributed, then materialised and initialised
    (torchtitan style; a pipeline spec's whole model is cut to this rank's stage with
    ``split_stage`` first, at every pipeline size); Megatron-style ones are built with
    local shapes, filled with their own shard of the full initialisation, then distributed.
    """
    mod = generated(kind)
    module_name, func = mod.FACTORY.split(":")
    factory = getattr(importlib.import_module(module_name), func)
    if kind.local_axis is None:
        with torch.device("meta"):
            model = factory(**mod.FACTORY_ARGS)
        if kind.pipeline:
            mod.split_stage(model, mesh)
        mod.distribute(model, mesh)
        model.to_empty(device="cpu")
        init_fn(kind.family)(model, seed)
        return model
    full = global_model(kind.family)
    init_fn(kind.family)(full, seed)
    local = module_form(kind, mesh, {k: v.detach() for k, v in full.named_parameters()})
    _, size = axis_coord(mesh, kind.local_axis)
    model = factory(**{kind.local_axis: size})
    missing, unexpected = model.load_state_dict(local, strict=False)
    if unexpected or any(not k.endswith("._extra_state") for k in missing):
        raise AssertionError(f"module-form state does not fit: {missing} {unexpected}")
    mod.distribute(model, mesh)
    return model


# --------------------------------------------------------------------------- training


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def energy(model: nn.Module, step: int) -> torch.Tensor:
    """A loss with an elementwise gradient (``3w^2 + 2w``), from each rank's local shards:
    every element's gradient, hence every Adam state, is the same under any layout."""
    total = torch.zeros(())
    for _, p in sorted(model.named_parameters()):
        w = local_of(p)
        total = total + (w * w * (w + 1.0)).sum()
    return total


@cache
def skeleton(family: str) -> nn.Module:
    """The global model on meta: the forward that ``lm_loss`` runs on full tensors."""
    with torch.device("meta"):
        return global_model(family)


def lm_loss(model: nn.Module, step: int, family: str = "llama") -> torch.Tensor:
    """Next-token cross entropy of the global model's forward on every parameter's
    ``full_tensor()`` (gradients flow back to the shards), on batch ``step``."""
    params = {
        fqn: p.full_tensor() if isinstance(p, DTensor) else p for fqn, p in model.named_parameters()
    }
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 256, (2, 17), generator=gen)
    logits = torch.func.functional_call(skeleton(family), params, (tokens[:, :-1],))
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def train(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    steps: range,
    loss_fn: Callable[[nn.Module, int], torch.Tensor] = energy,
) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        optim.zero_grad()
        loss = loss_fn(model, step)
        loss.backward()
        optim.step()
        losses.append(loss.detach().clone())
    return losses


@dataclass
class Reference:
    """Full tensors of a single-process run, keyed by global parameter name."""

    param: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    step: dict[str, float] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)


TENSOR_STATES = ("param", "exp_avg", "exp_avg_sq")


@cache
def reference(family: str, steps: int = STEPS, lm: bool = False) -> Reference:
    """The single-process run: the global model from SEED, ``steps`` Adam steps."""
    model = global_model(family)
    init_fn(family)(model, SEED)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    ref = Reference(losses=train(model, optim, range(steps), lm_loss if lm else energy))
    for fqn, p in model.named_parameters():
        st = optim.state[p]
        ref.param[fqn] = p.detach().clone()
        ref.exp_avg[fqn] = st["exp_avg"].clone()
        ref.exp_avg_sq[fqn] = st["exp_avg_sq"].clone()
        ref.step[fqn] = float(st["step"])
    return ref


# --------------------------------------------------------------------------- comparison


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (-0.0 differs from 0.0), shapes and dtypes included."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def max_delta(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()


def describe(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    return f"max delta {max_delta(got, want):.3g}"


class Item:
    """One plan item's outcome on this rank."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.fail: Failures = []
        self.checked = 0
        self.extra: dict[str, Any] = {}

    def check(self, where: str, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        self.checked += 1
        if not same_bits(got, want):
            self.fail.append(f"{where}: {what} ({describe(got, want)})")


def check_model(
    item: Item,
    kind: Kind,
    mesh: DeviceMesh,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    ref: Reference,
    only: Callable[[str], bool] = lambda fqn: True,
) -> None:
    """Every parameter and optimizer state of ``model`` (those ``only`` keeps) against
    ``ref``, bitwise, at the compiler's indices and at torch's placements."""
    mod = generated(kind)
    rank = dist.get_rank()
    forms = {what: module_form(kind, mesh, getattr(ref, what)) for what in TENSOR_STATES}
    for fqn, p in model.named_parameters():
        if not only(fqn):
            continue
        gkey, index = global_key(fqn)
        row = mod.SPEC.rank_table(fqn, mesh)[rank].indices
        st = optim.state.get(p, {})
        for what in TENSOR_STATES:
            where = f"{item.label} {fqn} {what}"
            tensor = p if what == "param" else st.get(what)
            if tensor is None:
                item.fail.append(f"{where}: missing from the optimizer state")
                continue
            local = local_of(tensor)
            want = take(getattr(ref, what)[gkey], row)
            if index is not None:
                want = want[index]
            item.check(where, local, want, "local shard differs at the compiler's indices")
            module_ref = forms[what][fqn]
            if isinstance(tensor, DTensor):
                # torch's own cut of the module-form reference, without communication
                module_ref = distribute_tensor(
                    module_ref, tensor.device_mesh, tensor.placements, src_data_rank=None
                ).to_local()
            item.check(where, local, module_ref, "local shard differs from torch's placements")
        step = st.get("step")
        item.checked += 1
        if step is None or float(step) != ref.step[gkey]:
            item.fail.append(f"{item.label} {fqn} step: {step}, reference {ref.step[gkey]}")
    for group in optim.param_groups:
        if group["lr"] != LR:
            item.fail.append(f"{item.label}: lr {group['lr']}, want {LR}")


STAGE_CHECKS = 3  # check_stage: the model's parameters, the state's model and optimizer keys


def optim_fqn(key: str) -> str:
    """The parameter a flattened optimizer entry belongs to: ``state.<fqn>.exp_avg`` or
    ``param_groups.<fqn>.lr`` -> ``<fqn>``."""
    return key.split(".", 1)[1].rsplit(".", 1)[0]


def check_stage(
    item: Item, kind: Kind, mesh: DeviceMesh, model: nn.Module, state: Mapping[str, Any]
) -> None:
    """A pipeline rank holds its stage's parameters and nothing else: in its model, and in
    the state dict it saved or loaded (model entries, flattened optimizer entries)."""
    want = set(generated(kind).stage_params(mesh))
    stage = generated(kind).stage_of(mesh)
    held = {
        "model parameters": {fqn for fqn, _ in model.named_parameters()},
        "state dict model entries": set(state["model"]),
        "state dict optimizer entries": {optim_fqn(k) for k in state["optim"]},
    }
    for what, names in held.items():
        item.checked += 1
        if names != want:
            item.fail.append(
                f"{item.label} stage {stage} {what}: other stages' {sorted(names - want)}, "
                f"missing {sorted(want - names)}"
            )


# --------------------------------------------------------------------------- scenarios


class Context:
    """Meshes built once per (module, sizes); checkpoints under ``root``."""

    def __init__(self, rank: int, world: int, root: str) -> None:
        self.rank, self.world, self.root = rank, world, root
        self.meshes: dict[tuple[str, tuple[tuple[str, int], ...]], DeviceMesh] = {}

    def mesh(self, kind: Kind, sizes: Mapping[str, int]) -> DeviceMesh:
        key = (kind.module, tuple(sorted(sizes.items())))
        if key not in self.meshes:
            self.meshes[key] = generated(kind).build_mesh(**sizes)
        return self.meshes[key]

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)


def state_of(
    model: nn.Module, optim: torch.optim.Optimizer, kind: Kind | None = None
) -> dict[str, Any]:
    """Model and optimizer state dicts; a pipeline stage's optimizer state is flattened."""
    options = FLAT if kind is not None and kind.pipeline else None
    msd, osd = get_state_dict(model, optim, options=options)
    return {"model": msd, "optim": osd}


def trained(ctx: Context, kind: Kind, sizes: Mapping[str, int], item: Item):
    """SEED's model on ``sizes`` after STEPS steps, checked against the reference."""
    mesh = ctx.mesh(kind, sizes)
    model = build(kind, mesh, SEED)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    train(model, optim, range(STEPS))
    check_model(item, kind, mesh, model, optim, reference(kind.family))
    return mesh, model, optim


def fresh(ctx: Context, kind: Kind, sizes: Mapping[str, int]):
    """A model with other values (TARGET_SEED, another lr) and its state dict to load into."""
    mesh = ctx.mesh(kind, sizes)
    model = build(kind, mesh, TARGET_SEED)
    optim = torch.optim.Adam(model.parameters(), lr=LR * 10)
    return mesh, model, optim, state_of(model, optim, kind)


def save_source(ctx: Context, item: Item, spec: str, sizes: dict[str, int], name: str) -> None:
    """Train, check, and save with the generated ``save`` as ``name``."""
    kind = KINDS[spec]
    mesh, model, optim = trained(ctx, kind, sizes, item)
    state = state_of(model, optim, kind)
    if kind.pipeline:
        check_stage(item, kind, mesh, model, state)
    generated(kind).save(state, ctx.path(name), mesh=mesh)


def load_target(ctx: Context, item: Item, name: str, spec: str, sizes: dict[str, int]) -> None:
    """A fresh model on ``sizes`` loads ``name`` with the generated ``load``; compare."""
    kind = KINDS[spec]
    mesh, model, optim, state = fresh(ctx, kind, sizes)
    generated(kind).load(state, ctx.path(name), mesh=mesh)
    if kind.pipeline:
        check_stage(item, kind, mesh, model, state)
    set_state_dict(
        model,
        optim,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=FLAT if kind.pipeline else None,
    )
    check_model(item, kind, mesh, model, optim, reference(kind.family))


FUSED = ("attention.wqkv.weight", "feed_forward.w13.weight")


def is_fused(key: str) -> bool:
    return any(f in key for f in FUSED)


def expect_error(item: Item, what: str, fn: Callable[[], object], *needles: str) -> str:
    """Run ``fn``; it must raise an error whose text holds every needle. Returns the text."""
    item.checked += 1
    try:
        fn()
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        text = f"{type(e).__name__}: {e}"
        for cause in (e.__cause__, e.__context__):
            if cause is not None:
                text += f"\n{type(cause).__name__}: {cause}"
        missing = [n for n in needles if n not in text]
        if missing:
            item.fail.append(f"{item.label} {what}: error without {missing}: {text[:2000]}")
        return text
    item.fail.append(f"{item.label} {what}: no error")
    return ""


def interop(ctx: Context, item: Item, moe_ckpt: str, llama_ckpt: str) -> None:
    """Generated planners against DCP's default ones, both ways (4 ranks).

    * A checkpoint of the stacked MoE written by the generated ``save`` loads with plain
      ``dcp.load`` (minus the ignored extra state, which the spec never saves).
    * A plain ``dcp.save`` of it loads with the generated ``load``.
    * Llama's fused ``wqkv``/``w13`` are stored per component, so plain ``dcp.load`` of a
      generated checkpoint reports them missing; everything else loads.
    * DCP's default planner refuses llama's ``w13`` with tp=2 (``_StridedShard``: each rank
      holds a slice of gate and a slice of up, which DCP's chunk model cannot express).
    * A fused tensor that DCP did store whole (tp=1, where each rank's shard is one
      block) loads with the generated ``load`` on tp=2, and Megatron style.
    * The generated ``LoadPlanner`` also works given to a plain ``dcp.load`` (no staging).
    """
    # generated save -> plain dcp.load (stacked MoE, dp_shard 2 x ep 2 -> ep 4)
    kind = KINDS["deepseek_moe"]
    spec = generated(kind).SPEC
    mesh, model, optim, state = fresh(ctx, kind, {"ep": 4})
    plain = {
        "model": {k: v for k, v in state["model"].items() if not spec.is_ignored(k)},
        "optim": state["optim"],
    }
    dcp.load(plain, checkpoint_id=ctx.path(moe_ckpt))  # in place: state's tensors are loaded
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    check_model(item, kind, mesh, model, optim, reference(kind.family))

    # plain dcp.save -> generated load (stacked MoE, ep 2 -> ep 4), extra state included
    mesh, model, optim = trained(ctx, kind, {"ep": 2}, item)
    dcp.save(state_of(model, optim), checkpoint_id=ctx.path("interop-moe-plain"))
    mesh, model, optim, state = fresh(ctx, kind, {"ep": 4})
    generated(kind).load(state, ctx.path("interop-moe-plain"), mesh=mesh)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    check_model(item, kind, mesh, model, optim, reference(kind.family))
    # ... and with the generated LoadPlanner given to plain dcp.load (no staging)
    mesh, model, optim, state = fresh(ctx, kind, {"ep": 1})
    planner = generated(kind).LoadPlanner(mesh)
    dcp.load(state, checkpoint_id=ctx.path("interop-moe-plain"), planner=planner)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    check_model(item, kind, mesh, model, optim, reference(kind.family))

    # generated save -> plain dcp.load (llama): the fused parameters are not there whole
    kind = KINDS["llama"]
    mesh, model, optim, state = fresh(ctx, kind, {"tp": 1})
    expect_error(
        item,
        "plain dcp.load of fused params",
        lambda: dcp.load(state, checkpoint_id=ctx.path(llama_ckpt)),
        "Missing key in checkpoint",
        "model.layers.0.attention.wqkv.weight",
    )
    mesh, model, optim, state = fresh(ctx, kind, {"tp": 1})
    subset = {
        "model": {k: v for k, v in state["model"].items() if not is_fused(k)},
        "optim": {
            "state": {k: v for k, v in state["optim"]["state"].items() if not is_fused(k)},
            "param_groups": state["optim"]["param_groups"],
        },
    }
    dcp.load(subset, checkpoint_id=ctx.path(llama_ckpt))
    state["optim"]["param_groups"] = subset["optim"]["param_groups"]  # loaded as objects
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    check_model(item, kind, mesh, model, optim, reference(kind.family), lambda f: not is_fused(f))

    # DCP's default planner and the tp-split fused w13 (gate and up slices per rank)
    mesh, model, optim = trained(ctx, kind, {"tp": 2}, item)
    text = expect_error(
        item,
        "plain dcp.save of a _StridedShard fused w13",
        lambda: dcp.save(state_of(model, optim), checkpoint_id=ctx.path("interop-llama-tp2")),
        "Failed to validate global plan",
    )
    start = text.find("Failed to validate global plan")
    item.extra["dcp_strided_w13"] = text[start : start + 300]

    # plain dcp.save with tp=1 (fused tensors stored whole) -> generated load on tp=2 and
    # Megatron style: components read out of the whole tensors
    mesh, model, optim = trained(ctx, kind, {"tp": 1}, item)
    dcp.save(state_of(model, optim), checkpoint_id=ctx.path("interop-llama-tp1"))
    for spec_name in ("llama", "llama_local"):
        target = KINDS[spec_name]
        mesh, model, optim, state = fresh(ctx, target, {"tp": 2})
        planner = generated(target).load(state, ctx.path("interop-llama-tp1"), mesh=mesh)
        whole = sorted({k for k in planner._legacy.values() if "layers.0." in k})
        item.extra[f"whole fused read by {spec_name}"] = whole
        if not any(k.endswith("w13.weight") for k in whole):
            item.fail.append(f"{item.label} {spec_name}: no fused tensor was read whole")
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        check_model(item, target, mesh, model, optim, reference(target.family))
    # ... and with the generated LoadPlanner given to plain dcp.load (no staging: component
    # chunks are committed into the live fused tensors as they arrive)
    target = KINDS["llama_local"]
    mesh, model, optim, state = fresh(ctx, target, {"tp": 2})
    planner = generated(target).LoadPlanner(mesh)
    dcp.load(state, checkpoint_id=ctx.path("interop-llama-tp1"), planner=planner)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    check_model(item, target, mesh, model, optim, reference(target.family))


def save_load_continue(ctx: Context, item: Item, sizes: dict[str, int]) -> None:
    """Train CONTINUE_STEPS steps of the llama LM loss, saving after CONTINUE_SAVE_AT; a
    second model loads that checkpoint and trains the remaining steps: its losses and every
    parameter and optimizer state must equal the first run's bitwise (max delta 0.0), and
    the first run must equal the single-process run."""
    kind = KINDS["llama"]
    mesh = ctx.mesh(kind, sizes)
    path = ctx.path("continue")
    steps = range(CONTINUE_STEPS)
    model = build(kind, mesh, SEED)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    first = train(model, optim, steps[:CONTINUE_SAVE_AT], lm_loss)
    generated(kind).save(state_of(model, optim), path, mesh=mesh)
    first += train(model, optim, steps[CONTINUE_SAVE_AT:], lm_loss)
    ref = reference(kind.family, CONTINUE_STEPS, lm=True)
    check_model(item, kind, mesh, model, optim, ref)
    for step, (a, b) in enumerate(zip(first, ref.losses, strict=True)):
        item.check(f"{item.label} loss {step}", a, b, "differs from the single-process run")

    mesh, again, optim2, state = fresh(ctx, kind, sizes)
    generated(kind).load(state, path, mesh=mesh)
    set_state_dict(again, optim2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if any(group["lr"] != LR for group in optim2.param_groups):
        item.fail.append(f"{item.label}: the learning rate was not restored")
    second = train(again, optim2, steps[CONTINUE_SAVE_AT:], lm_loss)
    delta = 0.0
    for step, (a, b) in enumerate(zip(first[CONTINUE_SAVE_AT:], second, strict=True)):
        item.check(f"{item.label} loss {CONTINUE_SAVE_AT + step}", b, a, "differs after resuming")
        delta = max(delta, max_delta(a, b))
    ps, qs = dict(model.named_parameters()), dict(again.named_parameters())
    for fqn, p in ps.items():
        q = qs[fqn]
        pairs = [("param", p, q)] + [
            (what, optim.state[p][what], optim2.state[q][what])
            for what in ("exp_avg", "exp_avg_sq", "step")
        ]
        for what, a, b in pairs:
            item.check(f"{item.label} {fqn} {what}", local_of(b), local_of(a), "differs")
            delta = max(delta, max_delta(local_of(a), local_of(b)))
    item.extra["max_delta"] = delta
    item.extra["losses"] = [float(x) for x in first]


# --------------------------------------------------------------------------- driver


def label(entry: Sequence[Any]) -> str:
    """A plan item's name in reports."""
    if entry[0] == "save":
        return f"save {entry[3]}"
    if entry[0] == "load":
        return f"load {entry[1]} -> {entry[2]} {entry[3]}"
    return entry[0]


def run_all(
    rank: int, world: int, root: str, plan: Sequence[tuple]
) -> dict[str, tuple[Failures, int, dict[str, Any]]]:
    """Run ``plan`` on this rank. Items: ``("save", spec, sizes, name)``, ``("load", name,
    spec, sizes)``, ``("interop", moe_ckpt, llama_ckpt)``, ``("continue", sizes)``.
    Checkpoints live under ``root``; ``root/gen`` holds test-compiled specs. An item that
    raises is reported with its traceback, and the next one still runs. Returns, per item
    label, its failures, the number of tensors it checked and its extras."""
    gen = os.path.join(root, "gen")
    if gen not in sys.path:
        sys.path.insert(0, gen)
    # DTensor warns on every multi-axis all-gather; the output is for failures.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # up to 8 ranks on 2 cores: one thread each, or they thrash
    ctx = Context(rank, world, root)
    out: dict[str, tuple[Failures, int, dict[str, Any]]] = {}
    for entry in plan:
        item = Item(label(entry))
        try:
            if entry[0] == "save":
                save_source(ctx, item, *entry[1:])
            elif entry[0] == "load":
                load_target(ctx, item, *entry[1:])
            elif entry[0] == "interop":
                interop(ctx, item, *entry[1:])
            elif entry[0] == "continue":
                save_load_continue(ctx, item, *entry[1:])
            else:
                item.fail.append(f"unknown plan item {entry}")
        except (Exception, CheckpointException):  # report, go on with the next item
            item.fail.append(f"{item.label} raised:\n{traceback.format_exc()}")
        dist.barrier()
        out[item.label] = (item.fail, item.checked, item.extra)
    return out
