"""Pipeline parallelism through specs/llama_pp.shard on 4 gloo ranks (tests/test_pipeline.py).

* ``train``: 2 stages x dp_shard 2: ``split_stage`` + ``parallelize`` (FSDP2 within each
  stage), trained through torch.distributed.pipelining (GPipe, then 1F1B), against a single
  process on the same global batches.
* ``reshard``: train at pp 2 x dp_shard 2, ``save`` model and optimizer; load at pp 1 x
  dp_shard 4 and at pp 4 x dp_shard 1, continue. The loaded state equals the saved one
  bitwise, and each continued run equals, bitwise, the same continuation from torch's own
  reshard of the same full state (``set_state_dict``): what can be compared bitwise across
  meshes.
* ``local names``: stage models numbered Megatron style (``split layers.{layer} local``, a
  variant of the spec compiled by the real CLI): stage 1's ``layers.0`` is the model's
  ``layers.2``. Saved at pp 2, it loads into the whole model with every layer where it
  belongs (read naively, stage 1's layers would overwrite layers 0 and 1), and into
  global-named stages; and a global-named checkpoint loads into local-named stages.
* ``errors``: a stage model holding another stage's layer, or lacking one, is refused by
  name before anything changes.
* ``refused save``: at pp 2 x dp_shard 2, a plain optimizer state dict (its
  ``param_groups`` list differs between the stages, and a checkpoint stores it once) is
  refused by a full ``save`` on every rank, from inside DCP's planning, with the hint to
  flatten; the checkpoint saved before at that path keeps its files and loads bitwise on
  the same mesh, and no ``.partial`` or ``.old`` folder is left. The failure holds no mesh
  past the exception: the harness's teardown then finds no gloo thread left.
"""

from __future__ import annotations

import copy
import gc
import os
import tempfile
import traceback
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from examples.models import llama
from shardspec.testing import Checks
from tests.pipeline_harness import forward_backward, lm_loss, make_pipeline

