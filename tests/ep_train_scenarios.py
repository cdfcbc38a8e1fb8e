"""Multi-rank scenarios for ``tests/test_ep_train.py``: ``parallelize`` and ``verify`` on
a spec with views (a dense and an expert view of one world), trained with all-to-all token
dispatch on 4 gloo CPU ranks against a single process, in one spawn.

* Training: the example MoE (examples/models/moe.py, specs/deepseek_moe_folded.shard) and
  transformers' ``Qwen3MoeForCausalLM`` used as it is (specs/qwen3_moe_folded.shard; its
  ``Qwen3MoeExperts`` takes the expert-parallel style unchanged), at expert ep 4 (dense
  fsdp 4) and at ep 2 x efsdp 2 with dense tp 2 x fsdp 2: first-step gradients, losses at
  every AdamW step and the parameters after them within tests/test_parallel.py's
  tolerances. The routing is skewed: feature 0 of the residual stream is held at 3 (the
  embedding's column 0 is 3, attention's and the experts' output row 0 are 0) and the
  router's rows of experts 2, 6 and 7 are -20 there, so those experts get no token (on
  ep 4, rank 3 receives nothing); the single process records that it is so at every step.
* Checkpoints across folds, training: the example MoE with 4 kv heads (its attention
  splits over tp 4) trained at dense (fsdp 2, tp 2) x expert (ep 2, efsdp 2), saved,
  loaded into freshly parallelized models at expert ep 4 (dense fsdp 4), at dense tp 4
  (fsdp 1) x expert ep 1 (efsdp 4) and into the single-view spec
  (specs/deepseek_moe.shard), bitwise, and trained on; the
  losses and parameters follow a single process that trained straight through (SGD: the
  optimizer has no state a checkpoint of the model would have to carry).
* load_hf into a parallelized folded model: every parameter equals transformers' own.
* verify of a trainer's own folded parallelization (torchtitan's order: TP on the dense
  view, the expert-parallel style over ep, ``fully_shard`` of the experts on efsdp, then
  of the blocks on the dense fsdp): accepted; with experts on the wrong axis, dense FSDP2
  on the expert view's mesh, or experts placed without a token dispatch, each mismatch
  named.
* Refusals: parallelize refuses before the model changes.

Scenarios record failures (:class:`shardspec.testing.Checks`) rather than raise, so one
rank's failed check never leaves the others waiting in a collective.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    parallelize_module,
)

from examples.models import moe
from shardspec.runtime.expert_parallel import ExpertParallel, ExpertParallelModule
from shardspec.runtime.spec import SpecError
from shardspec.testing import Checks

FOLDED = "generated.deepseek_moe_folded"
SINGLE = "generated.deepseek_moe"
QWEN3 = "generated.qwen3_moe_folded"
FOLD_A = {"tp": 2, "ep": 2}  # dense fsdp 2 x tp 2; expert ep 2 x efsdp 2
FOLD_EP4 = {"tp": 1, "ep": 4}  # dense fsdp 4; expert ep 4 x efsdp 1
FOLD_TP4 = {"tp": 4, "ep": 1}  # dense fsdp 1 x tp 4; expert ep 1 x efsdp 4
# The checkpoint scenario's model: 4 kv heads, so that attention's heads split over tp 4
# (specs compiled by test_ep_train against its own manifest: moe_folded_kv4, moe_kv4).
KV4_ARGS = {"n_kv_heads": 4}
SUPPRESSED = (2, 6, 7)  # experts that no token picks
VOCAB, BATCH, SEQ = 256, 4, 17
# Two AdamW steps: the second reads the moments the first wrote (a third showed nothing
# more and cost a third of every training scenario).
LR, STEPS, SGD_LR = 1e-3, 2, 0.5


# ----------------------------------------------------------------------------- models


def _skew(
    embed: torch.Tensor,
    outputs: list[torch.Tensor],
    expert_outputs: list[torch.Tensor],
    routers: list[torch.Tensor],
) -> None:
    """Hold feature 0 of the residual stream at 3 and keep SUPPRESSED's router rows at -20
    there: those experts get no token."""
    with torch.no_grad():
        embed[:, 0] = 3.0
        for w in outputs:
            w[0, :] = 0.0
        for w in expert_outputs:
            w[:, 0, :] = 0.0
        for w in routers:
            w[:, 0] = 0.0
            w[list(SUPPRESSED), 0] = -20.0


def example(seed: int = 0, **config: Any) -> nn.Module:
    model = moe.tiny(**config)
    moe.init_weights(model, seed)
    blocks = list(model.layers.values())
    _skew(
        model.embed.weight,
        [b.attn.wo.weight for b in blocks],
        [b.moe.experts.w2 for b in blocks],
        [b.moe.router.weight for b in blocks],
    )
    return model


def qwen3_model() -> nn.Module:
    """transformers' Qwen3MoeForCausalLM of the example MoE's sizes (8 experts, top 2; the
    factory of specs/qwen3_moe_folded.manifest.json)."""
    from transformers import Qwen3MoeForCausalLM

    from examples.models import hf as hfm

    return Qwen3MoeForCausalLM(hfm.qwen3_moe_config(moe.MoEConfig(hc_mult=0)))


def qwen3(seed: int = 0) -> nn.Module:
    model = qwen3_model()
    moe.init_weights(model, seed)
    layers = list(model.model.layers)
    _skew(
        model.model.embed_tokens.weight,
        [b.self_attn.o_proj.weight for b in layers],
        [b.mlp.experts.down_proj for b in layers],
        [b.mlp.gate.weight for b in layers],
    )
    return model


def experts_of(model: nn.Module) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith(".experts")]


class Routed:
    """Counts the tokens routed to each expert (forward pre-hooks on the experts modules
    of a single-process model)."""

    def __init__(self, model: nn.Module) -> None:
        self.counts = torch.zeros(8, dtype=torch.int64)
        for m in experts_of(model):
            m.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple) -> None:
        self.counts += torch.bincount(args[1].reshape(-1).cpu(), minlength=8)[:8]


# ----------------------------------------------------------------------------- training


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def data_group(mesh: Any) -> tuple[int, int]:
    """(this rank's data-parallel group, how many): the dense view's fsdp coordinate (the
    tp ranks hold the same tokens), or the single view's dp_shard one."""
    dense = mesh["dense"] if "dense" in getattr(mesh, "keys", lambda: ())() else mesh
    axis = "fsdp" if "fsdp" in (dense.mesh_dim_names or ()) else "dp_shard"
    return dense[axis].get_local_rank(), dense[axis].size()


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range, mesh: Any) -> list[float]:
    """Optimizer steps on this rank's part of each global batch; the global mean loss."""
    losses = []
    for step in steps:
        optim.zero_grad()
        tokens = batch(step)
        if mesh is not None:
            g, n = data_group(mesh)
            tokens = tokens.chunk(n)[g]
        loss = lm_loss(model, tokens)
        loss.backward()
        optim.step()
        value = loss.detach().clone()
        if mesh is not None:  # every rank's tokens count as often: the mean of the ranks'
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    return losses


