"""Multi-rank scenarios for ``tests/test_views_pp_train.py``: training through a pipeline
fold of a spec with views (issue 21 point 5's "with pp 2 ... and continue training"), on
4 gloo CPU ranks in one spawn.

specs/deepseek_moe_pp_folded.shard is the example MoE (examples/models/moe.py, its routing
skewed as tests/ep_train_scenarios.py skews it: experts 2, 6 and 7 get no token) with a
dense view (pp, fsdp, tp) and an expert view (pp, ep, efsdp) sharing the pipeline axis. On
4 ranks each of the 2 stages has 2 ranks, folded two ways:

* :data:`PP_EP`: dense (pp 2, fsdp 2, tp 1) x expert (pp 2, ep 2, efsdp 1): the two ranks
  of a stage hold different tokens and exchange them with the all-to-all dispatch;
* :data:`PP_TP`: dense (pp 2, fsdp 1, tp 2) x expert (pp 2, ep 1, efsdp 2): attention
  tensor-parallel within a stage, the experts FSDP2-sharded over efsdp.

Scenarios:

* ``train``: on every rank ``split_stage``, ``parallelize(stage, views)``, ``verify``; then
  AdamW steps through torch.distributed.pipelining (GPipe at PP_EP, 1F1B at PP_TP; 2
  microbatches), against one process training the whole model on the same global batches:
  first-step gradients, the loss of every step and the parameters after the last within
  tests/ep_train_scenarios.py's tolerances (those of tests/test_parallel.py).
* ``ckpt pp 2 -> ...``: trained 2 steps at PP_EP and saved (model and AdamW state,
  flattened); loaded at pp 1 into specs/deepseek_moe_folded.shard's fold dense (fsdp 2,
  tp 2) x expert (ep 2, efsdp 2), and again at pp 2 at PP_EP. Each load equals the saved
  state bitwise (every parameter and every optimizer tensor, gathered whole); training goes
  on 2 steps. At pp 1 the losses and parameters follow the single process trained straight
  through, within tolerance (the sums are taken in another order: tensor parallelism's
  partial sums, no microbatches); at PP_EP the continued run equals bitwise the pipelined
  run that never stopped (the same ranks doing the same arithmetic).
* ``ckpt pp 1 -> pp 2``: trained 2 steps at pp 1 on that fold, saved, loaded into the stage
  models at PP_TP (bitwise), trained on 2 steps through the pipeline: within tolerance of
  the single process.

Scenarios record failures (:class:`shardspec.testing.Checks`) rather than raise, so one
rank's failed check never leaves the others waiting in a collective.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from shardspec.runtime.expert_parallel import ExpertParallelModule
from shardspec.testing import Checks
from tests import ep_train_scenarios as ets
from tests.pipeline_harness import Pipeline, forward_backward, lm_loss, make_pipeline
from tests.pipeline_scenarios import _full_state

PIPELINED = "generated.deepseek_moe_pp_folded"
FOLDED = "generated.deepseek_moe_folded"
PP_EP = {"pp": 2, "tp": 1, "ep": 2}  # per stage: dense fsdp 2; expert ep 2 x efsdp 1
PP_TP = {"pp": 2, "tp": 2, "ep": 1}  # per stage: dense tp 2; expert ep 1 x efsdp 2
FOLD_A = ets.FOLD_A  # pp 1: dense fsdp 2 x tp 2; expert ep 2 x efsdp 2
MICROBATCHES = 2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
WHOLE = StateDictOptions(full_state_dict=True)


def moe_example_args(
    stage: nn.Module, microbatch_shape: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors shaped like one microbatch's input and output of an example-MoE stage:
    token ids ``[b, T]`` into the first stage, else hidden states ``[b, T, dim]``; hidden
    states out of every stage but the last, logits ``[b, T, vocab]`` out of the last
    (hidden states and logits require grad: torch's static stage metadata derives the
    gradient buffers from it)."""
    b, t = (int(n) for n in microbatch_shape)
    cfg = stage.config
    dtype = next(stage.parameters()).dtype

    def hidden(width: int) -> torch.Tensor:
        return torch.empty(b, t, width, dtype=dtype, device="meta", requires_grad=True)

    first = stage.embed is not None
    inp = torch.empty(b, t, dtype=torch.long, device="meta") if first else hidden(cfg.dim)
    out = hidden(cfg.dim) if stage.norm is None else hidden(cfg.vocab_size)
    return inp, out


