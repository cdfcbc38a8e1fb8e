"""Multi-rank scenarios for ``tests/test_hf.py``: Hugging Face checkpoints, written by
``transformers`` itself, loaded into the example models through the example specs'
``hf`` blocks, and exported back.

Every scenario appends failure strings instead of raising (see ``dist_scenarios``), so
the parent sees every difference at once. The oracle is :mod:`examples.models.hf`: hand
conversions that do not use the spec.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from examples.models import hf as hfm
from examples.models import llama, moe
from shardspec.runtime.hf import HFError

# Every torch.distributed call that talks to another rank, but isend/irecv: P2POp checks
# that its op *is* torch.distributed.isend or irecv, so they cannot be wrapped; the
# dispatcher-level counter below sees them (and batch_isend_irecv is wrapped).
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",  # torch 2.13's, which FSDP2 calls (absent in older releases)
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",  # likewise
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Count calls of every collective and point-to-point function of torch.distributed
    (module attributes and ``distributed_c10d``'s) while the block runs."""
    from torch.distributed import distributed_c10d as c10d

    counts: dict[str, int] = {}
    saved = []
    for mod in (dist, c10d):
        for name in COLLECTIVES:
            fn = getattr(mod, name, None)
            if fn is None:
                continue

            def wrapper(*a: Any, _fn: Callable = fn, _name: str = name, **k: Any) -> Any:
                counts[_name] = counts.get(_name, 0) + 1
                return _fn(*a, **k)

            saved.append((mod, name, fn))
            setattr(mod, name, wrapper)
    try:
        yield counts
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


# c10d ops that are not communication (waiting on a result, autograd wrapping).
_LOCAL_OPS = ("wait_tensor", "_wrap_tensor_autograd")


