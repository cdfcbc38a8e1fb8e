"""Weights tied across pipeline stages, through specs/llama_pp_tied.shard on 4 gloo ranks
(tests/test_pipeline_tie.py). The tied 4-layer llama's embedding is its output head: the
whole model holds the weight once (``tok_embeddings.weight``); the last stage holds a copy
as ``output.weight``.

* ``train``: pp 2 x dp_shard 2. Stage models cut by ``split_stage`` from a model tied the
  transformers way (``output.weight`` is ``tok_embeddings.weight``), parallelized, trained
  through torch.distributed.pipelining with ``reduce_tied_grads`` before each optimizer
  step, against a single process training the tied model: losses within fp32 tolerance,
  both copies close to the reference's one weight and equal to each other bitwise. Without
  ``reduce_tied_grads`` the copies part after one step (what the call is for).
* ``reshard``: save at pp 2 x dp_shard 2 (one stored tensor, under the source's name, and
  no key for the alias); load at pp 1 x dp_shard 4 (the whole model, tied the transformers
  way: ``parallelize`` leaves the tied modules to FSDP at TP size 1) and at pp 4 x
  dp_shard 1 (Megatron-style stage models: ``examples.models.llama.stage_model`` gives the
  last stage a copy of the embedding; stages 0 and 3 tie through a group of their own):
  every tensor of model and AdamW state equals the saved one bitwise, the alias included;
  the continued runs equal, bitwise, the same continuation from torch's own reshard of the
  same full state.
* ``broadcast``: ``broadcast_tied`` copies the source's value over a perturbed alias, at
  pp 2 (the pipeline group) and pp 4 (stages 0 and 3 only).
* ``errors``: an untied model under the tied spec is refused by ``split_stage`` (SS097) and
  by ``parallelize`` at pp 1 (the stage holds both names as two tensors), unchanged.
"""

from __future__ import annotations

import copy
import os
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from examples.models import llama
from shardspec.testing import Checks
from tests.pipeline_harness import lm_loss
from tests.pipeline_scenarios import FLAT, LR, Trainer, batch, full

ALIAS, SOURCE = "output.weight", "tok_embeddings.weight"


def tied(seed: int = 0) -> nn.Module:
    """The tied 4-layer llama (its head computes with the embedding's weight)."""
    model = llama.tiny_tied(n_layers=4)
    llama.init_weights(model, seed)
    return model


def tied_hf_style(seed: int = 0) -> nn.Module:
    """The same model, tied as transformers ties: an output module whose weight *is* the
    embedding's (named_parameters() lists it once, as the source)."""
    model = llama.tiny4()
    llama.init_weights(model, seed)
    model.output.weight = model.tok_embeddings.weight
    return model