class Run:
    """One rank's model (a stage at pp > 1, else the whole model), parallelized by
    ``layout`` at ``fold``, with AdamW and, at pp > 1, a pipeline schedule."""

    def __init__(self, layout: Any, fold: dict[str, int], seed: int = 0, schedule: str = "gpipe"):
        self.layout = layout
        self.views = layout.build_mesh(**fold)
        self.model = ets.example(seed)
        self.pp = fold.get("pp", 1)
        if self.pp > 1:
            layout.split_stage(self.model, self.views)
        layout.parallelize(self.model, self.views)
        layout.verify(self.model, self.views)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=ets.LR)
        fsdp = self.views["dense"]["fsdp"]
        self.dp, self.dp_size = fsdp.get_local_rank(), fsdp.size()
        self.dp_group = fsdp.get_group()
        self.pipe: Pipeline | None = None
        self.grads: dict[str, torch.Tensor] = {}
        self.stage = 0
        if self.pp > 1:
            self.stage = layout.stage_of(self.views)
            self.pipe = make_pipeline(
                self.model,
                self.stage,
                self.pp,
                layout.pipeline_group(self.views),
                (ets.BATCH // self.dp_size, ets.SEQ - 1),
                MICROBATCHES,
                schedule=schedule,
                example_args=moe_example_args,
            )

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def step(self, step: int, keep_grads: bool = False) -> float | None:
        """One AdamW step on this rank's data group's part of global batch ``step``; the
        global mean loss on the last stage (None elsewhere). With ``keep_grads`` the
        gradients, gathered whole, are kept in ``self.grads`` before the optimizer step."""
        tokens = ets.batch(step).chunk(self.dp_size)[self.dp]
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        self.optim.zero_grad()
        value = forward_backward(self.model, self.pipe, inputs, targets)
        self.grads = (
            {n: ets.full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None}
            if keep_grads
            else {}
        )
        self.optim.step()
        if value is None:
            return None
        dist.all_reduce(value, group=self.dp_group)
        return float(value / self.dp_size)

    def train(self, steps: range) -> list[float]:
        """Steps ``steps``; the losses on the last stage (empty elsewhere)."""
        losses = [self.step(s) for s in steps]
        return [x for x in losses if x is not None]

    def whole_params(self) -> dict[str, torch.Tensor]:
        return {n: ets.full(p.detach()).clone() for n, p in self.model.named_parameters()}


def reference(
    steps: int,
) -> tuple[nn.Module, list[float], dict[str, torch.Tensor], ets.Routed]:
    """One process training the whole model on the global batches: the model after
    ``steps`` AdamW steps, the losses, the first step's gradients, and the tokens each
    expert received."""
    ref = ets.example()
    routed = ets.Routed(ref)
    optim = torch.optim.AdamW(ref.parameters(), lr=ets.LR)
    losses, grads = [], {}
    for step in range(steps):
        optim.zero_grad()
        tokens = ets.batch(step)
        loss = lm_loss(ref(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        optim.step()
        losses.append(loss.item())
    return ref, losses, grads, routed


def check_losses(c: Checks, tag: str, run: Run, got: list[float], want: list[float]) -> None:
    if run.last:
        ets.close_losses(c, tag, got, want)
    else:
        c.check(tag, got == [], f"stage {run.stage} returned losses {got}")


# ----------------------------------------------------------------------------- training


def check_training(c: Checks) -> None:
    layout = importlib.import_module(PIPELINED)
    ref, ref_losses, ref_grads, routed = reference(ets.STEPS)
    ets.check_skew(c, "train skew", routed)
    for fold, schedule in ((PP_EP, "gpipe"), (PP_TP, "1f1b")):
        tag = f"train {schedule} {fold}"
        run = Run(layout, fold, schedule=schedule)
        names = sorted(n for n, _ in run.model.named_parameters())
        c.check(tag, names == sorted(layout.stage_params(run.views)), f"stage holds {names}")
        ep = [m for m in ets.experts_of(run.model) if isinstance(m, ExpertParallelModule)]
        c.check(tag, len(ep) == 1, f"{len(ep)} expert-parallel modules on the stage, not 1")
        losses = [run.step(0, keep_grads=True)]
        for name, got in run.grads.items():
            want = ref_grads[name]
            delta = (got - want).abs().max().item()
            scale = want.abs().max().item()
            c.check(tag, delta <= 1e-5 * scale + 1e-9, f"{name}: grad delta {delta} ({scale})")
        c.check(tag, len(run.grads) == len(names), f"gradients of {sorted(run.grads)}")
        losses += [run.step(s) for s in range(1, ets.STEPS)]
        check_losses(c, tag, run, [x for x in losses if x is not None], ref_losses)
        ets.close_params(c, tag, run.model, ref, ets.STEPS)


# ----------------------------------------------------------------------------- checkpoints


def save(run: Run, path: str) -> tuple[dict, dict]:
    """Save ``run``'s model and AdamW state (flattened: the stages' param_groups differ);
    return the whole state, every stage's, on every rank."""
    msd, osd = get_state_dict(run.model, run.optim, options=FLAT)
    run.layout.save({"model": msd, "optim": osd}, path, mesh=run.views)
    return _full_state(run.model, run.optim)


def load(c: Checks, tag: str, run: Run, path: str, saved: tuple[dict, dict]) -> None:
    """Load ``path`` into ``run`` (model and optimizer) and check every tensor it holds
    against the saved state, bitwise."""
    msd, osd = get_state_dict(run.model, run.optim, options=FLAT)
    state = {"model": msd, "optim": osd}
    run.layout.load(state, path, mesh=run.views)
    set_state_dict(
        run.model,
        run.optim,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=FLAT,
    )
    saved_m, saved_o = saved
    got_m, got_o = get_state_dict(run.model, run.optim, options=WHOLE)
    got_m = {k: v for k, v in got_m.items() if torch.is_tensor(v)}  # not the _extra_state
    params = {n for n, _ in run.model.named_parameters()}
    c.check(tag, set(got_m) == set(got_o["state"]) == params, "not every parameter loaded")
    for k, v in got_m.items():
        c.check(tag, torch.equal(v, saved_m[k]), f"loaded {k} differs")
    for k, st in got_o["state"].items():
        for name, v in st.items():
            same = torch.equal(ets.full(v), ets.full(saved_o["state"][k][name]))
            c.check(tag, same, f"loaded {k}.{name} differs")


def check_checkpoints(c: Checks, root: str) -> None:
    pipelined = importlib.import_module(PIPELINED)
    folded = importlib.import_module(FOLDED)
    ref, ref_losses, _, _ = reference(4)

    # pp 2 -> pp 1, and -> pp 2 again (against the run that never stopped)
    tag = "ckpt pp 2 saved"
    a = Run(pipelined, PP_EP)
    check_losses(c, tag, a, a.train(range(2)), ref_losses[:2])
    path = os.path.join(root, "pp2")
    saved = save(a, path)
    straight = a.train(range(2, 4))
    straight_params = a.whole_params()
    del a

    tag = "ckpt pp 2 -> pp 1"
    b = Run(folded, FOLD_A, seed=77)
    load(c, tag, b, path, saved)
    ets.close_losses(c, tag, b.train(range(2, 4)), ref_losses[2:])
    ets.close_params(c, tag, b.model, ref, 4)
    del b

    tag = "ckpt pp 2 -> pp 2"
    b = Run(pipelined, PP_EP, seed=77)
    load(c, tag, b, path, saved)
    c.check(tag, b.train(range(2, 4)) == straight, "continued losses differ from the run's")
    for k, v in b.whole_params().items():
        c.check(tag, torch.equal(v, straight_params[k]), f"{k} differs from the run's")
    del b

    # pp 1 -> pp 2
    tag = "ckpt pp 1 saved"
    a = Run(folded, FOLD_A)
    ets.close_losses(c, tag, a.train(range(2)), ref_losses[:2])
    path = os.path.join(root, "pp1")
    saved = save(a, path)
    del a
    tag = "ckpt pp 1 -> pp 2"
    b = Run(pipelined, PP_TP, seed=77, schedule="1f1b")
    load(c, tag, b, path, saved)
    check_losses(c, tag, b, b.train(range(2, 4)), ref_losses[2:])
    ets.close_params(c, tag, b.model, ref, 4)


def run_all(rank: int, world: int) -> dict[str, Any]:
    """Every scenario on this rank: failures and the checks made per tag."""
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, or they thrash
    checks = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        dist.broadcast_object_list(root, src=0)
        for scenario in (
            lambda: check_training(checks),
            lambda: check_checkpoints(checks, root[0]),
        ):
            try:
                scenario()
            except Exception:
                checks.check("exception", False, traceback.format_exc())
                break
        dist.barrier()
    return {"fail": checks.fail, "count": checks.count}
