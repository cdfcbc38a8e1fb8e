"""Pipeline-parallel helpers for multi-rank tests (torch.distributed.pipelining, gloo/CPU).

Importable from spawned ranks (``shardspec.testing.run_ranks``): the scenario functions at
the bottom are what tests/test_pipeline_harness.py runs on 2 ranks.

* :func:`make_pipeline` wraps one stage model (``examples.models.llama.stage_model``) in a
  ``PipelineStage`` and a ``ScheduleGPipe`` or ``Schedule1F1B``; :meth:`Pipeline.step` runs
  one training step (forwards, backwards, gradient scaling; no optimizer step) and returns
  the mean microbatch loss on the last stage, ``None`` elsewhere. :func:`run_schedule` is
  both in one call (a fresh stage and schedule for every step).
* Stage-to-stage shapes are static: every stage is given meta example ``input_args`` and
  ``output_args`` of one microbatch (:func:`stage_example_args`). torch 2.13's
  ``PipelineStage`` then skips its runtime metadata inference (STATIC mode: no extra forward
  and backward of the first microbatch, no metadata objects sent between ranks) and checks
  every received activation against those shapes; older releases (2.11) take the same two
  arguments to bypass their runtime shape inference. In 2.13 the example hidden states
  must have ``requires_grad=True``: its static mode derives the gradient buffers from
  them, and a stage whose example output does not require grad receives no gradient
  (its backward then fails with "grad can be implicitly created only for scalar outputs").
  Only arguments that both releases have are used (no ``loss_kwargs``,
  ``return_outputs``, ``input_grads``/``output_grads``).

Gradient scaling (read in torch 2.13's ``schedules.py``/``stage.py``; the older sources
seen do the same through ``stage.scale_grads``): the schedule splits the batch into
``n_microbatches`` equal chunks along dim 0, computes ``loss_fn(logits_i, targets_i)`` per
microbatch on the last stage and runs each microbatch's backward on that loss *unscaled*,
so every stage accumulates ``sum_i grad L_i`` into its own parameters' ``.grad``. After the
last backward, ``perform_reduce_grad(n_microbatches if scale_grads else 1)`` divides each
stage's *own* parameter gradients by ``n_microbatches`` (the activation gradients sent
upstream are never scaled; every stage divides its own). With a mean-reduced loss
(:func:`lm_loss`) and equal microbatches (equal token counts, no ignored targets)
``mean_i L_i`` is the mean loss over the whole batch, so ``scale_grads=True`` (the default,
passed explicitly here) gives the gradients of a single process computing the mean loss
over the whole batch. A sum-reduced loss would need ``scale_grads=False``. AdamW is
invariant to a constant gradient factor except through ``eps``, so parameters after AdamW
steps show a wrong factor only through the smallest gradients: the scenarios compare the
first step's gradients directly too.

Every stage must be given the ``loss_fn``, not only the last: a schedule decides from it
whether it runs backwards at all (``has_backward = loss_fn is not None``, per rank), so a
rank built without one would not take part in the backward (as torchtitan, every rank
passes the same loss function).
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from examples.models import llama
from shardspec.testing import Checks

SCHEDULES = ("gpipe", "1f1b")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits ``[B, T, V]`` against targets ``[B, T]``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def stage_example_args(
    stage_module: llama.Llama, microbatch_shape: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors shaped like one microbatch's input and output of a Llama stage.

    Input: token ids ``[b, T]`` (int64) on the first stage, else hidden states
    ``[b, T, dim]``; output: hidden states on every stage but the last, else logits
    ``[b, T, vocab]`` (the stage's own vocabulary rows). Hidden states have the dtype of the
    stage's parameters and ``requires_grad=True``; logits too.
    """
    b, t = (int(n) for n in microbatch_shape)
    dtype = next(stage_module.parameters()).dtype
    dim = stage_module.config.dim
    # Hidden states require grad: torch 2.13's static metadata records requires_grad, and
    # derives the gradient buffers from it (none for a tensor that does not require grad:
    # the previous stage's backward would then get no output gradient and fail).
    if stage_module.tok_embeddings is not None:
        inp = torch.empty(b, t, dtype=torch.long, device="meta")
    else:
        inp = torch.empty(b, t, dim, dtype=dtype, device="meta", requires_grad=True)
    if stage_module.norm is None:
        out = torch.empty(b, t, dim, dtype=dtype, device="meta", requires_grad=True)
    else:
        head = stage_module.output or stage_module.tok_embeddings  # tied: the embedding
        assert head is not None
        out = torch.empty(
            b, t, head.weight.shape[0], dtype=dtype, device="meta", requires_grad=True
        )
    return inp, out