def close_params(c: Checks, tag: str, model: nn.Module, ref: nn.Module, steps: int) -> None:
    """tests/parallel_scenarios.py's bound: within 1e-6 on average, and at most the 2 lr
    per step an Adam step of opposite sign gives an element whose gradient is near 0. A
    tensor of a few elements (the hyper-connection head's base [2] and scale [1]) has no
    average to speak of: there each element within 1e-5 (a 300th of the steps taken; its
    gradient sums terms that cancel, and TP's reduction order moves it by ~1e-3 relative)."""
    ref_params = dict(ref.named_parameters())
    for fqn, p in model.named_parameters():
        d = (full(p.detach()) - ref_params[fqn].detach()).abs()
        worst, mean = d.max().item(), d.mean().item()
        ok = (mean <= 1e-6 or (d.numel() < 8 and worst <= 1e-5)) and worst <= 2 * LR * steps
        c.check(tag, ok, f"{fqn}: after {steps} steps max delta {worst}, mean {mean}")


def close_losses(c: Checks, tag: str, got: list[float], want: list[float]) -> None:
    c.check(tag, len(got) == len(want), f"{len(got)} losses, {len(want)} expected")
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        c.check(tag, abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"step {i}: loss {a} vs {b}")


def check_skew(c: Checks, tag: str, routed: Routed) -> None:
    counts = routed.counts.tolist()
    ok = all(counts[e] == 0 for e in SUPPRESSED) and all(
        counts[e] > 0 for e in range(8) if e not in SUPPRESSED
    )
    c.check(tag, ok, f"routing not skewed as meant: tokens per expert {counts}")