LR = 1e-3
BATCH = 8  # global batch, split over dp_shard, then into microbatches
SEQ = 16
MICROBATCHES = 2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def batch(step: int, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def dp_part(t: torch.Tensor, mesh) -> torch.Tensor:
    dp = mesh["dp_shard"]
    return t.chunk(dp.size())[dp.get_local_rank()]


def whole(seed: int = 0) -> nn.Module:
    model = llama.tiny4()
    llama.init_weights(model, seed)
    return model


class Trainer:
    """One rank's stage (or whole model at pp 1), parallelized by the layout, with AdamW
    and, at pp > 1, a pipeline schedule."""

    def __init__(self, layout, mesh, model: nn.Module, schedule: str = "gpipe") -> None:
        self.layout, self.mesh, self.model = layout, mesh, model
        self.pp = mesh["pp"].size()
        self.stage = layout.stage_of(mesh)
        self.optim = torch.optim.AdamW(model.parameters(), lr=LR)
        self.pipe = None
        if self.pp > 1:
            self.pipe = make_pipeline(
                model,
                self.stage,
                self.pp,
                layout.pipeline_group(mesh),
                (BATCH // mesh["dp_shard"].size(), SEQ),
                MICROBATCHES,
                schedule=schedule,
            )

    def step(self, step: int) -> float | None:
        """One AdamW step on this rank's part of the global batch; the global mean loss on
        the last stage (None on the others)."""
        inputs, targets = (dp_part(t, self.mesh) for t in batch(step))
        self.optim.zero_grad()
        value = forward_backward(self.model, self.pipe, inputs, targets)
        self.optim.step()
        if value is None:
            return None
        dp = self.mesh["dp_shard"]
        dist.all_reduce(value, group=dp.get_group())
        return float(value / dp.size())


def stage_model(layout, mesh, seed: int = 0) -> nn.Module:
    model = whole(seed)
    if mesh["pp"].size() > 1:
        layout.split_stage(model, mesh)
    layout.parallelize(model, mesh)
    layout.verify(model, mesh)
    return model


# ----------------------------------------------------------------------------- scenarios


def scenario_train(c: Checks) -> None:
    import generated.llama_pp as layout

    mesh = layout.build_mesh(pp=2, tp=1)
    for schedule in ("gpipe", "1f1b"):
        tag = "train"
        ref = whole()
        ref_optim = torch.optim.AdamW(ref.parameters(), lr=LR)
        ref_losses = []
        steps = 3
        for step in range(steps):
            inputs, targets = batch(step)
            ref_optim.zero_grad()
            loss = lm_loss(ref(inputs), targets)
            loss.backward()
            ref_optim.step()
            ref_losses.append(loss.item())
        model = stage_model(layout, mesh)
        names = {n for n, _ in model.named_parameters()}
        c.check(tag, names == set(layout.stage_params(mesh)), f"stage holds {sorted(names)}")
        trainer = Trainer(layout, mesh, model, schedule)
        for step in range(steps):
            got = trainer.step(step)
            if trainer.stage == 1:
                want = ref_losses[step]
                ok = got is not None and abs(got - want) <= 1e-5 * abs(want)
                c.check(tag, ok, f"{schedule} step {step}: loss {got} vs {want}")
        ref_params = dict(ref.named_parameters())
        for fqn, p in model.named_parameters():
            d = (full(p.detach()) - ref_params[fqn].detach()).abs()
            worst, mean = d.max().item(), d.mean().item()
            ok = mean <= 1e-6 and worst <= 2 * LR * steps
            c.check(tag, ok, f"{schedule} {fqn}: max delta {worst}, mean {mean}")


def _full_state(model: nn.Module, optim) -> tuple[dict, dict]:
    """Every stage's full model and optimizer state, on every rank (global names)."""
    opts = StateDictOptions(full_state_dict=True)
    msd, osd = get_state_dict(model, optim, options=opts)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (msd, osd))
    m_all: dict = {}
    o_all: dict = {"state": {}, "param_groups": []}
    for m, o in every:
        m_all.update(m)
        o_all["state"].update(o["state"])
        if not o_all["param_groups"]:
            o_all["param_groups"] = [dict(g, params=[]) for g in o["param_groups"]]
        for g_all, g in zip(o_all["param_groups"], o["param_groups"], strict=True):
            g_all["params"] = sorted(set(g_all["params"]) | set(g["params"]))
    return m_all, o_all


def scenario_reshard(c: Checks, root: str) -> None:
    import generated.llama_pp as layout

    tag = "reshard"
    path = os.path.join(root, "pp2dp2")
    mesh_a = layout.build_mesh(pp=2, tp=1)
    model = stage_model(layout, mesh_a)
    trainer = Trainer(layout, mesh_a, model)
    for step in range(2):
        trainer.step(step)
    # Pipeline stages: optimizer entries named by parameter (what torchtitan saves), so no
    # stage's param_groups overwrite another's (save refuses a plain param_groups list).
    msd, osd = get_state_dict(model, trainer.optim, options=FLAT)
    layout.save({"model": msd, "optim": osd}, path, mesh=mesh_a)
    saved_m, saved_o = _full_state(model, trainer.optim)
    full_opts = StateDictOptions(full_state_dict=True)
    for pp in (1, 4):
        mesh_b = layout.build_mesh(pp=pp, tp=1)
        runs = []
        for how in ("load", "torch"):
            model_b = stage_model(layout, mesh_b, seed=7)
            trainer_b = Trainer(layout, mesh_b, model_b)
            names = {n for n, _ in model_b.named_parameters()}
            msd_b, osd_b = get_state_dict(model_b, trainer_b.optim, options=FLAT)
            if how == "load":
                state = {"model": msd_b, "optim": osd_b}
                layout.load(state, path, mesh=mesh_b)
                set_state_dict(
                    model_b,
                    trainer_b.optim,
                    model_state_dict=state["model"],
                    optim_state_dict=state["optim"],
                    options=FLAT,
                )
                got_m, got_o = get_state_dict(model_b, trainer_b.optim, options=full_opts)
                for k, v in got_m.items():
                    c.check(tag, torch.equal(v, saved_m[k]), f"pp{pp}: loaded {k} differs")
                for pk, st in got_o["state"].items():
                    for name, v in st.items():
                        same = torch.equal(full(v), full(saved_o["state"][pk][name]))
                        c.check(tag, same, f"pp{pp}: loaded {pk}.{name} differs")
            else:  # torch's own reshard of the same full state (this stage's part)
                # (set_state_dict changes the dicts it is given: hand it copies.)
                optim_part = {
                    "state": {k: v for k, v in saved_o["state"].items() if k in names},
                    "param_groups": [
                        dict(g, params=[p for p in g["params"] if p in names])
                        for g in saved_o["param_groups"]
                    ],
                }
                set_state_dict(
                    model_b,
                    trainer_b.optim,
                    model_state_dict={k: v.clone() for k, v in saved_m.items() if k in names},
                    optim_state_dict=copy.deepcopy(optim_part),
                    options=full_opts,
                )
            losses = [trainer_b.step(step) for step in (2, 3)]
            runs.append(
                (losses, {k: full(v.detach()).clone() for k, v in model_b.state_dict().items()})
            )
        (la, sa), (lb, sb) = runs
        c.check(tag, la == lb, f"pp{pp}: continued losses {la} vs {lb}")
        for k in sa:
            delta = (sa[k] - sb[k]).abs().max().item()
            c.check(tag, delta == 0.0, f"pp{pp} {k}: continued run differs by {delta}")


def scenario_local_names(c: Checks, root: str) -> None:
    import llama_pp_local as local_layout  # compiled by the test into its build dir

    import generated.llama_pp as layout

    tag = "local names"
    ref = {k: v.clone() for k, v in whole().state_dict().items()}
    mesh = local_layout.build_mesh(pp=2, tp=1)
    model = whole()
    local_layout.split_stage(model, mesh)
    held = [n for n, _ in model.named_parameters() if n.startswith("layers.")]
    names = sorted({n.split(".")[1] for n in held})
    c.check(tag, names == ["0", "1"], f"stage layers are named {names}")
    if local_layout.stage_of(mesh) == 1:  # its layers.0 is the model's layers.2
        value = model.get_parameter("layers.0.attention.wo.weight").detach()
        c.check(tag, torch.equal(value, ref["layers.2.attention.wo.weight"]), "renumbering")
        c.check(
            tag,
            not torch.equal(value, ref["layers.0.attention.wo.weight"]),
            "layers differ",
        )
    local_layout.parallelize(model, mesh)
    local_layout.verify(model, mesh)
    path = os.path.join(root, "local")
    local_layout.save({"model": model.state_dict()}, path, mesh=mesh)
    # Into the whole model at pp 1: every layer where it belongs.
    mesh1 = layout.build_mesh(pp=1, tp=1)
    m1 = stage_model(layout, mesh1, seed=9)
    layout.load({"model": m1.state_dict()}, path, mesh=mesh1)
    for k, v in m1.state_dict().items():
        c.check(tag, torch.equal(full(v), ref[k]), f"pp1: {k} is not the model's {k}")
    # Into global-named stages at pp 2, and back: a global-named checkpoint into local ones.
    m2 = stage_model(layout, mesh, seed=9)
    layout.load({"model": m2.state_dict()}, path, mesh=mesh)
    for k, v in m2.state_dict().items():
        c.check(tag, torch.equal(full(v), ref[k]), f"global stage: {k} differs")
    path2 = os.path.join(root, "global")
    layout.save({"model": m2.state_dict()}, path2, mesh=mesh)
    m3 = whole(seed=9)
    local_layout.split_stage(m3, mesh)
    local_layout.parallelize(m3, mesh)
    local_layout.load({"model": m3.state_dict()}, path2, mesh=mesh)
    stage_layers = [int(x) for x in local_layout.stage_layers(mesh)]
    for k, v in m3.state_dict().items():
        g = k
        if k.startswith("layers."):
            parts = k.split(".")
            parts[1] = str(stage_layers[int(parts[1])])
            g = ".".join(parts)
        c.check(tag, torch.equal(full(v), ref[g]), f"local stage: {k} is not the model's {g}")


def scenario_errors(c: Checks) -> None:
    import generated.llama_pp as layout
    from shardspec.runtime import SpecError

    tag = "errors"
    mesh = layout.build_mesh(pp=2, tp=1)

    def refused(what: str, fn: Callable[[], object], needle: str, model: nn.Module) -> None:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            fn()
        except SpecError as e:
            c.check(tag, needle in str(e), f"{what}: message {e!s:.300}")
        else:
            c.check(tag, False, f"{what}: not refused")
        after = model.state_dict()
        same = before.keys() == after.keys() and all(
            type(after[k]) is torch.Tensor and torch.equal(before[k], after[k]) for k in before
        )
        c.check(tag, same, f"{what}: the model changed")

    other = 2 if layout.stage_of(mesh) == 0 else 0
    m = whole()
    layout.split_stage(m, mesh)
    m.layers[str(other)] = whole().layers[str(other)]  # another stage's layer
    refused("foreign layer", lambda: layout.parallelize(m, mesh), f"holds layers.{other}.", m)
    m = whole()
    layout.split_stage(m, mesh)
    del m.layers[next(iter(m.layers))]
    refused("missing layer", lambda: layout.distribute(m, mesh), "lacks 6 parameter(s)", m)
    m = whole()
    refused("whole model", lambda: layout.parallelize(m, mesh), "is not stage", m)
    refused("no such stage", lambda: layout.stage_layers(mesh, stage=5), "is not one of the 2", m)
    m = whole()
    m.norm = None  # not the whole model: split_stage refuses before cutting anything
    refused("split a part", lambda: layout.split_stage(m, mesh), "lacks 1 of the manifest's", m)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _snapshot(state: dict) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor in a (nested) state dict, copied, by flat key."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    return {k: _local(v).detach().clone() for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _files(path: str) -> dict[str, tuple[int, int]]:
    """Every file under ``path`` (relative name -> size, mtime in ns)."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full_name = os.path.join(dirpath, name)
            st = os.stat(full_name)
            out[os.path.relpath(full_name, path)] = (st.st_size, st.st_mtime_ns)
    return out


def scenario_refused_save(c: Checks, root: str) -> None:
    """A plain (not flattened) optimizer state dict at pp 2 x dp_shard 2: its
    ``param_groups`` differ between the stages, so ``save`` refuses it on every rank, from
    inside DCP's planning, and the checkpoint already at that path stays as it was."""
    import generated.llama_pp as layout
    from shardspec.runtime.checkpoint import CheckpointError

    tag = "refused save"
    path = os.path.join(root, "refused")
    mesh = layout.build_mesh(pp=2, tp=1)
    model = stage_model(layout, mesh)
    trainer = Trainer(layout, mesh, model)
    trainer.step(0)
    msd, osd = get_state_dict(model, trainer.optim, options=FLAT)
    layout.save({"model": msd, "optim": osd}, path, mesh=mesh)
    saved = _snapshot({"model": msd, "optim": osd})
    c.check(tag, len(saved) > 13, f"only {len(saved)} tensors saved")
    dist.barrier()
    siblings = sorted(os.listdir(root))
    files = _files(path)
    dist.barrier()
    trainer.step(1)  # the refused save's values differ from the checkpoint's
    msd, osd = get_state_dict(model, trainer.optim)  # plain: param_groups per stage
    # Once the error is handled, nothing may hold the refused state dict (nor, through it,
    # the mesh and its gloo groups): no reference cycle through the exception's frames,
    # which would need the garbage collector, here off.
    probe = weakref.ref(next(iter(msd.values())))
    collecting = gc.isenabled()
    gc.disable()
    try:
        try:
            layout.save({"model": msd, "optim": osd}, path, mesh=mesh)
        except CheckpointError as e:
            msg = str(e)
            ok = "differ between pipeline stages" in msg and "param_groups" in msg
            c.check(tag, ok, f"refused with {msg:.400}")
            c.check(tag, "flatten_optimizer_state_dict=True" in msg, f"no hint: {msg:.400}")
        except Exception as e:
            c.check(tag, False, f"refused with {type(e).__name__}, not CheckpointError: {e}")
        else:
            c.check(tag, False, "a param_groups list that differs per stage was saved")
        del msd, osd
        c.check(tag, probe() is None, "the refused state dict outlived the error (a cycle)")
    finally:
        if collecting:
            gc.enable()
    dist.barrier()
    now = sorted(os.listdir(root))
    c.check(tag, now == siblings, f"the refused save left {sorted(set(now) - set(siblings))}")
    for debris in (path + ".partial", path + ".old"):
        c.check(tag, not os.path.exists(debris), f"the refused save left {debris}")
    c.check(tag, _files(path) == files, "the previous checkpoint's files changed")
    # The previous checkpoint still loads, bitwise, into a fresh stage.
    model_b = stage_model(layout, mesh, seed=7)
    trainer_b = Trainer(layout, mesh, model_b)
    msd_b, osd_b = get_state_dict(model_b, trainer_b.optim, options=FLAT)
    state = {"model": msd_b, "optim": osd_b}
    layout.load(state, path, mesh=mesh)
    got = _snapshot(state)
    c.check(tag, got.keys() == saved.keys(), f"loaded {sorted(got)} vs {sorted(saved)}")
    for k, v in saved.items():
        same = k in got and got[k].dtype == v.dtype and torch.equal(got[k], v)
        c.check(tag, same, f"loaded {k} differs from the saved one")


def run_all(rank: int, world: int, build_dir: str) -> tuple[list[str], dict]:
    import sys

    if build_dir not in sys.path:
        sys.path.insert(0, build_dir)
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, or they thrash
    c = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        dist.broadcast_object_list(root, src=0)
        for name, fn in (
            ("train", lambda: scenario_train(c)),
            ("reshard", lambda: scenario_reshard(c, root[0])),
            ("local names", lambda: scenario_local_names(c, root[0])),
            ("errors", lambda: scenario_errors(c)),
            ("refused save", lambda: scenario_refused_save(c, root[0])),
        ):
            try:
                fn()
            except Exception:
                c.fail.append(f"[{name}] raised:\n{traceback.format_exc()}")
        try:
            dist.barrier()
        except Exception:  # a rank stuck in a failed scenario: keep the reasons above
            c.fail.append(f"[final barrier] raised:\n{traceback.format_exc()}")
    return c.fail, c.count


__all__ = ["run_all"]
