"""Multi-rank scenarios for ``tests/test_ep_sp.py``: expert parallelism under sequence
parallelism, with ep borrowing the dense view's tp ranks (torchtitan's layout), on 4 gloo
CPU ranks in one spawn. The spec is tests/ep_sp_specs.py's ``moe_sp``: dense (fsdp 2,
tp 2) sequence-parallel, expert (efsdp, ep) with ep innermost.

* Training against a single process (tests/ep_train_scenarios.py's ``compare_training``:
  first-step gradients, AdamW losses and parameters within tests/test_parallel.py's
  tolerances, routing skewed so that experts 2, 6 and 7 get no token): at expert efsdp 2 x
  ep 2 (an EP group is a dense tp group) and at ep 4 (efsdp 1), dense fsdp 2 x tp 2; the
  example MoE and transformers' ``Qwen3MoeForCausalLM`` used as it is (its own
  ``Qwen3MoeSparseMoeBlock`` and ``Qwen3MoeExperts``; ``qwen3_moe_sp``), given positions
  and the causal mask from the tokens (a forward pre-hook: transformers derives them from
  the embedding output's length, which sequence parallelism cuts by tp). Each
  rank's MoE block routes its own half of its data group's sequence: the rows reaching the
  experts module are counted.
* verify of a trainer's own ep-borrows-tp parallelization, built the torchtitan way
  (``tp_plan``'s sequence-parallel styles with ``MoESequenceParallel`` on the MoE blocks,
  ``ExpertParallel`` over ep, ``fully_shard`` of the experts on efsdp, then of the blocks
  and the root on fsdp): accepted; without ``MoESequenceParallel``, or with the experts on
  an ep mesh of the trainer's own that pairs other ranks than the spec's, each mismatch
  named.
* Checkpoints: trained at efsdp 2 x ep 2 under sequence parallelism, saved, loaded bitwise
  into the ep-outermost fold of specs/deepseek_moe_folded.shard and back at ep 4.
* Refusals before the model changes: expert tensor parallelism under sequence
  parallelism, a router cut over tp inside a sequence-parallel MoE block, a caller's style
  on the MoE block.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

from shardspec.runtime.expert_parallel import (
    ExpertParallel,
    ExpertParallelModule,
    MoESequenceParallelModule,
)
from shardspec.runtime.spec import SpecError
from shardspec.testing import Checks
from tests import ep_train_scenarios as ept
from tests.ep_sp_specs import FINAL_NORM, MODEL_ARGS

FOLDS = ({"tp": 2, "ep": 2}, {"tp": 2, "ep": 4})


class _Layout:
    """A generated module whose ``parallelize`` adds :data:`FINAL_NORM` to the styles."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def parallelize(self, model: nn.Module, mesh: Any, **kwargs: Any) -> nn.Module:
        styles = {**FINAL_NORM, **kwargs.pop("styles", {})}
        out: nn.Module = self.module.parallelize(model, mesh, styles=styles, **kwargs)
        return out