def compare_training(
    c: Checks, tag: str, build: Callable[[], nn.Module], layout: Any, fold: dict[str, int]
) -> None:
    """``parallelize`` at ``fold`` against a single process on the same global batches."""
    ref = build()
    routed = Routed(ref)
    model = build()
    mesh = layout.build_mesh(**fold)
    layout.parallelize(model, mesh)
    layout.verify(model, mesh)
    ep = [m for m in experts_of(model) if isinstance(m, ExpertParallelModule)]
    c.check(tag, len(ep) == len(experts_of(model)) > 0, "experts not expert-parallel")
    etp = fold.get("etp", 1)
    c.check(tag, all(m._ep_mesh.ndim == (2 if etp > 1 else 1) for m in ep), "etp not applied")
    tokens = batch(0)
    g, n = data_group(mesh)
    lm_loss(ref, tokens).backward()
    lm_loss(model, tokens.chunk(n)[g]).backward()
    ref_params = dict(ref.named_parameters())
    for fqn, p in model.named_parameters():
        want = ref_params[fqn].grad
        assert want is not None and p.grad is not None, fqn
        delta = (full(p.grad) - want).abs().max().item()
        scale = want.abs().max().item()
        c.check(tag, delta <= 1e-5 * scale + 1e-9, f"{fqn}: grad delta {delta} (max {scale})")
    ref.zero_grad()
    model.zero_grad()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=LR), range(STEPS), None)
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=LR), range(STEPS), mesh)
    close_losses(c, tag, losses, ref_losses)
    close_params(c, tag, model, ref, STEPS)
    check_skew(c, tag, routed)


def check_training(c: Checks, root: str) -> None:
    check_training_example(c)
    check_training_qwen3(c)
    # expert tensor parallelism: dense fsdp 2 x tp 2, expert ep 2 x etp 2 (efsdp 1)
    etp = _generated(root, "moe_folded_etp")
    compare_training(c, "train example etp", example, etp, {"tp": 2, "ep": 2, "etp": 2})


def check_training_example(c: Checks) -> None:
    folded = importlib.import_module(FOLDED)
    for fold in (FOLD_EP4, FOLD_A):
        compare_training(c, f"train example {fold}", example, folded, fold)


def check_training_qwen3(c: Checks) -> None:
    qwen = importlib.import_module(QWEN3)
    for fold in (FOLD_EP4, FOLD_A):
        compare_training(c, f"train qwen3 {fold}", qwen3, qwen, fold)


# ----------------------------------------------------------------------------- checkpoints


def check_checkpoint_folds(c: Checks, root: str) -> None:
    """The example MoE with 4 kv heads: train at fold A, save, load at ep 4, at dense tp 4
    (expert ep 1 x efsdp 4) and into the single-view spec, train on."""
    folded = _generated(root, "moe_folded_kv4")
    single = _generated(root, "moe_kv4")
    ref = example(**KV4_ARGS)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=SGD_LR)
    ref_losses = train(ref, ref_optim, range(4), None)

    model = example(**KV4_ARGS)
    views = folded.build_mesh(**FOLD_A)
    folded.parallelize(model, views)
    first = train(model, torch.optim.SGD(model.parameters(), lr=SGD_LR), range(2), views)
    close_losses(c, "ckpt fold a", first, ref_losses[:2])
    saved = {k: full(v.detach()).clone() for k, v in model.named_parameters()}
    path = os.path.join(root, "fold-a")
    folded.save({"model": model.state_dict()}, path, mesh=views)

    for tag, layout, fold in (
        ("ckpt at ep 4", folded, FOLD_EP4),
        ("ckpt at tp 4", folded, FOLD_TP4),
        ("ckpt at the single view", single, {"ep": 2}),
    ):
        other = example(seed=77, **KV4_ARGS)
        mesh = layout.build_mesh(**fold)
        layout.parallelize(other, mesh)
        layout.verify(other, mesh)
        starts = next(iter(other.named_parameters()))
        c.check(tag, not torch.equal(full(starts[1]), saved[starts[0]]), "starts equal")
        layout.load({"model": other.state_dict()}, path, mesh=mesh)
        for k, v in other.named_parameters():
            c.check(tag, torch.equal(full(v.detach()), saved[k]), f"{k}: loaded not bitwise")
        rest = train(other, torch.optim.SGD(other.parameters(), lr=SGD_LR), range(2, 4), mesh)
        close_losses(c, tag, rest, ref_losses[2:])
        close_params(c, tag, other, ref, 4)