class TiedTrainer(Trainer):
    """Trainer that sums the tied copies' gradients before each optimizer step (a step
    pre-hook: it holds the model, not the trainer, so no reference cycle keeps the last
    stage's autograd graphs, and with them the mesh, alive)."""

    def __init__(self, *args, reduce: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if reduce:
            layout, model, mesh = self.layout, self.model, self.mesh
            self.optim.register_step_pre_hook(
                lambda *_: layout.reduce_tied_grads(model, mesh)  # type: ignore[arg-type]
            )


def split_model(layout, mesh, seed: int = 0) -> nn.Module:
    model = tied_hf_style(seed)
    if mesh["pp"].size() > 1:
        layout.split_stage(model, mesh)
    layout.parallelize(model, mesh)
    layout.verify(model, mesh)
    return model


def megatron_model(layout, mesh, seed: int = 0) -> nn.Module:
    """A stage model built as Megatron builds one: the last stage gets an output module
    holding a copy of the embedding."""
    model = tied(seed)
    pp, s = mesh["pp"].size(), layout.stage_of(mesh)
    if pp > 1:
        layers = [int(v) for v in layout.stage_layers(mesh)]
        llama.stage_model(model, layers, first=s == 0, last=s == pp - 1)
    layout.parallelize(model, mesh)
    layout.verify(model, mesh)
    return model


def copies(model: nn.Module) -> list[torch.Tensor]:
    """Every rank's full value of the tied weight, from whichever name its stage holds it
    under (None where the stage holds neither), gathered on every rank."""
    params = dict(model.named_parameters())
    mine = params.get(SOURCE, params.get(ALIAS))
    value = None if mine is None else full(mine.detach()).clone()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return [v for v in every if v is not None]


# ----------------------------------------------------------------------------- scenarios


def scenario_train(c: Checks) -> None:
    import generated.llama_pp_tied as layout

    tag = "train"
    mesh = layout.build_mesh(pp=2, tp=1)
    steps = 3
    ref = tied()
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_losses = []
    for step in range(steps):
        inputs, targets = batch(step)
        ref_optim.zero_grad()
        loss = lm_loss(ref(inputs), targets)
        loss.backward()
        ref_optim.step()
        ref_losses.append(loss.item())
    model = split_model(layout, mesh)
    names = {n for n, _ in model.named_parameters()}
    stage = layout.stage_of(mesh)
    c.check(tag, (ALIAS in names) == (stage == 1), f"stage {stage} holds {sorted(names)}")
    c.check(tag, (SOURCE in names) == (stage == 0), f"stage {stage} holds {sorted(names)}")
    trainer = TiedTrainer(layout, mesh, model)
    for step in range(steps):
        got = trainer.step(step)
        if trainer.stage == 1:
            want = ref_losses[step]
            ok = got is not None and abs(got - want) <= 1e-5 * abs(want)
            c.check(tag, ok, f"step {step}: loss {got} vs {want}")
    ref_params = dict(ref.named_parameters())
    for fqn, p in model.named_parameters():
        want = ref_params[SOURCE if fqn == ALIAS else fqn].detach()
        d = (full(p.detach()) - want).abs()
        worst, mean = d.max().item(), d.mean().item()
        ok = mean <= 1e-6 and worst <= 2 * LR * steps
        c.check(tag, ok, f"{fqn}: max delta {worst}, mean {mean}")
    every = copies(model)
    c.check(tag, len(every) == 4, f"{len(every)} ranks hold the tied weight")
    c.check(tag, all(torch.equal(v, every[0]) for v in every), "the tied copies differ")

    # The control: without the gradient sum the copies part after one step.
    model = split_model(layout, mesh)
    trainer = TiedTrainer(layout, mesh, model, reduce=False)
    trainer.step(0)
    every = copies(model)
    c.check(tag, not torch.equal(every[0], every[-1]), "unsummed copies stayed equal")


def _full_state(model: nn.Module, optim) -> tuple[dict, dict]:
    """Every stage's full model and optimizer state on every rank, under global names (the
    alias's entries under the source's name, checked equal to the source's)."""
    opts = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, optim, options=opts)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (msd, osd))
    m_all: dict = {}
    o_all: dict = {}
    for m, o in every:
        for k, v in m.items():
            m_all.setdefault(k.replace(ALIAS, SOURCE), []).append(v)
        for k, v in o.items():
            o_all.setdefault(k.replace(ALIAS, SOURCE), []).append(v)
    return m_all, o_all


