"""Multi-rank scenarios of ``parallelize`` and ``verify`` (run by tests/test_parallel.py).

One spawn of 4 gloo ranks runs them all; each returns its failures (strings naming the
scenario) and the number of checks it made, so a scenario that silently checks nothing
is caught by the test.

* ``train``: ``parallelize`` (dp_shard 2 x tp 2) trains AdamW steps; losses and every
  parameter's full tensor match a single-process run of the same model on the same global
  batch within fp32 tolerance. For the example llama (fused wqkv/w13), the same llama at
  dim 512 (a spec variant without manifest), and transformers' Qwen2ForCausalLM and
  Qwen3ForCausalLM (per-head q/k norms, `style sequence_parallel input heads`) as they are;
  the example MoE with AdamW's ``foreach`` kernels (CUDA's default; they take no mix of
  plain tensors and DTensors, so its replicated head must be a DTensor too).
* ``reshard``: train at dp_shard 2 x tp 2, ``save``; load at dp_shard 4 x tp 1, continue.
  The loaded state equals the saved one bitwise, and the continued run equals, bitwise,
  the same continuation from torch's own full-state reshard (``set_state_dict``).
* ``handmade``: torchtitan-style ``parallelize_module`` + ``fully_shard`` driven by the
  generated ``tp_plan``/``shard_placement_fn`` passes ``verify`` (FSDP2's 1-D dp mesh
  for norms included) and round-trips through ``save``/``load`` and ``load_hf``; with
  torch's plain ``ColwiseParallel`` on the fused w13, ``verify`` names exactly the w13s
  and ``save`` refuses; a Megatron-style local-shard model plus FSDP2 passes ``verify``.
* ``strided compute``: the fused w13, cut per component over tp (``_StridedShard``),
  trains with no torch function seeing a ``_StridedShard`` DTensor (what torch 2.11's
  sharding propagation cannot do): the forward computes on local shards, and the loss
  and gradients equal a single process's.
* ``errors``: parallelize refuses a mesh without the spec's axes, a model already
  parallelized, a module whose style cannot be derived, a tied weight sharded over tp
  (also where the spec ignores the alias: GPT-2's tied head), leaving the model unchanged
  (parameters, module classes, hooks: :func:`snapshot`).
* ``styles``: the caller's ``styles`` are tried on meta copies before anything changes:
  ``PrepareModuleOutput`` on the token embedding, torch's contiguous ``ColwiseParallel``
  on the fused w13, ``ColwiseParallel`` on a norm, ``SequenceParallel`` on a block and
  ParallelStyle subclasses of the caller's own are refused with the model unchanged; styles
  that give the spec's layout are applied and ``verify`` holds.
* ``custom``: a module class whose forward is not torch's (a vocab-parallel embedding that
  does its own lookup) is refused by parallelize and tp_plan before any change; with `style
  none` its own forward runs and the logits equal a single process's; an Embedding
  subclass that inherits torch's forward gets the derived style (no false positive).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
import traceback
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode

from examples.models import hf as hf_models
from examples.models import llama
from shardspec.testing import Checks
from tests.custom_modules import NamedEmbedding, VocabParallelEmbedding, with_embedding

LR = 1e-3
STEPS = 2  # the second AdamW step reads the moments the first wrote
BATCH = 4  # global batch, split over dp_shard
SEQ = 17


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def batch(step: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=gen)


def dp_part(tokens: torch.Tensor, mesh, axis: str = "dp_shard") -> torch.Tensor:
    names = mesh.mesh_dim_names
    dp = mesh[axis].get_local_rank() if axis in names else 0
    n = mesh[axis].size() if axis in names else 1
    return tokens.chunk(n)[dp]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def train(model, optim, steps, mesh, vocab: int) -> list[float]:
    """AdamW steps on this rank's part of the global batch; the global mean loss."""
    losses = []
    for step in steps:
        optim.zero_grad()
        tokens = batch(step, vocab)
        loss = lm_loss(model, dp_part(tokens, mesh) if mesh is not None else tokens)
        loss.backward()
        optim.step()
        value = loss.detach().clone()
        if mesh is not None:  # every dp part has as many tokens: the mean of the means
            dp = mesh["dp_shard"]
            dist.all_reduce(value, group=dp.get_group())
            value /= dp.size()
        losses.append(float(value))
    return losses