@contextlib.contextmanager
def count_dispatched_collectives() -> Iterator[dict[str, int]]:
    """Every ``c10d`` and functional-collective op that reaches the dispatcher (process
    group calls from Python or C++, DTensor redistributions), by op name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, int] = {}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if "c10d" in func.namespace and not any(s in str(func) for s in _LOCAL_OPS):
                name = str(func).removesuffix(".default")
                counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Mode():
        yield counts


@contextlib.contextmanager
def count_opens() -> Iterator[dict[str, int]]:
    """Count ``safetensors.safe_open`` calls per file."""
    import safetensors

    counts: dict[str, int] = {}
    real = safetensors.safe_open

    def opener(filename: Any, *a: Any, **k: Any) -> Any:
        name = os.path.basename(os.fspath(filename))
        counts[name] = counts.get(name, 0) + 1
        return real(filename, *a, **k)

    safetensors.safe_open = opener
    try:
        yield counts
    finally:
        safetensors.safe_open = real


@dataclass
class Item:
    label: str
    fail: list[str] = field(default_factory=list)
    checked: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """Load checkpoint ``hf`` (a folder under root) into ``model`` through ``module``."""

    module: str
    sizes: tuple[tuple[str, int], ...]
    model: str  # llama, llama_tied, llama_local, moe, moe_local
    hf: str  # llama, llama_tied, qwen3

    @property
    def logits(self) -> bool:
        """Whether transformers can run the checkpoint and the reference model the full
        weights: not for Megatron-style local modules, nor for ``llama_t`` (its down_proj
        is stored transposed, which only the spec's ``transpose`` undoes)."""
        return not self.model.endswith("_local") and self.hf != "llama_t"

    @property
    def label(self) -> str:
        mesh = "x".join(f"{a}{n}" for a, n in self.sizes)
        return f"{self.hf} -> {self.module} {self.model} {mesh}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def hf_state(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out |= load_file(os.path.join(folder, name))
    return out


def reference(case: Case, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The example model's global state dict from the HF tensors, by hand."""
    if case.hf == "llama_t":  # down_proj stored transposed: undo it by hand
        hf = {k: v.t() if k.endswith("mlp.down_proj.weight") else v for k, v in hf.items()}
    if case.model.startswith("llama"):
        cfg = llama.LlamaConfig(tie_embeddings=case.model == "llama_tied")
        out = hfm.llama_from_hf(hf, cfg)
    else:
        out = hfm.moe_from_hf(hf, moe.MoEConfig())
    return {k: v.float() for k, v in out.items()}  # the models are fp32, whatever the files


def global_model(case: Case, *, hf_twin: bool = False) -> nn.Module:
    """The example model the case loads into. The MoE examples' manifests describe the
    model with a hyper-connection head (``hc_mult=2``), which Qwen3-MoE lacks: the spec
    keeps it out of the mapping, and ``hf_twin`` gives the head-less model whose forward
    is Qwen3-MoE's, for the logits."""
    if case.model == "llama_tied":
        return llama.tiny_tied()
    if case.model.startswith("llama"):
        return llama.tiny()
    return moe.tiny_qwen3() if hf_twin else moe.tiny()


def build(case: Case, mesh: Any) -> nn.Module:
    """The model on ``mesh``, filled with values the load must overwrite."""
    mod = importlib.import_module(case.module)
    sizes = dict(case.sizes)
    if case.model == "llama_local":
        model = llama.tiny_tp_local(tp=sizes["tp"])
    elif case.model == "moe_local":
        model = moe.tiny_local(ep=sizes["ep"])
    else:
        with torch.device("meta"):
            model = global_model(case)
        mod.distribute(model, mesh)
        model.to_empty(device="cpu")
        (moe if case.model == "moe" else llama).init_weights(model, seed=99)
        return model
    (moe if case.model == "moe_local" else llama).init_weights(model, seed=99)
    mod.distribute(model, mesh)
    return model


def local_reference(
    case: Case, mesh: Any, ref: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What each module parameter holds, Megatron style: cut by the model's own helpers."""
    names = tuple(mesh.mesh_dim_names)
    coord = mesh.get_coordinate()
    if case.model == "llama_local":
        i = names.index("tp")
        return llama.local_tp_state(dict(ref), coord[i], mesh.size(i), llama.LlamaConfig())
    if case.model == "moe_local":
        i = names.index("ep")
        return moe.local_expert_state(dict(ref), coord[i], mesh.size(i), moe.MoEConfig())
    return dict(ref)


def local_of(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach()


def full_of(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def check_loaded(
    case: Case, item: Item, model: nn.Module, mesh: Any, ref: dict, before: dict
) -> None:
    """Every mapped parameter equals the oracle; every kept one (``hc_head``) is as it
    was before the load."""
    want = local_reference(case, mesh, ref)
    for fqn, p in sorted(model.named_parameters()):
        if fqn.startswith("hc_head."):
            if not same_bits(local_of(p), before[fqn]):
                item.fail.append(f"{item.label} {fqn}: kept out of the mapping, yet changed")
            continue
        if fqn not in want:
            item.fail.append(f"{item.label} {fqn}: no reference value")
            continue
        got = full_of(p)
        expect = want[fqn]
        if not same_bits(got, expect):
            item.fail.append(
                f"{item.label} {fqn}: loaded {tuple(got.shape)} differs from the HF tensors "
                f"after the transforms (max delta {(got - expect).abs().max().item():.3g})"
                if got.shape == expect.shape
                else f"{item.label} {fqn}: shape {tuple(got.shape)} vs {tuple(expect.shape)}"
            )
        item.checked += 1


def logits_check(case: Case, item: Item, model: nn.Module, hf_dir: str, tag: str) -> None:
    """Rank 0: the reference model with the loaded weights against transformers'."""
    import transformers

    full = {fqn: full_of(p) for fqn, p in model.named_parameters()}
    if dist.get_rank() != 0:
        return
    try:  # rank 0 alone: an error here must not leave the other ranks waiting
        ours = global_model(case, hf_twin=True).eval()
        full = {k: v for k, v in full.items() if not k.startswith("hc_head.")}
        missing, unexpected = ours.load_state_dict(full, strict=False)
        if unexpected or any(not k.endswith("._extra_state") for k in missing):
            raise AssertionError(f"state does not fit: missing {missing}, unexpected {unexpected}")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        theirs.eval()
        vocab = 256
        tokens = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            a, b = ours(tokens), theirs(tokens).logits
        diff = (a - b).abs().max().item()
    except Exception:
        item.fail.append(f"{item.label}: logits check ({tag}) raised:\n{traceback.format_exc()}")
        return
    item.extra[f"logits {tag}"] = diff
    if not diff <= 1e-5:
        item.fail.append(f"{item.label}: logits differ from transformers' ({tag}) by {diff:.3g}")


def load_case(root: str, case: Case, item: Item) -> None:
    mod = importlib.import_module(case.module)
    mesh = mod.build_mesh(**dict(case.sizes))
    model = build(case, mesh)
    before = snapshot(model)
    hf_dir = os.path.join(root, case.hf)
    # bf16 files where the spec's HF manifest says F32: a cast the load must be told of
    options = {"other_dtypes": True} if case.hf == "llama_bf16" else {}
    with count_collectives() as calls, count_dispatched_collectives() as ops:
        with count_opens() as opens:
            report = mod.load_hf(model, hf_dir, mesh, **options)
    if calls or ops:
        item.fail.append(f"{item.label}: load_hf communicated: calls {calls}, c10d ops {ops}")
    if any(n != 1 for n in opens.values()):
        item.fail.append(f"{item.label}: files opened more than once: {opens}")
    if report.bytes_read != report.bytes_owned:
        item.fail.append(
            f"{item.label}: read {report.bytes_read} bytes for {report.bytes_owned} owned"
        )
    item.extra["bytes"] = (report.bytes_read, report.bytes_owned)
    ref = reference(case, hf_state(hf_dir))
    check_loaded(case, item, model, mesh, ref, before)
    if case.logits:
        logits_check(case, item, model, hf_dir, "after load")
    # Export, and compare with what transformers wrote.
    out = os.path.join(
        root, f"export-{dist.get_world_size()}", item.label.replace(" ", "_").replace(">", "")
    )
    with count_collectives() as calls:
        file_dtype = next(iter(hf_state(hf_dir).values())).dtype
        exported = mod.export_hf(model, out, mesh, config=hf_dir, dtype=file_dtype)
    item.extra["export calls"] = dict(calls)
    item.extra["written"] = exported.bytes_written
    if dist.get_rank() == 0:
        compare_export(case, item, out, hf_dir)
    if case.logits and not (case.hf == "llama_tied" and case.model == "llama"):
        logits_check(case, item, model, out, "exported")


def compare_export(case: Case, item: Item, out: str, hf_dir: str) -> None:
    """Rank 0: the exported tensors against what transformers wrote, bitwise."""
    try:
        got, want = hf_state(out), hf_state(hf_dir)
        if set(got) != set(want):
            item.fail.append(
                f"{item.label}: exported keys differ: extra {sorted(set(got) - set(want))}, "
                f"missing {sorted(set(want) - set(got))}"
            )
        for key in sorted(set(got) & set(want)):
            if not same_bits(got[key], want[key]):
                item.fail.append(f"{item.label}: exported {key} differs from the original")
            item.checked += 1
    except Exception:
        item.fail.append(f"{item.label}: export check raised:\n{traceback.format_exc()}")


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: local_of(p).clone() for k, p in model.named_parameters()}


def bad_inputs(root: str, item: Item, bad: list[tuple[str, str, str]]) -> None:
    """Each ``(folder, what, needle)`` must raise HFError naming ``needle``, and leave the
    model as it was."""
    case = Case("generated.llama", (("tp", 2),), "llama", "llama")
    mod = importlib.import_module(case.module)
    mesh = mod.build_mesh(tp=2)
    model = build(case, mesh)
    before = snapshot(model)
    for folder, what, needle in bad:
        try:
            mod.load_hf(model, os.path.join(root, folder), mesh)
        except HFError as e:
            if needle not in str(e):
                item.fail.append(f"{what}: the error does not name {needle!r}:\n{e}")
        except Exception as e:
            item.fail.append(f"{what}: raised {type(e).__name__} instead of HFError: {e}")
        else:
            item.fail.append(f"{what}: loaded without an error")
        after = snapshot(model)
        changed = [k for k in before if not same_bits(before[k], after[k])]
        if changed:
            item.fail.append(f"{what}: the model changed: {changed[:3]}")
        item.checked += 1


def export_faults(root: str, item: Item) -> None:
    """A config that cannot be read, and a write that fails on one rank: every rank raises
    HFError naming the cause, and neither the target nor ``<target>.partial`` is left."""
    import safetensors.torch

    case = Case("generated.llama", (("tp", 2),), "llama", "llama")
    mod = importlib.import_module(case.module)
    mesh = mod.build_mesh(tp=2)
    model = build(case, mesh)
    rank = dist.get_rank()
    target = os.path.join(root, "export-faults", "out")

    def expect(what: str, needle: str, **options: Any) -> None:
        try:
            mod.export_hf(model, target, mesh, **options)
        except HFError as e:
            if needle not in str(e):
                item.fail.append(f"{what}: the error does not name {needle!r}:\n{e}")
        else:
            item.fail.append(f"{what}: exported without an error")
        dist.barrier()
        left = [p for p in (target, target + ".partial") if os.path.exists(p)]
        if left:
            item.fail.append(f"{what}: left {left}")
        item.checked += 1
        dist.barrier()  # every rank has looked before the next export creates files

    expect("a missing config", "no-such-dir", config=os.path.join(root, "no-such-dir"))
    real = safetensors.torch.save_file

    def broken(*a: Any, **k: Any) -> None:
        raise OSError(28, "No space left on device")

    if rank == 1:
        safetensors.torch.save_file = broken
    try:
        expect("a write failing on rank 1", "rank 1: OSError: [Errno 28] No space left on device")
    finally:
        safetensors.torch.save_file = real


def export_ties(root: str, item: Item) -> None:
    """The untied example Llama loaded from the tied checkpoint (its output.weight is the
    embedding's copy), exported: the alias ``lm_head.weight`` is written only when the
    config says untied or, without a config, when the weights differ; a tied config with
    differing weights is refused."""
    case = Case("generated.llama", (("tp", 2),), "llama", "llama_tied")
    mod = importlib.import_module(case.module)
    mesh = mod.build_mesh(tp=2)
    model = build(case, mesh)
    hf_dir = os.path.join(root, case.hf)
    mod.load_hf(model, hf_dir, mesh)
    base = os.path.join(root, "export-ties")
    original = set(hf_state(hf_dir))
    assert "lm_head.weight" not in original

    def export(name: str, want_lm_head: bool, **options: Any) -> None:
        out = os.path.join(base, name)
        report = mod.export_hf(model, out, mesh, **options)
        weight = model.output.weight
        full = weight.full_tensor() if isinstance(weight, DTensor) else weight.detach()
        dist.barrier()
        if dist.get_rank() == 0:
            keys = set(hf_state(out))
            want = original | ({"lm_head.weight"} if want_lm_head else set())
            if keys != want:
                item.fail.append(f"ties, {name}: keys {sorted(keys ^ want)} differ")
            index = json.loads(Path(out, "model.safetensors.index.json").read_text())
            if set(index["weight_map"]) != want:
                item.fail.append(f"ties, {name}: the index lists {sorted(index['weight_map'])}")
            if want_lm_head and not same_bits(hf_state(out).get("lm_head.weight", full), full):
                item.fail.append(f"ties, {name}: lm_head.weight is not the model's output")
        skipped = report.aliases_not_written
        if skipped != ([] if want_lm_head else ["lm_head.weight"]):
            item.fail.append(f"ties, {name}: aliases_not_written {skipped}")
        item.checked += 1

    export("tied config, equal", False, config=hf_dir)
    export("no config, equal", False)
    export("untied config, equal", True, config={"tie_word_embeddings": False})
    with torch.no_grad():
        local_of(model.output.weight).add_(1.0)
    export("no config, differing", True)
    out = os.path.join(base, "refused")
    try:
        mod.export_hf(model, out, mesh, config=hf_dir)
        item.fail.append("ties: a tied config with differing weights exported")
    except HFError as e:
        needles = ("lm_head.weight", "model.embed_tokens.weight", "tie_word_embeddings false")
        if not all(n in str(e) for n in needles):
            item.fail.append(f"ties: the refusal does not name {needles}:\n{e}")
    dist.barrier()
    left = [p for p in (out, out + ".partial") if os.path.exists(p)]
    if left:
        item.fail.append(f"ties: the refused export left {left}")
    item.checked += 1


def run_all(rank: int, world: int, root: str, cases: list[Case], bad: list) -> dict[str, Item]:
    """Run every case, then the bad inputs, on this rank. ``root/gen`` holds the specs the
    test compiled (the tied Llama's)."""
    torch.set_num_threads(1)  # 3 or 4 ranks on 2 cores: one thread each, or they thrash
    gen = os.path.join(root, "gen")
    if gen not in sys.path:
        sys.path.insert(0, gen)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out: dict[str, Item] = {}
    # The counters must see communication when there is some, or "0 collectives" proves
    # nothing: a plain all_reduce, and the all-gather inside a DTensor's full_tensor().
    control = Item("counters")
    with count_collectives() as calls, count_dispatched_collectives() as ops:
        dist.all_reduce(torch.ones(1))
    if not calls or not ops:
        control.fail.append(f"all_reduce not counted: calls {calls}, c10d ops {ops}")
    with count_dispatched_collectives() as ops:
        mesh = importlib.import_module("generated.llama").build_mesh(tp=1)
        from torch.distributed.tensor import Shard, distribute_tensor

        distribute_tensor(torch.ones(8, 2), mesh, (Shard(0), Shard(0))).full_tensor()
    if not ops:
        control.fail.append("DTensor.full_tensor()'s all-gather not counted")
    control.checked = 2
    out[control.label] = control
    for case in cases:
        item = Item(case.label)
        try:
            load_case(root, case, item)
        except Exception:
            item.fail.append(f"{item.label} raised:\n{traceback.format_exc()}")
        dist.barrier()
        out[item.label] = item
    if not bad:
        return out
    item = Item("export faults")
    try:
        export_faults(root, item)
    except Exception:
        item.fail.append(f"export faults raised:\n{traceback.format_exc()}")
    out[item.label] = item
    item = Item("export ties")
    try:
        export_ties(root, item)
    except Exception:
        item.fail.append(f"export ties raised:\n{traceback.format_exc()}")
    out[item.label] = item
    item = Item("bad input")
    try:
        bad_inputs(root, item, bad)
    except Exception:
        item.fail.append(f"bad input raised:\n{traceback.format_exc()}")
    out[item.label] = item
    return out