def _generated(root: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _Layout(module)


def model() -> nn.Module:
    return ept.example(**MODEL_ARGS)


def check_training(c: Checks, layout: Any) -> None:
    for fold in FOLDS:
        ept.compare_training(c, f"train sp {fold}", model, layout, fold)


def _positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """transformers' model derives positions and the causal mask from the embedding
    output's length, which sequence parallelism cuts by tp: give both from the tokens (a
    4-D additive mask, which transformers takes as it is)."""
    n = args[0].shape[1]
    kwargs.setdefault("position_ids", torch.arange(n)[None])
    low = torch.finfo(torch.float32).min
    kwargs.setdefault("attention_mask", torch.full((1, 1, n, n), low).triu(1))
    kwargs.setdefault("use_cache", False)
    return args, kwargs


def qwen3() -> nn.Module:
    m = ept.qwen3()
    m.register_forward_pre_hook(_positions, with_kwargs=True)
    return m


def check_training_qwen3(c: Checks, root: str) -> None:
    layout = _generated(root, "qwen3_moe_sp").module
    for fold in FOLDS:
        ept.compare_training(c, f"train sp qwen3 {fold}", qwen3, layout, fold)


def check_local_tokens(c: Checks, layout: Any) -> None:
    """Each rank's experts module receives its own slice of its data group's tokens: batch
    / fsdp sequences of (seq - 1) / tp tokens each; the MoE blocks are sequence-parallel."""
    tag = "sp local tokens"
    m = model()
    views = layout.build_mesh(**FOLDS[0])
    layout.parallelize(m, views)
    blocks = [b.moe for b in m.layers.values()]
    c.check(tag, all(isinstance(b, MoESequenceParallelModule) for b in blocks), "blocks")
    rows: list[int] = []
    for b in blocks:
        b.experts.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    _, n = ept.data_group(views)
    tokens = ept.batch(0)
    ept.lm_loss(m, tokens.chunk(n)[0]).backward()
    want = (ept.BATCH // n) * (ept.SEQ - 1) // views["dense"]["tp"].size()
    c.check(tag, rows == [want] * len(blocks), f"rows per experts call {rows}, want {want}")


def by_hand(
    m: nn.Module, views: Any, layout: Any, *, blocks: bool = True, expert: Any = None
) -> None:
    """A trainer's own ep-borrows-tp parallelization, torchtitan's order: the spec's
    tensor- and sequence-parallel plan on the dense tp (``blocks=False``: without the MoE
    blocks' ``MoESequenceParallel``), ``ExpertParallel`` over ``expert``'s ep (default the
    expert view), ``fully_shard`` of the experts on its efsdp, then of the blocks and the
    root on the dense view's fsdp."""
    expert = expert if expert is not None else views["expert"]
    plan = {**layout.tp_plan(views, m), **FINAL_NORM}
    if not blocks:
        plan = {k: v for k, v in plan.items() if not k.endswith(".moe")}
    parallelize_module(m, views["dense"]["tp"], plan)
    for block in m.layers.values():
        parallelize_module(block.moe.experts, expert["ep"], ExpertParallel())
        fully_shard(block.moe.experts, mesh=expert["efsdp"])
    fn = layout.shard_placement_fn(m, views)
    for unit in [*m.layers.values(), m]:
        fully_shard(unit, mesh=views["dense"]["fsdp"], shard_placement_fn=fn)


def check_verify(c: Checks, layout: Any) -> None:
    views = layout.build_mesh(**FOLDS[0])
    m = model()
    by_hand(m, views, layout)
    try:
        layout.verify(m, views)
        c.check("verify sp by hand", True, "")
    except SpecError as e:
        c.check("verify sp by hand", False, f"a matching parallelization refused: {e}")
    # a trainer's own expert mesh with ep outermost: its EP groups pair dense fsdp ranks
    ep_outer = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
    cases = [
        (
            "verify sp no local tokens",
            dict(blocks=False),
            "layers.0.moe: the spec's activations are sequence-parallel",
        ),
        (
            "verify sp ep pairs other ranks",
            dict(expert=ep_outer),
            "layers.0.moe.experts.w1: its DTensor mesh ('efsdp', 'ep') groups other ranks "
            "than view 'expert''s mesh",
        ),
    ]
    for tag, kwargs, want in cases:
        m = model()
        by_hand(m, views, layout, **kwargs)
        try:
            layout.verify(m, views)
            c.check(tag, False, "accepted")
        except SpecError as e:
            c.check(tag, want in str(e), str(e)[:800])


def check_refusals(c: Checks, root: str, layout: Any) -> None:
    etp = _generated(root, "moe_sp_etp")
    router = _generated(root, "moe_sp_router_tp")
    views = layout.build_mesh(**FOLDS[0])
    prepare = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    cases: list[tuple[str, Callable[[nn.Module], Any], str]] = [
        (
            "etp",
            lambda m: etp.parallelize(m, etp.build_mesh(tp=2, ep=2, etp=2)),
            "layers.0.moe.experts: expert tensor parallelism under sequence parallelism is "
            "not applied by parallelize",
        ),
        (
            "router over tp",
            lambda m: router.parallelize(m, router.build_mesh(**FOLDS[0])),
            "layers.0.moe: under sequence parallelism each tp rank routes its own tokens "
            "through this MoE block, so its parameters outside the experts (router, shared "
            "experts) must be whole on every tp rank, with no tensor-parallel style (their "
            "gradients are summed over tp): layers.0.moe.router.weight (cut over tp)",
        ),
        (
            "a style on the block",
            lambda m: layout.parallelize(m, views, styles={"layers.1.moe": prepare}),
            "layers.1.moe: under sequence parallelism each tp rank routes its own tokens",
        ),
    ]
    for what, call, want in cases:
        tag = f"refuse sp {what}"
        m = model()
        before = {k: v.detach().clone() for k, v in m.state_dict().items() if torch.is_tensor(v)}
        try:
            call(m)
            c.check(tag, False, "accepted")
        except SpecError as e:
            c.check(tag, want in str(e), str(e)[:600])
        after = m.state_dict()
        unchanged = all(torch.equal(after[k], v) for k, v in before.items())
        unchanged &= all(type(p) is nn.Parameter for p in m.parameters())
        unchanged &= not any(
            isinstance(x, (ExpertParallelModule, MoESequenceParallelModule)) for x in m.modules()
        )
        c.check(tag, unchanged, "the model changed")


def check_checkpoint(c: Checks, root: str, layout: Any) -> None:
    """save, load accept the ep-borrows-tp fold (issue 21 point 4): trained at efsdp 2 x
    ep 2 under sequence parallelism, saved, then loaded bitwise into the ep-outermost fold
    of specs/deepseek_moe_folded.shard (``moe_folded_nohc``: dense fsdp 2 x tp 2, expert
    ep 2 x efsdp 2) and back into the sequence-parallel spec at ep 4."""
    folded = _generated(root, "moe_folded_nohc").module
    src = model()
    views = layout.build_mesh(tp=2, ep=2)
    layout.parallelize(src, views)
    ept.train(src, torch.optim.SGD(src.parameters(), lr=ept.SGD_LR), range(2), views)
    saved = {k: ept.full(v.detach()).clone() for k, v in src.named_parameters()}
    path = os.path.join(root, "ep-sp-ckpt")
    layout.save({"model": src.state_dict()}, path, mesh=views)
    for tag, dest, fold in (
        ("ckpt sp into ep outermost", folded, ept.FOLD_A),
        ("ckpt sp back at ep 4", layout, {"tp": 2, "ep": 4}),
    ):
        other = ept.example(seed=77, **MODEL_ARGS)
        mesh = dest.build_mesh(**fold)
        dest.parallelize(other, mesh)
        first = next(iter(other.named_parameters()))
        c.check(tag, not torch.equal(ept.full(first[1]), saved[first[0]]), "starts equal")
        dest.load({"model": other.state_dict()}, path, mesh=mesh)
        for k, v in other.named_parameters():
            c.check(tag, torch.equal(ept.full(v.detach()), saved[k]), f"{k}: not bitwise")


def run_all(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every scenario on this rank: failures and the checks made per tag."""
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, or they thrash
    layout = _generated(root, "moe_sp")
    return ept.run_scenarios(
        [
            lambda c: check_refusals(c, root, layout),
            lambda c: check_local_tokens(c, layout),
            lambda c: check_verify(c, layout),
            lambda c: check_training(c, layout),
            lambda c: check_training_qwen3(c, root),
            lambda c: check_checkpoint(c, root, layout),
        ]
    )