def compare_training(
    c: Checks,
    tag: str,
    build: Callable[[], nn.Module],
    layout,
    mesh,
    vocab: int,
    foreach: bool | None = None,
) -> None:
    """``parallelize`` against a single process on the same global batches.

    fp32 tolerance, where it is meaningful: first-step gradients within 1e-5 of the
    largest gradient of their tensor, losses within 1e-5 relative at every step, and
    parameters after the AdamW steps within 1e-6 on average. An element whose gradient
    is near 0 can take an Adam step of opposite sign on the two sides (up to 2 lr per
    step, however small the difference), so the largest parameter delta is bounded by
    that, far below what a wrong layout gives (the values themselves, ~0.02-1)."""
    ref = build()
    model = build()
    layout.parallelize(model, mesh)
    layout.verify(model, mesh)
    c.check(tag, True, "")
    tokens = batch(0, vocab)
    lm_loss(ref, tokens).backward()
    lm_loss(model, dp_part(tokens, mesh)).backward()
    ref_params = dict(ref.named_parameters())
    for fqn, p in model.named_parameters():
        want = ref_params[fqn].grad
        delta = (full(p.grad) - want).abs().max().item()
        scale = want.abs().max().item()
        c.check(tag, delta <= 1e-5 * scale + 1e-9, f"{fqn}: grad delta {delta} (max {scale})")
    ref.zero_grad()
    model.zero_grad()
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=foreach)
    ref_losses = train(ref, ref_optim, range(STEPS), None, vocab)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, foreach=foreach)
    losses = train(model, optim, range(STEPS), mesh, vocab)
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        c.check(tag, abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"step {i}: loss {a} vs {b}")
    for fqn, p in model.named_parameters():
        d = (full(p.detach()) - ref_params[fqn].detach()).abs()
        worst, mean = d.max().item(), d.mean().item()
        ok = mean <= 1e-6 and worst <= 2 * LR * STEPS
        c.check(tag, ok, f"{fqn}: after {STEPS} steps max delta {worst}, mean {mean}")


def seeded(
    factory: Callable[[], nn.Module], seed: int = 0, init: Callable = llama.init_weights
) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(seed)
        model = factory()
        init(model, seed)
        return model

    return build


# ----------------------------------------------------------------------------- scenarios


def scenario_train(c: Checks, big_module: str) -> None:
    import generated.llama as layout
    import generated.qwen2 as qwen2

    mesh = layout.build_mesh(tp=2)
    compare_training(c, "train llama", seeded(llama.tiny), layout, mesh, 256)
    big = importlib.import_module(big_module)
    cfg = dict(dim=512, head_dim=128, n_heads=4, n_kv_heads=2, ffn_dim=1024, n_layers=2)
    compare_training(c, "train llama dim 512", seeded(lambda: llama.tiny(**cfg)), big, mesh, 256)
    sp = importlib.import_module("llama_sp")
    tag = "train llama sequence parallel"
    compare_training(c, tag, seeded(llama.tiny), sp, sp.build_mesh(tp=2), 256)
    mesh = qwen2.build_mesh(tp=2)
    compare_training(c, "train qwen2", seeded(hf_models.qwen2_tiny), qwen2, mesh, 256)
    # Qwen3: per-head q/k norms on heads cut over tp (`style sequence_parallel input heads`:
    # their weights' gradients summed over tp, or the replicas drift apart).
    import generated.qwen3 as qwen3

    qwen3_mesh = qwen3.build_mesh(tp=2)
    compare_training(c, "train qwen3", seeded(hf_models.qwen3_tiny), qwen3, qwen3_mesh, 256)
    # The MoE: stacked experts on ep (`style none`, the model's own expert-parallel
    # forward), FSDP2 on dp_shard, the replicated hyper-connection head outside FSDP2.
    import generated.deepseek_moe as moe_layout
    from examples.models import moe

    mesh_moe = moe_layout.build_mesh(ep=2)
    build_moe = seeded(moe.tiny, init=moe.init_weights)
    # foreach: the optimizer's default on CUDA, whose kernels take no mix of plain tensors
    # and DTensors (the replicated head is a Replicate DTensor, as every parameter is).
    compare_training(c, "train moe", build_moe, moe_layout, mesh_moe, 256, foreach=True)
    # Meta-device start, as the README says: parallelize, to_empty, initialize, recompute
    # RoPE's non-persistent inv_freq; the logits equal the reference's.
    tag = "meta qwen2"
    with torch.device("meta"):
        model = hf_models.qwen2_tiny()
    qwen2.parallelize(model, mesh)
    model.to_empty(device="cpu")
    llama.init_weights(model, 0)
    rope = model.model.rotary_emb
    inv_freq, _ = rope.compute_default_rope_parameters(rope.config, device="cpu")
    with torch.no_grad():
        rope.inv_freq.copy_(inv_freq)
        rope.original_inv_freq.copy_(inv_freq)
    ref = seeded(hf_models.qwen2_tiny)()
    tokens = batch(0, 256)
    with torch.no_grad():
        delta = (model(tokens).logits - ref(tokens).logits).abs().max().item()
    c.check(tag, delta <= 1e-5, f"logits differ by {delta} after a meta-device start")