@dataclass
class Pipeline:
    """One rank's stage and schedule; :meth:`step` runs one training step."""

    schedule: Any
    stage_index: int
    n_stages: int
    batch_shape: tuple[int, int]
    losses: list[torch.Tensor] = field(default_factory=list)

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == self.n_stages - 1

    def step(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Forward and backward of the whole batch, microbatch by microbatch.

        ``inputs`` (token ids ``[B, T]``) is needed on the first stage, ``targets``
        (``[B, T]``) on the last; each is ignored elsewhere. Gradients are accumulated into
        the stage's ``.grad`` already scaled (see the module docstring); the caller zeroes
        them and steps its optimizer. Returns the mean of the microbatch losses (detached)
        on the last stage, ``None`` on the others.
        """
        kwargs: dict[str, Any] = {}
        args: tuple[torch.Tensor, ...] = ()
        if self.first:
            if inputs is None or tuple(inputs.shape) != self.batch_shape:
                raise ValueError(f"the first stage needs inputs of shape {self.batch_shape}")
            args = (inputs,)
        if self.last:
            if targets is None or tuple(targets.shape) != self.batch_shape:
                raise ValueError(f"the last stage needs targets of shape {self.batch_shape}")
            self.losses = []
            kwargs = {"target": targets, "losses": self.losses}
        self.schedule.step(*args, **kwargs)
        if not self.last:
            return None
        return torch.stack([loss.detach() for loss in self.losses]).mean()


def forward_backward(
    model: nn.Module,
    pipe: Pipeline | None,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor | None:
    """Forward and backward of one batch: through ``pipe`` (:meth:`Pipeline.step`) where
    there is one, else through the whole ``model`` with :func:`lm_loss`. The loss
    (detached) on the last stage or the whole model, ``None`` on the other stages."""
    if pipe is not None:
        return pipe.step(inputs, targets)
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    return loss.detach().clone()


def make_pipeline(
    stage_module: nn.Module,
    stage_index: int,
    n_stages: int,
    group: dist.ProcessGroup | None,
    batch_shape: Sequence[int],
    n_microbatches: int,
    schedule: str = "gpipe",
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
    example_args: Callable[[Any, Sequence[int]], tuple[torch.Tensor, torch.Tensor]] = (
        stage_example_args
    ),
) -> Pipeline:
    """Wrap ``stage_module`` (stage ``stage_index`` of ``n_stages``, one stage per rank of
    ``group``) in a ``PipelineStage`` with static shapes and a GPipe or 1F1B schedule.

    ``batch_shape`` is the whole batch's ``(B, T)``; ``B`` must split into
    ``n_microbatches`` equal microbatches (1F1B also needs ``n_microbatches >= n_stages``).
    Every rank passes the same ``loss_fn``. ``example_args(stage_module, (b, T))`` gives
    one microbatch's meta input and output (:func:`stage_example_args`, a Llama stage's,
    by default).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule not in classes:
        raise ValueError(f"schedule {schedule!r} is not one of {sorted(classes)}")
    b, t = (int(n) for n in batch_shape)
    if n_microbatches < 1 or b % n_microbatches:
        raise ValueError(f"batch size {b} does not split into {n_microbatches} equal microbatches")
    device = next(stage_module.parameters()).device
    input_args, output_args = example_args(stage_module, (b // n_microbatches, t))
    stage = PipelineStage(
        stage_module,
        stage_index,
        n_stages,
        device,
        input_args=input_args,
        output_args=output_args,
        group=group,
    )
    sched = classes[schedule](stage, n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return Pipeline(sched, stage_index, n_stages, (b, t))


def run_schedule(
    stage_module: llama.Llama,
    stage_index: int,
    n_stages: int,
    group: dist.ProcessGroup | None,
    inputs: torch.Tensor | None,
    targets: torch.Tensor | None,
    n_microbatches: int,
    schedule: str = "gpipe",
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
) -> torch.Tensor | None:
    """One training step of a fresh stage and schedule (:func:`make_pipeline`, then
    :meth:`Pipeline.step`); returns the mean microbatch loss on the last stage, else None.

    Every rank passes ``inputs`` or ``targets`` (or both): the batch shape, which sets the
    static stage-to-stage shapes, is read from whichever is given. The gradients, left in
    ``.grad``, equal a single process's gradients of the mean loss over the whole batch.
    """
    shaped = inputs if inputs is not None else targets
    if shaped is None:
        raise ValueError("pass inputs or targets (their shape is the batch shape)")
    pipe = make_pipeline(
        stage_module,
        stage_index,
        n_stages,
        group,
        tuple(shaped.shape),
        n_microbatches,
        schedule=schedule,
        loss_fn=loss_fn,
    )
    return pipe.step(inputs, targets)


# --------------------------------------------------------------------------- scenarios

LR = 1e-3
STEPS = 3
BATCH = 8
SEQ = 16
MICROBATCHES = 4


def batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ``(inputs, targets)`` on every rank for step ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference_run(
    model: nn.Module,
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process AdamW training on the full batches: per-step losses, the first
    step's gradients and the final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        inputs, targets = batch(step, model.config.vocab_size)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def global_name(name: str, layers: Sequence[int], *, renumber: bool, tied: bool) -> str:
    """The full model's name of stage parameter ``name`` (a tied output is the embedding)."""
    if tied and name == "output.weight":
        return "tok_embeddings.weight"
    if renumber and name.startswith("layers."):
        _, k, rest = name.split(".", 2)
        return f"layers.{layers[int(k)]}.{rest}"
    return name


def train_case(
    c: Checks,
    rank: int,
    world: int,
    *,
    schedule: str,
    renumber: bool,
    tied: bool,
    reuse: bool,
) -> None:
    """Train a 4-layer tiny Llama cut into ``world`` stages for STEPS AdamW steps and check
    losses, first-step gradients and final parameters against a single process."""
    tag = f"{schedule} renumber={renumber} tied={tied} reuse={reuse}"
    naming = {"renumber": renumber, "tied": tied}
    full = llama.tiny_tied(n_layers=4) if tied else llama.tiny4()
    llama.init_weights(full, seed=0)
    ref_losses, ref_grads, ref_params = reference_run(copy.deepcopy(full))

    first, last = rank == 0, rank == world - 1
    layers = llama.stage_layers(full.config.n_layers, world, rank)
    stage = llama.stage_model(
        copy.deepcopy(full), layers, first=first, last=last, renumber=renumber
    )
    expected = {n for n in ref_params if _on_stage(n, layers, first=first, last=last, tied=tied)}
    names = {global_name(n, layers, **naming) for n, _ in stage.named_parameters()}
    c.check(tag, names == expected, f"rank {rank}: stage holds {sorted(names ^ expected)} wrongly")

    group = dist.group.WORLD
    # The tied copies live on the first and the last rank only: their own group (every
    # rank takes part in creating it), so the stages between never join the all-reduce.
    tie_group = dist.new_group([0, world - 1]) if tied else None
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    pipe = None
    vocab = full.config.vocab_size
    for step in range(STEPS):
        inputs, targets = batch(step, vocab)
        if reuse:
            if pipe is None:
                pipe = make_pipeline(
                    stage, rank, world, group, inputs.shape, MICROBATCHES, schedule=schedule
                )
            loss = pipe.step(inputs, targets)
        else:
            loss = run_schedule(
                stage, rank, world, group, inputs, targets, MICROBATCHES, schedule=schedule
            )
        if tied and (first or last):
            # Megatron's shared embedding: the first stage's embedding and the last stage's
            # output copy receive the sum of both gradients, so the copies stay equal.
            holder = stage.tok_embeddings if first else stage.output
            dist.all_reduce(holder.weight.grad, group=tie_group)  # type: ignore[union-attr]
        if last:
            ok = loss is not None and abs(loss.item() - ref_losses[step]) <= 1e-5 * abs(
                ref_losses[step]
            )
            c.check(tag, ok, f"step {step}: loss {loss} vs reference {ref_losses[step]}")
        else:
            c.check(tag, loss is None, f"rank {rank}: a non-last stage returned loss {loss}")
        if step == 0:
            for name, p in stage.named_parameters():
                want = ref_grads[global_name(name, layers, **naming)]
                got = p.grad
                if got is None:
                    c.check(tag, False, f"{name}: no gradient")
                    continue
                delta = (got - want).abs().max().item()
                scale = want.abs().max().item()
                c.check(tag, delta <= 1e-5 * scale + 1e-9, f"{name}: grad delta {delta} ({scale})")
        opt.step()
        opt.zero_grad()
    if tie_group is not None and (first or last):
        dist.destroy_process_group(tie_group)
    for name, p in stage.named_parameters():
        delta = (p.detach() - ref_params[global_name(name, layers, **naming)]).abs().max().item()
        c.check(tag, delta <= 1e-5, f"rank {rank} {name}: parameter delta {delta}")


def _on_stage(fqn: str, layers: Sequence[int], *, first: bool, last: bool, tied: bool) -> bool:
    """Whether the full model's parameter ``fqn`` is held by the stage."""
    if fqn.startswith("layers."):
        return int(fqn.split(".")[1]) in layers
    if fqn == "tok_embeddings.weight":
        return first or (last and tied)  # the tied last stage holds a copy
    return last  # norm, output


CASES = (
    {"schedule": "gpipe", "renumber": False, "tied": False, "reuse": True},
    {"schedule": "gpipe", "renumber": True, "tied": False, "reuse": False},
    {"schedule": "1f1b", "renumber": False, "tied": False, "reuse": False},
    {"schedule": "1f1b", "renumber": True, "tied": False, "reuse": True},
    {"schedule": "gpipe", "renumber": False, "tied": True, "reuse": True},
    {"schedule": "1f1b", "renumber": True, "tied": True, "reuse": False},
)


def run_all(rank: int, world: int) -> tuple[list[str], dict[str, int]]:
    """Every training case on this rank; returns (failures, checks made per case)."""
    # One intra-op thread per rank: with torch's default (one per core) two ranks on a
    # 2-core machine oversubscribe it, and a pipeline step then takes seconds, not 40 ms.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    c = Checks()
    for case in CASES:
        try:
            train_case(c, rank, world, **case)
        except Exception:
            c.fail.append(f"[{case}] raised:\n{traceback.format_exc()}")
            break  # the other ranks may be waiting on this one: stop here
    try:
        dist.barrier()
    except Exception:  # keep the failures above: they say why a peer is missing
        c.fail.append(f"[barrier] raised:\n{traceback.format_exc()}")
    return c.fail, c.count


__all__ = [
    "CASES",
    "Pipeline",
    "forward_backward",
    "lm_loss",
    "make_pipeline",
    "run_all",
    "run_schedule",
    "stage_example_args",
]