def check_load_hf(c: Checks, root: str, hf_dir: str) -> None:
    """load_hf into a parallelized folded model: every mapped parameter is transformers'
    own tensor (stacked by hand); export_hf from it writes transformers' files again."""
    from examples.models import hf as hfm
    from tests.hf_scenarios import hf_state

    folded = importlib.import_module(FOLDED)
    owner = {k: v.float() for k, v in hfm.moe_from_hf(hf_state(hf_dir), moe.MoEConfig()).items()}
    for fold in (FOLD_A, FOLD_EP4):
        tag = f"load_hf parallelized {fold}"
        model = example(seed=77)
        views = folded.build_mesh(**fold)
        folded.parallelize(model, views)
        folded.load_hf(model, hf_dir, mesh=views)
        for fqn, p in model.named_parameters():
            if not fqn.startswith("hc_head."):
                c.check(tag, torch.equal(full(p.detach()), owner[fqn]), f"{fqn}: not the owner's")
        # export_hf from the parallelized model: transformers' own tensors again, bitwise
        out = os.path.join(root, f"export-{fold['ep']}")
        folded.export_hf(model, out, mesh=views)
        dist.barrier()
        got, want = hf_state(out), hf_state(hf_dir)
        tag = f"export_hf parallelized {fold}"
        c.check(tag, set(got) == set(want), f"keys differ: {sorted(set(got) ^ set(want))[:4]}")
        for key in sorted(set(got) & set(want)):
            c.check(tag, torch.equal(got[key], want[key]), f"{key} differs from the original")


# ----------------------------------------------------------------------------- verify


class OwnExpertParallel(ParallelStyle):
    """A trainer's own expert-parallel style, torchtitan's way: ``distribute_module`` with
    the experts as Shard(0) and input/output hooks (here they only mark the place where
    torchtitan's dispatch and combine run; verify checks layouts and that hooks exist)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: Any) -> None:
            for leaf, p in list(mod.named_parameters(recurse=False)):
                d = distribute_tensor(p.detach(), mesh, [Shard(0)])
                mod.register_parameter(leaf, nn.Parameter(d))

        return distribute_module(
            module,
            device_mesh,
            partition,
            input_fn=lambda mod, inputs, mesh: inputs,
            output_fn=lambda mod, outputs, mesh: outputs,
        )


def by_hand(
    model: nn.Module,
    views: Any,
    folded: Any,
    *,
    ep_axis: str = "ep",
    dense_fsdp: tuple[str, str] = ("dense", "fsdp"),
    dispatch: bool = True,
    style: ParallelStyle | None = None,
) -> nn.Module:
    """A trainer's own folded parallelization, torchtitan's order: TP on the dense view,
    expert parallelism on ``views["expert"][ep_axis]`` (``dispatch=False``: the experts
    placed Shard(0) with no token dispatch), ``fully_shard`` of the experts on efsdp, of the
    blocks and the root on ``views[dense_fsdp]``."""
    tp = views["dense"]["tp"]
    parallelize_module(model, tp, folded.tp_plan(views, model))
    for block in model.layers.values():
        experts = block.moe.experts
        ep = views["expert"][ep_axis]
        if dispatch:
            parallelize_module(experts, ep, style or ExpertParallel())
        else:
            for leaf, p in list(experts.named_parameters()):
                d = distribute_tensor(p.detach(), ep, [Shard(0)])
                experts.register_parameter(leaf, nn.Parameter(d))
        other = "ep" if ep_axis == "efsdp" else "efsdp"
        fully_shard(experts, mesh=views["expert"][other])
    fn = folded.shard_placement_fn(model, views)
    ignored = folded.fsdp_ignored(model, views)
    for block in [*model.layers.values(), model]:
        fully_shard(
            block,
            mesh=views[dense_fsdp[0]][dense_fsdp[1]],
            shard_placement_fn=fn,
            ignored_params=ignored or None,
        )
    return model


def check_verify(c: Checks) -> None:
    folded = importlib.import_module(FOLDED)
    views = folded.build_mesh(**FOLD_A)
    tag = "verify by hand"
    model = by_hand(example(), views, folded)
    try:
        folded.verify(model, views)
        c.check(tag, True, "")
    except SpecError as e:
        c.check(tag, False, f"a matching parallelization refused: {e}")

    model = by_hand(example(), views, folded, style=OwnExpertParallel())
    try:
        folded.verify(model, views)
        c.check("verify a style of its own", True, "")
    except SpecError as e:
        c.check("verify a style of its own", False, f"refused: {e}")

    cases = [
        (
            "experts on efsdp",
            dict(ep_axis="efsdp"),
            "layers.0.moe.experts.w1: (ep=_S(0, 2), efsdp=S(0))",
            "the spec says (ep=S(0), efsdp=S(0))",
        ),
        ("no dispatch", dict(dispatch=False), "nothing dispatches its tokens", "experts"),
    ]
    for what, kwargs, want, also in cases:
        model = by_hand(example(), views, folded, **kwargs)
        try:
            folded.verify(model, views)
            c.check(f"verify {what}", False, "accepted")
        except SpecError as e:
            text = str(e)
            c.check(f"verify {what}", want in text and also in text, text[:600])
    # dense FSDP2 on the expert view's mesh (no TP: fold dense fsdp 4, expert ep 2 x efsdp 2)
    views = folded.build_mesh(tp=1, ep=2)
    model = by_hand(example(), views, folded, dense_fsdp=("expert", "efsdp"))
    try:
        folded.verify(model, views)
        c.check("verify dense fsdp on expert", False, "accepted")
    except SpecError as e:
        text = str(e)
        ok = "attn.wq.weight" in text and "['efsdp'] is not an axis of view 'dense'" in text
        c.check("verify dense fsdp on expert", ok, text[:600])


# ----------------------------------------------------------------------------- refusals


def _generated(root: str, name: str) -> Any:
    """A module test_ep_train compiled into ``root``/gen."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "gen", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _few_experts(model: nn.Module) -> nn.Module:
    model.layers["1"].moe.experts.num_experts = 6  # its parameters stack 8
    return model