def scenario_options(c: Checks) -> None:
    """FSDP2's options reach every fully_shard call: reshard_after_forward=False leaves a
    block unsharded after its forward (its weight on the tp mesh only), mp_policy computes
    in bf16, and offload_policy trains a step."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    import generated.llama as layout

    tag = "options"
    mesh = layout.build_mesh(tp=2)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tokens = dp_part(batch(0, 256), mesh)
    ref = lm_loss(seeded(llama.tiny)(), batch(0, 256)).item()
    for name, options, dtype, axes in (
        ("default", {}, torch.float32, ("dp_shard", "tp")),
        ("reshard_after_forward", {"reshard_after_forward": False}, torch.float32, ("tp",)),
        ("mp_policy", {"mp_policy": bf16}, torch.bfloat16, ("dp_shard", "tp")),
        (
            "offload_policy",
            {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
            torch.float32,
            ("dp_shard", "tp"),
        ),
    ):
        model = seeded(llama.tiny)()
        layout.parallelize(model, mesh, **options)
        logits = model(tokens[:, :-1])
        w = model.layers["0"].attention.wqkv.weight
        got = tuple(w.device_mesh.mesh_dim_names)
        c.check(tag, logits.dtype == dtype, f"{name}: logits in {logits.dtype}, want {dtype}")
        c.check(tag, got == axes, f"{name}: after the forward wqkv is on {got}, want {axes}")
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.optim.AdamW(model.parameters(), lr=LR).step()
        value = loss.detach().clone()
        dist.all_reduce(value, group=mesh["dp_shard"].get_group())
        mean = value.item() / mesh["dp_shard"].size()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        c.check(tag, abs(mean - ref) <= tol * ref, f"{name}: loss {mean} vs {ref}")
    # FSDP units: every block and the root (torchtitan's wrapping), or the named blocks.
    from torch.distributed.fsdp import FSDPModule

    model = layout.parallelize(seeded(llama.tiny)(), mesh)
    units = sorted(n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule))
    c.check(tag, units == ["<root>", "layers.0", "layers.1"], f"FSDP units {units}")
    model = layout.parallelize(seeded(llama.tiny)(), mesh, blocks=["layers.1"])
    units = sorted(n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule))
    c.check(tag, units == ["<root>", "layers.1"], f"blocks=['layers.1']: FSDP units {units}")
    layout.verify(model, mesh)


def scenario_reshard(c: Checks, root: str) -> None:
    import generated.llama as layout

    tag = "reshard"
    path = os.path.join(root, "reshard")
    build = seeded(llama.tiny)
    mesh_a = layout.build_mesh(tp=2)
    model = build()
    layout.parallelize(model, mesh_a)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, optim, range(2), mesh_a, 256)
    msd, osd = get_state_dict(model, optim)
    layout.save({"model": msd, "optim": osd}, path, mesh=mesh_a)
    full_opts = StateDictOptions(full_state_dict=True)
    saved_m, saved_o = get_state_dict(model, optim, options=full_opts)

    mesh_b = layout.build_mesh(tp=1)
    runs = []
    for how in ("load", "torch"):
        model_b = seeded(llama.tiny, seed=7)()
        layout.parallelize(model_b, mesh_b)
        optim_b = torch.optim.AdamW(model_b.parameters(), lr=LR)
        msd_b, osd_b = get_state_dict(model_b, optim_b)
        if how == "load":
            state = {"model": msd_b, "optim": osd_b}
            layout.load(state, path, mesh=mesh_b)
            set_state_dict(
                model_b, optim_b, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            got_m, got_o = get_state_dict(model_b, optim_b, options=full_opts)
            for k, v in saved_m.items():
                c.check(tag, torch.equal(got_m[k], v), f"loaded {k} differs from the saved")
            for pk, st in saved_o["state"].items():
                for name, v in st.items():
                    got = got_o["state"][pk][name]
                    c.check(tag, torch.equal(full(got), full(v)), f"loaded {pk}.{name} differs")
        else:  # torch's own reshard of the same full state
            set_state_dict(
                model_b,
                optim_b,
                model_state_dict=saved_m,
                optim_state_dict=saved_o,
                options=full_opts,
            )
        losses = train(model_b, optim_b, range(2, 4), mesh_b, 256)
        runs.append(
            (losses, {k: full(v.detach()).clone() for k, v in model_b.state_dict().items()})
        )
    (la, sa), (lb, sb) = runs
    c.check(tag, la == lb, f"continued losses {la} vs {lb}")
    for k in sa:
        delta = (sa[k] - sb[k]).abs().max().item()
        c.check(tag, delta == 0.0, f"{k}: continued run differs by {delta} (want bitwise)")


class NoStridedCompute(TorchFunctionMode):
    """Refuses any torch function called with a DTensor placed ``_StridedShard``, as torch
    2.11's sharding propagation in effect does (it transposes such a weight without moving
    its dimension, then cannot plan the redistribution it thinks it needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    # Bookkeeping, not computation: attribute reads, and FSDP2's unsharded-parameter setup.
    ALLOWED = frozenset({"__get__", "__set__", "detach", "requires_grad_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", str(func))
        for a in (*args, *(kwargs or {}).values()):
            strided = isinstance(a, DTensor) and any(
                isinstance(p, _StridedShard) for p in a.placements
            )
            if strided and name not in self.ALLOWED:
                self.seen.append(name)
                raise RuntimeError(f"{name} on a _StridedShard DTensor")
        return func(*args, **(kwargs or {}))


def scenario_strided_compute(c: Checks) -> None:
    """The fused w13 (cut per component over tp, ``_StridedShard``) computes on its local
    shards: a forward and backward in which no torch function sees a ``_StridedShard``
    DTensor give the single process's loss and gradients (torch 2.11 could not run it)."""
    import generated.llama as layout

    tag = "strided compute"
    mesh = layout.build_mesh(tp=2)
    ref, model = seeded(llama.tiny)(), seeded(llama.tiny)()
    layout.parallelize(model, mesh)
    w13 = model.layers["0"].feed_forward.w13.weight
    c.check(tag, isinstance(w13.placements[-1], _StridedShard), f"w13 {w13.placements}")
    tokens = batch(0, 256)
    mode = NoStridedCompute()
    with mode:
        loss = lm_loss(model, dp_part(tokens, mesh))
    loss.backward()
    c.check(tag, not mode.seen, f"computed with a _StridedShard DTensor: {mode.seen}")
    lm_loss(ref, tokens).backward()
    ref_params = dict(ref.named_parameters())
    for fqn in ("layers.0.feed_forward.w13.weight", "layers.0.feed_forward.w2.weight"):
        p, want = dict(model.named_parameters())[fqn], ref_params[fqn].grad
        assert p.grad is not None and want is not None
        delta = (full(p.grad) - want).abs().max().item()
        c.check(tag, delta <= 1e-5 * want.abs().max().item(), f"{fqn}: grad delta {delta}")
        c.check(tag, type(p) is type(w13) and isinstance(p, DTensor), f"{fqn} not a DTensor")


def _handmade(layout, model: nn.Module, mesh, *, torch_w13: bool) -> nn.Module:
    """torchtitan's way: parallelize_module on tp, fully_shard per block and the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    plan = layout.tp_plan(mesh)  # module patterns: layers.*.feed_forward.w13, ...
    if torch_w13:
        plan["layers.*.feed_forward.w13"] = ColwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    fn = layout.shard_placement_fn(model, mesh)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp_shard"], shard_placement_fn=fn)
    fully_shard(model, mesh=mesh["dp_shard"], shard_placement_fn=fn)
    return model


def scenario_handmade(c: Checks, root: str) -> None:
    from torch.distributed.fsdp import fully_shard

    import generated.llama as layout
    import generated.llama_local as local_layout
    from shardspec.runtime.checkpoint import CheckpointError
    from shardspec.runtime.spec import SpecError

    tag = "handmade"
    mesh = layout.build_mesh(tp=2)
    build = seeded(llama.tiny)
    model = _handmade(layout, build(), mesh, torch_w13=False)
    layout.verify(model, mesh)
    norm = model.layers["0"].attention_norm.weight
    c.check(
        tag,
        tuple(norm.device_mesh.mesh_dim_names) == ("dp_shard",),
        f"FSDP2 should put norms on the 1-D dp mesh, got {norm.device_mesh}",
    )
    ref = dict(build().named_parameters())
    for fqn, p in model.named_parameters():
        c.check(tag, torch.equal(full(p.detach()), ref[fqn].detach()), f"{fqn}: values moved")
    # save -> load into a parallelize()d model with other values: bitwise.
    path = os.path.join(root, "handmade")
    layout.save({"model": model.state_dict()}, path, mesh=mesh)
    other = seeded(llama.tiny, seed=3)()
    layout.parallelize(other, mesh)
    state = {"model": other.state_dict()}
    layout.load(state, path, mesh=mesh)
    for fqn, p in other.named_parameters():
        c.check(tag, torch.equal(full(p.detach()), ref[fqn].detach()), f"{fqn}: load differs")
    # ... and back into the hand-made model.
    layout.save({"model": other.state_dict()}, path + "2", mesh=mesh)
    target = _handmade(layout, seeded(llama.tiny, seed=5)(), mesh, torch_w13=False)
    layout.load({"model": target.state_dict()}, path + "2", mesh=mesh)
    for fqn, p in target.named_parameters():
        c.check(tag, torch.equal(full(p.detach()), ref[fqn].detach()), f"{fqn}: reload differs")
    # load_hf into the hand-made model, against the hand-written conversion.
    hf_dir = os.path.join(root, "hf")
    if dist.get_rank() == 0:
        import transformers

        torch.manual_seed(11)
        hf = transformers.LlamaForCausalLM(hf_models.llama_config())
        hf.save_pretrained(hf_dir)
    dist.barrier()
    from safetensors.torch import load_file

    hf_state = load_file(os.path.join(hf_dir, "model.safetensors"))
    want = hf_models.llama_from_hf(hf_state, llama.LlamaConfig())
    layout.load_hf(target, hf_dir, mesh)
    for fqn, p in target.named_parameters():
        c.check(tag, torch.equal(full(p.detach()), want[fqn]), f"{fqn}: load_hf differs")
    # export_hf from the hand-made (FSDP2 + TP) model: the original tensors, bitwise.
    out_dir = os.path.join(root, "hf_export")
    layout.export_hf(target, out_dir, mesh, config=hf_dir)
    import glob

    exported: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(out_dir, "*.safetensors"))):
        exported.update(load_file(f))
    c.check(tag, set(exported) == set(hf_state), f"exported keys {sorted(exported)}")
    for key, value in hf_state.items():
        same = key in exported and torch.equal(exported[key], value)
        c.check(tag, same, f"export_hf: {key} differs from the original")
    # torch's contiguous ColwiseParallel on the fused w13: verify names exactly those.
    wrong = _handmade(layout, build(), mesh, torch_w13=True)
    try:
        layout.verify(wrong, mesh)
        c.check(tag, False, "verify accepted torch's contiguous ColwiseParallel on w13")
    except SpecError as e:
        text = str(e)
        named = {line.split(":")[0].strip() for line in text.splitlines()[1:]}
        want_bad = {f"layers.{i}.feed_forward.w13.weight" for i in range(2)}
        c.check(tag, named == want_bad, f"verify named {named}, want {want_bad}: {text}")
    try:
        layout.save({"model": wrong.state_dict()}, path + "3", mesh=mesh)
        c.check(tag, False, "save accepted a model verify refuses")
    except CheckpointError as e:
        c.check(tag, "feed_forward.w13.weight" in str(e), f"save's error: {e}")
    # Megatron style: local TP shards built by the model, FSDP2 on dp_shard, and verify.
    lmesh = local_layout.build_mesh(tp=2)
    tp_rank = lmesh["tp"].get_local_rank()
    meg = llama.tiny_tp_local(tp=2)
    meg.load_state_dict(llama.local_tp_state(dict(build().state_dict()), tp_rank, 2, meg.config))
    fn = local_layout.shard_placement_fn(meg, lmesh)
    for block in meg.layers.values():
        fully_shard(block, mesh=lmesh["dp_shard"], shard_placement_fn=fn)
    fully_shard(meg, mesh=lmesh["dp_shard"], shard_placement_fn=fn)
    local_layout.verify(meg, lmesh)
    c.check(tag, True, "")


def snapshot(model: nn.Module) -> dict[str, object]:
    """What parallelize could change: each parameter (object, class, values) under every
    name, each module's class, hooks and whether torch's distribute_module ran on it."""
    params = {
        n: (id(p), type(p), p.detach().clone())
        for n, p in model.named_parameters(remove_duplicate=False)
    }
    modules = {
        n: (
            type(m),
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            len(m._backward_hooks),
            getattr(m, "_distribute_module_applied", False),
        )
        for n, m in model.named_modules(remove_duplicate=False)
    }
    return {"params": params, "modules": modules}


def unchanged(c: Checks, tag: str, what: str, before: dict, model: nn.Module) -> None:
    after = snapshot(model)
    c.check(tag, after["modules"] == before["modules"], f"{what}: modules changed")
    a, b = after["params"], before["params"]
    c.check(tag, set(a) == set(b), f"{what}: parameter names changed")  # type: ignore[arg-type]
    for k, (pid, t, v) in b.items():  # type: ignore[attr-defined]
        got = a.get(k)  # type: ignore[attr-defined]
        same = got is not None and got[0] == pid and got[1] is t and torch.equal(got[2], v)
        c.check(tag, same, f"{what}: {k} changed although parallelize refused")


def refused(
    c: Checks, tag: str, what: str, fn: Callable[[], object], needles: list[str], model: nn.Module
) -> str:
    """``fn`` raises a SpecError whose text holds every needle, and leaves ``model`` as it
    was; returns the error's text."""
    from shardspec.runtime.spec import SpecError

    before = snapshot(model)
    try:
        fn()
        c.check(tag, False, f"{what}: no error")
        return ""
    except SpecError as e:
        for needle in needles:
            c.check(tag, needle in str(e), f"{what}: error without {needle!r}: {e}")
        text = str(e)
    unchanged(c, tag, what, before, model)
    return text


def scenario_errors(c: Checks) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import generated.gpt2 as gpt2_layout
    import generated.llama as layout
    from shardspec.runtime.spec import SpecError

    tag = "errors"
    mesh = layout.build_mesh(tp=2)
    m = llama.tiny()
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    refused(c, tag, "mesh axes", lambda: layout.parallelize(m, other), ["spec's axes"], m)
    done = llama.tiny()
    layout.parallelize(done, mesh)
    try:
        layout.parallelize(done, mesh)
        c.check(tag, False, "a parallelized model was parallelized again")
    except SpecError as e:
        c.check(tag, "already parallelized" in str(e), f"twice: {e}")
    odd = llama.tiny()
    odd.layers["0"].feed_forward.w13 = _NotALinear(odd.layers["0"].feed_forward.w13.weight)
    needle = ["no tensor-parallel style"]
    refused(c, tag, "no style", lambda: layout.parallelize(odd, mesh), needle, odd)
    # An embedding and head tied the way transformers ties them (one Parameter in two
    # modules), sharded over tp: refused, not a forward mixing DTensors and tensors.
    tied = llama.tiny()
    assert tied.output is not None
    tied.output.weight = tied.tok_embeddings.weight
    refused(c, tag, "tied", lambda: layout.parallelize(tied, mesh), ["tied parameters"], tied)
    # GPT-2 (its spec keeps the tied embedding whole over tp, so the tie stands): its
    # attention splits c_attn's per-component tp output by a global split_size, refused
    # without LocalWidth, naming the module and the style (tests/test_conv1d_tp.py trains it
    # with the style).
    gpt2 = hf_models.gpt2_tiny()
    gmesh = gpt2_layout.build_mesh(tp=2)
    needles = ["transformer.h.0.attn: splits", "LocalWidth('split_size')"]
    refused(
        c,
        tag,
        "gpt2 without LocalWidth",
        lambda: gpt2_layout.parallelize(gpt2, gmesh),
        needles,
        gpt2,
    )
    # styles: a module the model lacks is named; a style for a parameter-free module is
    # applied (PrepareModuleInput on a block).
    from torch.distributed.tensor.parallel import PrepareModuleInput

    m = llama.tiny()
    fn = lambda: layout.parallelize(m, mesh, styles={"nope": None})  # noqa: E731
    refused(c, tag, "styles", fn, ["'nope'"], m)
    m = llama.tiny()
    prep = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    layout.parallelize(m, mesh, styles={"layers.0": prep})
    hooks = m.layers["0"]._forward_pre_hooks
    c.check(tag, len(hooks) > 0, "the PrepareModuleInput style on layers.0 was not applied")
    wrong_shape = llama.tiny(dim=32, head_dim=8)
    fn = lambda: layout.parallelize(wrong_shape, mesh)  # noqa: E731
    refused(c, tag, "manifest", fn, ["manifest"], wrong_shape)


def scenario_styles(c: Checks) -> None:
    """The caller's styles, checked on meta copies before the model changes."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        SequenceParallel,
    )

    import generated.llama as layout

    tag = "styles"
    mesh = layout.build_mesh(tp=2)

    def refuse(what: str, styles: dict, needles: list[str]) -> str:
        m = llama.tiny()
        fn = lambda: layout.parallelize(m, mesh, styles=styles)  # noqa: E731
        return refused(c, tag, what, fn, ["the model is unchanged", *needles], m)

    # The case: a style that cuts no parameter, on a module whose weight the spec
    # shards over tp.
    prep = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate())
    refuse(
        "PrepareModuleOutput on tok_embeddings",
        {"tok_embeddings": prep},
        [
            "styles['tok_embeddings']: PrepareModuleOutput leaves tok_embeddings.weight as a "
            "plain tensor (whole on every rank), but the spec gives it tp=S(0): tp rank 0 "
            "would hold [0:256, 0:64], the spec gives it [0:128, 0:64]"
        ],
    )
    # torch's contiguous ColwiseParallel on the fused gate/up: one rank would get all gate.
    text = refuse(
        "ColwiseParallel on w13",
        {"layers.0.feed_forward.w13": ColwiseParallel()},
        ["ColwiseParallel puts layers.0.feed_forward.w13.weight as tp=S(0), but the spec"],
    )
    c.check(tag, "layers.1" not in text, f"only the module given the style is named: {text}")
    refuse(
        "ColwiseParallel on a norm",
        {"norm": ColwiseParallel()},
        ["ColwiseParallel cannot be applied to norm (RMSNorm): NotImplementedError"],
    )
    refuse(
        "SequenceParallel on a block",
        {"layers.0": SequenceParallel()},
        ["SequenceParallel cannot be applied to layers.0 (TransformerBlock): KeyError"],
    )
    refuse(
        "a style of the caller's that also places a submodule's parameters",
        {"layers.0": _ShardParams(None, recurse=True)},
        [
            "_ShardParams also places layers.0.attention.wqkv.weight (tp=R), whose module "
            "layers.0.attention.wqkv gets its own style"
        ],
    )
    refuse("not a style", {"output": "colwise"}, ["styles['output']: str is not a torch"])
    refuse(
        "a style of the caller's, cutting the wrong dimension",
        {"tok_embeddings": _ShardParams(1)},
        ["_ShardParams puts tok_embeddings.weight as tp=S(1), but the spec gives it tp=S(0)"],
    )
    refuse(
        "a style of the caller's that needs real data",
        {"output": _NeedsData()},
        ["_NeedsData cannot be applied to output (Linear)"],
    )
    # Styles that give the spec's layout are applied, and verify holds.
    m = llama.tiny()
    ok = {"tok_embeddings": _ShardParams(0), "output": layout.tp_plan(mesh, m)["output"]}
    try:
        layout.parallelize(m, mesh, styles=ok)
        layout.verify(m, mesh)
        c.check(tag, isinstance(m.tok_embeddings.weight, DTensor), "tok_embeddings not placed")
    except Exception as e:
        c.check(tag, False, f"styles that give the spec's layout were refused: {e}")


class _ShardParams(ParallelStyle):
    """A caller's own style: the module's parameters (``recurse``: its submodules' too) cut
    on dimension ``dim`` over the tp mesh (``None``: replicated) with torch's
    distribute_tensor, nothing else."""

    def __init__(self, dim: int | None, recurse: bool = False) -> None:
        super().__init__()
        self.dim, self.recurse = dim, recurse

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import distribute_tensor

        placement = Replicate() if self.dim is None else Shard(self.dim)
        for sub in module.modules() if self.recurse else [module]:
            for name, p in list(sub.named_parameters(recurse=False)):
                dt = distribute_tensor(p.detach(), device_mesh, [placement])
                sub.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        return module


class _NeedsData(ParallelStyle):
    """A caller's own style that reads the weight's values (it cannot run on meta)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        scale = float(module.weight.abs().max().item())
        module.register_buffer("scale", torch.tensor(scale))
        return module


def scenario_custom(c: Checks, vocab_module: str) -> None:
    """Module classes whose forward is not torch's."""
    import generated.llama as layout

    tag = "custom"
    mesh = layout.build_mesh(tp=2)
    m = with_embedding(llama.tiny(), VocabParallelEmbedding)
    needles = [
        "tok_embeddings: the spec gives it torch's RowwiseParallel, but VocabParallelEmbedding "
        "(tests.custom_modules.VocabParallelEmbedding) runs its own forward()",
        "state `style none`",
    ]
    refused(c, tag, "parallelize", lambda: layout.parallelize(m, mesh), needles, m)
    refused(c, tag, "tp_plan", lambda: layout.tp_plan(mesh, m), needles[:1], m)
    tokens = batch(0, 256)[:, :-1]
    ref = seeded(llama.tiny)()
    with torch.no_grad():
        want = ref(tokens)
    # `style none` (a spec variant): the module's own forward does the vocab-parallel lookup.
    vocab = importlib.import_module(vocab_module)
    # ... and an Embedding subclass that inherits torch's forward gets torch's style.
    for what, lay, cls in (
        ("style none", vocab, VocabParallelEmbedding),
        ("inherited forward", layout, NamedEmbedding),
    ):
        model = with_embedding(seeded(llama.tiny)(), cls)
        try:
            lay.parallelize(model, mesh)
            lay.verify(model, mesh)
            with torch.no_grad():
                got = model(tokens)
            delta = (got - want).abs().max().item()
            c.check(tag, delta <= 1e-5, f"{what}: logits differ by {delta}")
        except Exception as e:
            c.check(tag, False, f"{what}: {type(e).__name__}: {e}")


class _NotALinear(nn.Module):
    """Holds a weight sharded over tp but is no Linear: no style derives from it."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


# ----------------------------------------------------------------------------- entry


def run_all(rank: int, world: int, big_module: str, build_dir: str) -> tuple[list[str], dict]:
    """Training, options, reshard and hand-made parallelization (the slow scenarios)."""
    c = Checks()
    with _scratch(build_dir) as root:
        _run(
            c,
            (
                ("train", lambda: scenario_train(c, big_module)),
                ("options", lambda: scenario_options(c)),
                ("reshard", lambda: scenario_reshard(c, root)),
                ("handmade", lambda: scenario_handmade(c, root)),
                ("strided compute", lambda: scenario_strided_compute(c)),
            ),
        )
    return c.fail, c.count


def run_refusals(
    rank: int, world: int, vocab_module: str, build_dir: str
) -> tuple[list[str], dict]:
    """What parallelize refuses before changing the model, and what it accepts instead."""
    c = Checks()
    with _scratch(build_dir):
        _run(
            c,
            (
                ("errors", lambda: scenario_errors(c)),
                ("styles", lambda: scenario_styles(c)),
                ("custom", lambda: scenario_custom(c, vocab_module)),
            ),
        )
    return c.fail, c.count


def run_both(
    rank: int, world: int, big_module: str, vocab_module: str, build_dir: str
) -> dict[str, tuple[list[str], dict]]:
    """:func:`run_refusals` then :func:`run_all` in one spawn (tests/test_parallel.py),
    each with its own failures and counts."""
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, or they thrash
    return {
        "refusals": run_refusals(rank, world, vocab_module, build_dir),
        "all": run_all(rank, world, big_module, build_dir),
    }


@contextlib.contextmanager
def _scratch(build_dir: str) -> Iterator[str]:
    """``build_dir`` importable, and a scratch folder shared by every rank."""
    import sys

    if build_dir not in sys.path:
        sys.path.insert(0, build_dir)
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        dist.broadcast_object_list(root, src=0)
        yield root[0]
        dist.barrier()


def _run(c: Checks, scenarios: tuple[tuple[str, Callable[[], None]], ...]) -> None:
    for name, fn in scenarios:
        try:
            fn()
        except Exception:
            c.fail.append(f"[{name}] raised:\n{traceback.format_exc()}")


__all__ = ["run_all", "run_both", "run_refusals"]