def scenario_reshard(c: Checks, root: str) -> None:
    import generated.llama_pp_tied as layout

    tag = "reshard"
    path = os.path.join(root, "tied-pp2dp2")
    mesh_a = layout.build_mesh(pp=2, tp=1)
    model = split_model(layout, mesh_a)
    trainer = TiedTrainer(layout, mesh_a, model)
    for step in range(2):
        trainer.step(step)
    msd, osd = get_state_dict(model, trainer.optim, options=FLAT)
    layout.save({"model": msd, "optim": osd}, path, mesh=mesh_a)
    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    c.check(tag, f"model.{SOURCE}" in keys, f"no model.{SOURCE} in {sorted(keys)[:6]}")
    c.check(tag, not any(ALIAS in k for k in keys), "the alias was stored")
    c.check(tag, f"optim.state.{SOURCE}.exp_avg" in keys, "no optimizer state for the tie")
    saved_m, saved_o = _full_state(model, trainer.optim)
    for k, vs in [*saved_m.items(), *saved_o.items()]:
        same = all(_equal(v, vs[0]) for v in vs)
        c.check(tag, same, f"saved {k}: the stages' copies differ")
    saved_m = {k: vs[0] for k, vs in saved_m.items()}
    saved_o = {k: vs[0] for k, vs in saved_o.items()}
    full_opts = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    for pp, build in ((1, split_model), (4, megatron_model)):
        mesh_b = layout.build_mesh(pp=pp, tp=1)
        runs = []
        for how in ("load", "torch"):
            model_b = build(layout, mesh_b, seed=7)
            trainer_b = TiedTrainer(layout, mesh_b, model_b)
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
                for k, v in [*got_m.items(), *got_o.items()]:
                    want = {**saved_m, **saved_o}.get(k.replace(ALIAS, SOURCE))
                    c.check(tag, _equal(v, want), f"pp{pp}: loaded {k} differs")
            else:  # torch's own reshard of the same full state, under this stage's names
                nested = StateDictOptions(full_state_dict=True)
                own_m, own_o = get_state_dict(model_b, trainer_b.optim, options=nested)
                for fqn, stats in own_o["state"].items():
                    g = fqn.replace(ALIAS, SOURCE)
                    for name in stats:
                        stats[name] = copy.deepcopy(saved_o[f"state.{g}.{name}"])
                set_state_dict(
                    model_b,
                    trainer_b.optim,
                    model_state_dict={k: saved_m[k.replace(ALIAS, SOURCE)].clone() for k in own_m},
                    optim_state_dict=own_o,
                    options=nested,
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
        every = copies(model_b)
        same = all(torch.equal(v, every[0]) for v in every)
        c.check(tag, same, f"pp{pp}: the tied copies differ after the continued run")


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(full(a), full(b))
    return a == b


def scenario_broadcast(c: Checks) -> None:
    import generated.llama_pp_tied as layout

    tag = "broadcast"
    for pp in (2, 4):
        mesh = layout.build_mesh(pp=pp, tp=1)
        model = megatron_model(layout, mesh, seed=3)
        params = dict(model.named_parameters())
        if ALIAS in params and layout.stage_of(mesh) == pp - 1:
            with torch.no_grad():
                p = params[ALIAS]
                (p.to_local() if hasattr(p, "to_local") else p).add_(1.0)
        before = copies(model)
        c.check(tag, not torch.equal(before[0], before[-1]), f"pp{pp}: nothing perturbed")
        layout.broadcast_tied(model, mesh)
        after = copies(model)
        same = all(torch.equal(v, before[0]) for v in after)
        c.check(tag, same, f"pp{pp}: the copies are not the source's value")


def scenario_errors(c: Checks) -> None:
    import generated.llama_pp_tied as layout
    from shardspec.runtime import SpecError

    tag = "errors"

    def refused(what: str, fn: Callable[[], object], needles: tuple, model: nn.Module) -> None:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            fn()
        except SpecError as e:
            ok = all(n in str(e) for n in needles)
            c.check(tag, ok, f"{what}: message {e!s:.300}")
        else:
            c.check(tag, False, f"{what}: not refused")
        after = model.state_dict()
        same = before.keys() == after.keys() and all(
            type(after[k]) is torch.Tensor and torch.equal(before[k], after[k]) for k in before
        )
        c.check(tag, same, f"{what}: the model changed")

    mesh = layout.build_mesh(pp=2, tp=1)
    untied = llama.tiny4()
    refused(
        "split an untied model",
        lambda: layout.split_stage(untied, mesh),
        ("output.weight is a tensor of its own", "tie them"),
        untied,
    )
    plain = tied()  # no output module: split_stage cannot make the alias's
    refused(
        "split a model without the alias",
        lambda: layout.split_stage(plain, mesh),
        ("no parameter 'output.weight'",),
        plain,
    )
    whole_mesh = layout.build_mesh(pp=1, tp=1)
    untied = llama.tiny4()
    refused(
        "untied at pp 1",
        lambda: layout.parallelize(untied, whole_mesh),
        ("output.weight (a tensor of its own; the spec ties it to tok_embeddings.weight",),
        untied,
    )


def run_all(rank: int, world: int) -> tuple[list[str], dict]:
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, or they thrash
    c = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        dist.broadcast_object_list(root, src=0)
        for name, fn in (
            ("train", lambda: scenario_train(c)),
            ("reshard", lambda: scenario_reshard(c, root[0])),
            ("broadcast", lambda: scenario_broadcast(c)),
            ("errors", lambda: scenario_errors(c)),
        ):
            if os.environ.get("ONLY") and name not in os.environ["ONLY"].split(","):
                continue
            try:
                fn()
            except Exception:
                c.fail.append(f"[{name}] raised:\n{traceback.format_exc()}")
        try:
            dist.barrier()
        except Exception:
            c.fail.append(f"[final barrier] raised:\n{traceback.format_exc()}")
    return c.fail, c.count


__all__ = ["run_all"]