def check_refusals(c: Checks, root: str) -> None:
    """parallelize refuses before the model changes."""
    folded = importlib.import_module(FOLDED)
    views = folded.build_mesh(**FOLD_A)
    one_mesh = _generated(root, "moe_one_mesh_ep")
    with_sp = _generated(root, "moe_folded_sp")
    sp_views = with_sp.build_mesh(**FOLD_A)
    etp_hidden = _generated(root, "moe_folded_etp_hidden")
    cases: list[tuple[str, Callable[[nn.Module], Any], str]] = [
        (
            "experts the style refuses",
            lambda m: folded.parallelize(_few_experts(m), views),
            "layers.1.moe.experts: Experts.num_experts is 6 but its parameters stack 8",
        ),
        (
            "one mesh",
            lambda m: one_mesh.parallelize(m, one_mesh.build_mesh(ep=2)),
            "style expert_parallel on a spec of one mesh: declare the experts' own view",
        ),
        (
            "etp on hidden",
            lambda m: etp_hidden.parallelize(m, etp_hidden.build_mesh(tp=2, ep=2, etp=2)),
            "layers.0.moe.experts.w1: the spec cuts it etp=S(2); expert tensor parallelism "
            "cuts its ffn dimension, etp=S(1)",
        ),
        (
            "sequence parallel with a style on the MoE block",
            lambda m: with_sp.parallelize(
                m, sp_views, styles={"layers.0.moe": PrepareModuleInput()}
            ),
            "layers.0.moe: under sequence parallelism each tp rank routes its own tokens",
        ),
        (
            "styles on experts",
            lambda m: folded.parallelize(
                m, views, styles={"layers.0.moe.experts": ExpertParallel()}
            ),
            "is expert-parallel in the spec",
        ),
        ("not views", lambda m: folded.parallelize(m, views["dense"]), "pass build_mesh()'s views"),
    ]
    for what, call, want in cases:
        model = example()
        before = {
            k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)
        }
        try:
            call(model)
            c.check(f"refuse {what}", False, "accepted")
        except SpecError as e:
            c.check(f"refuse {what}", want in str(e), str(e)[:400])
        after = model.state_dict()
        same = all(torch.equal(after[k], v) for k, v in before.items())
        plain = all(type(p) is nn.Parameter for p in model.parameters())
        plain &= not any(isinstance(m, ExpertParallelModule) for m in model.modules())
        c.check(f"refuse {what}", same and plain, "the model changed")


def run_scenarios(scenarios: list[Callable[[Checks], Any]]) -> dict[str, Any]:
    """Each scenario in order on this rank, until one raises (recorded): failures and the
    checks made per tag."""
    checks = Checks()
    for scenario in scenarios:
        try:
            scenario(checks)
        except Exception:
            checks.check("exception", False, traceback.format_exc())
            break
    return {"fail": checks.fail, "count": checks.count}


def run_all(rank: int, world: int, root: str, hf_dir: str) -> dict[str, Any]:
    """Every scenario on this rank: failures and the checks made per tag."""
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, or they thrash
    return run_scenarios(
        [
            lambda c: check_refusals(c, root),
            check_verify,
            lambda c: check_training(c, root),
            lambda c: check_checkpoint_folds(c, root),
            lambda c: check_load_hf(c, root, hf_dir),
        ]
    )
