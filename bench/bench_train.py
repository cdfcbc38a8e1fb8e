"""Training step: the generated ``parallelize`` against a hand-written torchtitan-style
``parallelize_module`` + ``fully_shard`` and against the ``distribute``-only model.

    python -m bench.bench_train                          # dim 512, 4 ranks, tp 2
    python -m bench.bench_train --rounds 4 --steps 10 --json /tmp/train.json
    python -m bench.bench_train --world 4 --tp 2 --dim 256 --layers 2 --steps 3 --rounds 1
    python -m bench.bench_train --model moe --rounds 4     # the MoE on folded views

``world`` gloo CPU ranks (``shardspec.testing.run_ranks``), mesh dp_shard x tp (dp_shard
takes the rest), the Llama of ``examples/models/llama.py`` (fused ``wqkv`` and ``w13``).
The layout is ``specs/llama.shard`` compiled by the real CLI into a temporary folder
without its manifest and hf block, with the fused q/k/v groups set to this model's heads
(the spec file pins the tiny model's), so any model size works. Three variants of the
same model (same initial values), each with its own AdamW, on the same mesh and the same
batches, in the same processes:

* ``parallelize``: ``layout.parallelize(model, mesh)``: torch's ``parallelize_module``
  with the spec's styles on tp, then FSDP2 ``fully_shard`` per block and the root on
  dp_shard;
* ``hand-written``: what a torchtitan-style trainer writes by hand (``handwritten``):
  ``parallelize_module`` with torch's ``RowwiseParallel`` / ``ColwiseParallel``, then
  ``fully_shard`` per block and the root, ``Shard(1)`` for ``w13`` as the spec says;
* ``distribute``: ``layout.distribute(model, mesh)``: the parameters become DTensors on the
  spec's layout, the batch is a DTensor sharded over dp_shard, and the forward, backward
  and AdamW step run through plain DTensor dispatch (its sharding propagation chooses the
  communication). DTensor has no sharding rule for CPU flash attention, so attention runs
  with SDPA's math backend (``--sdpa math``, the default, uses it for all three variants).

A step is ``zero_grad``, forward, cross-entropy loss, backward and ``AdamW.step`` on this
rank's part (over dp_shard) of a global batch of ``batch`` sequences of ``seq`` tokens.
Every variant runs ``warmup`` untimed steps, one untimed step that counts collectives and
2 untimed steps that measure peak memory, then ``rounds`` x ``steps`` timed steps,
interleaved step by step: each batch goes through the variants back to back, in an order
that rotates with the batch, so changes of the machine's load hit all of them alike and
the steps of two variants on the same batch pair up. A step's time is the slowest rank's
wall time from a barrier to the end of its step; the table gives the median over every
timed step (and per round of ``steps``), the ratios also the median of the per-batch
ratios. Batch ``k`` is the same for every variant, so their losses (the global mean over
dp_shard) must agree within fp32 tolerance.

Collectives are counted in the untimed counting step, two ways:

* the ``torch.distributed`` functions, wrapped (``tests/hf_scenarios.py:count_collectives``):
  what FSDP2 and the loss code call by name;
* every ``c10d.*`` and ``_c10d_functional*.*`` op that reaches the dispatcher (a
  ``TorchDispatchMode`` that, like torch's ``CommDebugMode``, lets DTensor desugar first):
  FSDP2's all-gathers and reduce-scatters, and DTensor's redistributions (TP hooks, the
  ``distribute`` model's propagation), with their bytes and process group (mesh axis).

Bytes per collective are the bytes of its whole buffer (an all-gather's output, a
reduce-scatter's input, an all-reduce's tensor); "sent per rank" estimates what a ring
algorithm sends: (n-1)/n of the buffer for all-gather and reduce-scatter, 2(n-1)/n for
all-reduce, for a group of n ranks.

``--model moe``: the example MoE (``examples/models/moe.py`` as Hugging Face Qwen3-MoE
computes it, each expert on its routed rows: ``sparse_experts``) on two views of the same
ranks, dense ``(fsdp, tp)`` and expert ``(ep, efsdp)``, from
``specs/deepseek_moe_folded.shard`` sized to the run (:func:`moe_spec_text`). Two variants:

* ``parallelize``: shardspec's side, ``layout.parallelize(model, views)``: the spec's TP
  styles on the dense view's tp, ``shardspec.runtime.expert_parallel``'s
  ``ExpertParallel`` on the experts over ep, ``fully_shard`` per view's fsdp axis;
* ``handwritten``: ``bench/moe_handwritten.py``, what a torchtitan user writes by hand,
  with its own all-to-all ``ExpertParallel``.

Both also run a gradient check (batch 0, no update) against one process on the whole
batch, and the report sets the all-to-all bytes of the routed rows against their floor
(each rank's tokens x top-k x hidden x 4 bytes, dispatched and combined, forward and
backward, per layer). All-to-all bytes are what a rank sends (its share for itself
included); the int64 count exchanges are counted apart (``all_to_all_counts``).

Peak memory per rank: on CPU (always, under ``run_ranks``) the growth of the process's
peak resident set during one step: before the step ``gc.collect()`` and ``malloc_trim(0)``,
the peak (``VmHWM``) is reset to the current RSS through ``/proc/self/clear_refs``, and
after it ``VmHWM - VmRSS(at the reset)`` is read (the larger of the 2 memory steps; the
timed steps do not pay for the heap trim). It includes every transient buffer
(activations, gradients, unsharded parameters, communication buffers, AdamW's
temporaries) but not what lives across steps (parameters and AdamW state, listed apart as
"state"). On CUDA it would report ``torch.cuda.max_memory_allocated`` growth instead.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import functools
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# 21M parameters (84 MB in fp32): 4 layers of dim 512, 4 heads of 128 in 2 GQA groups (one
# per tp rank), SwiGLU ffn 1536, vocabulary 8192.
MODEL: dict[str, int] = dict(
    vocab_size=8192, dim=512, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=128, ffn_dim=1536
)
WORLD = 4
TP = 2
SEQ = 128
BATCH = 8  # global batch (sequences), split over dp_shard
LR = 1e-3
VARIANTS = ("parallelize", "handwritten", "distribute")
SHORT = {"parallelize": "parallelize", "handwritten": "hand-written", "distribute": "distribute"}
LABELS = {
    "parallelize": "`parallelize` (generated)",
    "handwritten": "hand-written torchtitan-style",
    "distribute": "`distribute` only (DTensor dispatch)",
}
# The MoE variant (--model moe): the example MoE (examples/models/moe.py) as Hugging Face
# Qwen3-MoE computes it (no hyper-connection head), each expert on its routed rows only
# (sparse_experts): 2 layers of dim 256, 4 heads of 64 in 2 GQA groups, 8 experts of ffn 512,
# top-2, vocabulary 4096. Folded: dense (fsdp, tp 2), expert (ep 2, efsdp).
MOE_MODEL: dict[str, int] = dict(
    vocab_size=4096,
    dim=256,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    moe_ffn_dim=512,
    n_experts=8,
    top_k=2,
)
EP = 2
MOE_SPEC_NAME = "moe_bench"
MOE_VARIANTS = ("parallelize", "handwritten")
# Model kind -> (default config, variants).
KINDS: dict[str, tuple[dict[str, int], tuple[str, ...]]] = {
    "llama": (MODEL, VARIANTS),
    "moe": (MOE_MODEL, MOE_VARIANTS),
}
MOE_LABELS = {
    "parallelize": "shardspec `parallelize` on views",
    "handwritten": "hand-written torchtitan-style EP",
}
TARGET_TIME = 1.05  # parallelize / hand-written, step time
MEMORY_STEPS = 2  # untimed steps per variant that measure peak memory
SPEC_NAME = "llama_bench"
# c10d ops that do not talk to another rank.
_LOCAL_OPS = ("wait_tensor", "_wrap_tensor_autograd")
# Op names (c10d and functional) by collective kind.
_KINDS = (
    ("reduce_scatter", "reduce_scatter"),
    ("all_gather", "all_gather"),
    ("all_gather", "allgather"),
    ("all_reduce", "all_reduce"),
    ("all_reduce", "allreduce"),
    ("all_to_all", "all_to_all"),
    ("all_to_all", "alltoall"),
    ("broadcast", "broadcast"),
)
# torch.distributed functions beyond tests/hf_scenarios.py's list (wrapped where present).
EXTRA_COLLECTIVES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_coalesced",
    "all_gather_into_tensor_coalesced",
    "all_reduce_coalesced",
    "reduce_scatter_tensor_coalesced",
)
# Bytes a ring algorithm sends per rank, as a multiple of (n - 1) / n of the buffer.
_RING = {
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "all_reduce": 2.0,
    "all_to_all": 1.0,
    "all_to_all_counts": 1.0,
}


def model_config(
    dim: int = 512,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int | None = None,
    vocab: int = 8192,
) -> dict[str, int]:
    """A Llama config with ``heads`` heads of ``dim // heads`` and an ffn of ``3 * dim``."""
    if dim % heads:
        raise ValueError(f"dim ({dim}) must divide by heads ({heads})")
    return dict(
        vocab_size=vocab,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=dim // heads,
        ffn_dim=ffn if ffn is not None else 3 * dim,
    )


# ----------------------------------------------------------------------------- the spec


def spec_text(model_cfg: dict[str, int]) -> str:
    """specs/llama.shard without its manifest and hf block, the fused q/k/v rule's groups
    set to this model's heads."""
    from examples.models.llama import LlamaConfig

    cfg = LlamaConfig(**model_cfg)
    text = _without_manifest((REPO / "specs" / "llama.shard").read_text(encoding="utf-8"))
    fuse = re.compile(r"fuse qkv as \d+ groups of q \d+, k \d+, v \d+")
    if not fuse.search(text):
        raise RuntimeError("specs/llama.shard has no `fuse qkv as N groups of ...` line")
    q, k = cfg.q_per_group * cfg.head_dim, cfg.head_dim
    return fuse.sub(f"fuse qkv as {cfg.n_kv_heads} groups of q {q}, k {k}, v {k}", text)


def _without_manifest(text: str) -> str:
    text = re.sub(r'(?m)^manifest "[^"]*"\n', "", text)
    return re.sub(r'(?ms)^hf "[^"]*" \{.*?^\}\n?', "", text)


def moe_spec_text(world: int = WORLD, tp: int = TP, ep: int = EP) -> str:
    """specs/deepseek_moe_folded.shard without its manifest and hf block, its views sized to
    this run: dense (fsdp, tp ``tp``) and expert (ep ``ep``, efsdp) over ``world`` ranks."""
    text = _without_manifest(
        (REPO / "specs" / "deepseek_moe_folded.shard").read_text(encoding="utf-8")
    )
    subs = (
        (r"(?m)^mesh dense over \d+ ranks \{", f"mesh dense over {world} ranks {{"),
        (r"(?m)^(    tp: )\d+$", rf"\g<1>{tp}"),
        (r"(?m)^(    ep: )\d+$", rf"\g<1>{ep}"),
    )
    for pattern, repl in subs:
        text, n = re.subn(pattern, repl, text)
        if n != 1:
            raise RuntimeError(f"specs/deepseek_moe_folded.shard: no single {pattern!r} line")
    return text


def compile_spec(model_cfg: dict[str, int], out_dir: str) -> str:
    """Compile :func:`spec_text` with the real CLI into ``out_dir``; the module's name."""
    return compile_text(spec_text(model_cfg), SPEC_NAME, out_dir)


def compile_text(text: str, name: str, out_dir: str) -> str:
    """Compile spec ``text`` as ``<name>.shard`` with the real CLI into ``out_dir``; the
    generated module's name."""
    from shardspec.cli import main as shardspec_main

    spec = Path(out_dir) / f"{name}.shard"
    spec.write_text(text, encoding="utf-8")
    with contextlib.redirect_stdout(sys.stderr):
        rc = shardspec_main(["compile", str(spec), "-o", out_dir])
    if rc != 0:
        raise RuntimeError(f"shardspec compile {spec} failed ({rc})")
    return name


# --------------------------------------------------------------------------- variants


def interleave_w13(w13: Any, tp: int) -> Any:
    """The rows of a fused ``[gate; up]`` reordered ``[gate_0; up_0; gate_1; up_1; ...]``,
    so that a contiguous split in ``tp`` parts gives TP rank r ``[gate_r; up_r]``."""
    import torch

    gate, up = w13.chunk(2, dim=0)
    parts = [t for r in range(tp) for t in (gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r])]
    return torch.cat(parts, dim=0)


def handwritten(model: Any, mesh: Any) -> Any:
    """torchtitan's way, by hand: ``parallelize_module`` on tp with torch's styles, then
    ``fully_shard`` per block and the root on dp_shard.

    torch's ``ColwiseParallel`` cuts the fused ``w13`` contiguously: on the model's
    ``[gate; up]`` rows TP rank 0 would hold all of gate and none of up, and the module's
    forward (which splits its local output in halves) would compute another function. So,
    as a hand-written trainer with a fused gate/up does (Megatron's checkpoint converters
    do the same), the rows are first interleaved per TP rank (:func:`interleave_w13`).
    Then each rank's contiguous shard is ``[gate_r; up_r]``: the same local values and the
    same communication as the spec's per-component ``_StridedShard``, but a different
    global layout (``verify`` names the w13s)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh["tp"].size()
    with torch.no_grad():
        for block in model.layers.values():
            w13 = block.feed_forward.w13.weight
            w13.copy_(interleave_w13(w13, tp))
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    for name in model.layers:
        plan[f"layers.{name}.attention.wqkv"] = ColwiseParallel()
        plan[f"layers.{name}.attention.wo"] = RowwiseParallel()
        plan[f"layers.{name}.feed_forward.w13"] = ColwiseParallel()  # rows interleaved above
        plan[f"layers.{name}.feed_forward.w2"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    w13s = {id(b.feed_forward.w13.weight) for b in model.layers.values()}

    def placement(param: Any) -> Any:
        return Shard(1) if id(param) in w13s else Shard(0)

    dp = mesh["dp_shard"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp, shard_placement_fn=placement)
    fully_shard(model, mesh=dp, shard_placement_fn=placement)
    return model


# ----------------------------------------------------------------------- measurements


def _tensor_bytes(x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def _kind(name: str) -> str:
    for kind, needle in _KINDS:
        if needle in name:
            return kind
    return name


@contextlib.contextmanager
def count_calls() -> Iterator[dict[str, int]]:
    """``tests/hf_scenarios.py:count_collectives`` (the ``torch.distributed`` functions,
    wrapped), also wrapping the functions FSDP2 calls in torch 2.13
    (``all_gather_single``, ``reduce_scatter_single``), which its list predates."""
    from unittest import mock

    from tests import hf_scenarios

    names = hf_scenarios.COLLECTIVES + tuple(
        n for n in EXTRA_COLLECTIVES if n not in hf_scenarios.COLLECTIVES
    )
    with mock.patch.object(hf_scenarios, "COLLECTIVES", names):
        with hf_scenarios.count_collectives() as calls:
            yield calls


@contextlib.contextmanager
def count_dispatched(
    axes: dict[str, str], sequence: list[tuple[str, int]] | None = None
) -> Iterator[dict[str, dict[str, float]]]:
    """Every collective op reaching the dispatcher while the block runs:
    ``{"<kind> <axis>": {"calls", "bytes", "sent"}}`` and ``{"op:<op name>": {"calls"}}``.

    ``axes`` names process groups (group name -> mesh axis). Like torch's
    ``CommDebugMode``, the mode returns ``NotImplemented`` for DTensor arguments, so that
    DTensor runs first and its collectives come back through the mode. ``sequence``, if
    given, receives every collective in order as ``("<kind> <axis>", buffer bytes)``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    out: dict[str, dict[str, float]] = {}

    def group_of(args: tuple) -> tuple[str, int]:
        for a in args:
            if isinstance(a, torch.ScriptObject):  # c10d ops take the boxed ProcessGroup
                with contextlib.suppress(Exception):
                    pg = dist.ProcessGroup.unbox(a)
                    return pg.group_name, pg.size()
            if isinstance(a, dist.ProcessGroup):
                return a.group_name, a.size()
        for a in reversed(args):  # functional collectives end with the group's name
            if isinstance(a, str):
                with contextlib.suppress(Exception):
                    pg = _resolve_process_group(a)
                    return pg.group_name, pg.size()
        return "?", 0

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            if any(t is DTensor for t in types):
                return NotImplemented
            result = func(*args, **(kwargs or {}))
            name = str(func).removesuffix(".default")
            if "c10d" in func.namespace and not any(s in name for s in _LOCAL_OPS):
                group, n = group_of(tuple(args) + tuple((kwargs or {}).values()))
                buffer = max([_tensor_bytes(a) for a in args] + [_tensor_bytes(result)])
                kind = _kind(name)
                if kind == "all_to_all":
                    # What this rank sends (its share for itself included): c10d's
                    # alltoall_base_(output, input, ...), functional all_to_all_single(input,
                    # ...). The exchanges of int64 counts are told apart from the rows.
                    sent_tensor = args[1] if "alltoall_base" in name else args[0]
                    buffer = _tensor_bytes(sent_tensor)
                    if not sent_tensor.is_floating_point():
                        kind = "all_to_all_counts"
                sent = buffer * _RING.get(kind, 1.0) * (n - 1) / n if n else 0.0
                key = f"{kind} {axes.get(group, f'group of {n}')}"
                row = out.setdefault(key, {"calls": 0, "bytes": 0, "sent": 0.0})
                row["calls"] += 1
                row["bytes"] += buffer
                row["sent"] += sent
                op = out.setdefault(f"op:{name}", {"calls": 0})
                op["calls"] += 1
                if sequence is not None:
                    sequence.append((key, buffer))
            return result

    with Mode():
        yield out


def _status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else 0


class PeakMemory:
    """Peak memory growth over a block: RSS high-water mark on CPU (reset through
    ``/proc/self/clear_refs``), ``torch.cuda.max_memory_allocated`` on CUDA."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.kind = "cuda max_memory_allocated" if cuda else "peak RSS (VmHWM) growth"
        try:
            self._trim: Callable[[int], int] | None = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:
            self._trim = None

    def start(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        if self._trim is not None:
            self._trim(0)
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        self.base = _status_kb("VmRSS") * 1024

    def stop(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status_kb("VmHWM") * 1024 - self.base


def _local_bytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def state_bytes(model: Any, optim: Any) -> int:
    """This rank's bytes of parameters and optimizer state (what lives across steps)."""
    import torch

    n = sum(_local_bytes(p) for p in model.parameters())
    for st in optim.state.values():
        n += sum(_local_bytes(v) for v in st.values() if isinstance(v, torch.Tensor))
    return n


# ----------------------------------------------------------------------------- ranks


def batch(step: int, vocab: int, size: int, seq: int) -> Any:
    """Global batch ``step``: ``size`` sequences of ``seq + 1`` token ids (inputs and
    next-token targets), the same on every rank and for every variant."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (size, seq + 1), generator=gen)


def _gathered_lookup(emb: Any, ids: Any) -> Any:
    """The distribute variant's embedding: the lookup in the whole (replicated) table."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate

    w = emb.weight
    return F.embedding(ids, w.redistribute(w.device_mesh, [Replicate()] * w.device_mesh.ndim))


def _rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank: every variant built, warmed up, counted and timed (:func:`_measure`)."""
    from shardspec.testing import clear_dtensor_caches

    res = _measure(opts)
    # Nothing of the meshes, groups or DTensors may outlive this function: run_ranks checks
    # that no gloo thread survives its teardown, and DTensor's caches hold meshes.
    clear_dtensor_caches()
    gc.collect()
    return res


@dataclasses.dataclass
class Setup:
    """One rank's variants, built on a model kind's meshes (:data:`SETUPS`)."""

    models: dict[str, tuple[Any, Any]]  # variant -> (model, AdamW)
    dp_mesh: Any  # the data-parallel mesh axis: batches are split, losses averaged over it
    mesh: Any  # the DeviceMesh the distribute variant's inputs live on (llama only)
    axes: dict[str, str]  # process group name -> mesh axis (for the collective counts)
    device_type: str
    reference: Callable[[], Any] | None = None  # the unparallelized model (gradient check)


def _axis_names(axes: dict[str, str], named: list[tuple[str, Any]]) -> dict[str, str]:
    """``axes`` with each ``(axis, 1-D DeviceMesh)``'s process group named; a group that
    serves several axes (the same ranks in two views) gets ``"a/b"``."""
    for axis, mesh in named:
        group = mesh.get_group().group_name
        seen = axes.get(group)
        if seen is None or seen == "world":
            axes[group] = axis
        elif axis not in seen.split("/"):
            axes[group] = f"{seen}/{axis}"
    return axes


def _builder(
    factory: Callable[..., Any], init_weights: Callable[[Any, int], None], cfg: dict[str, Any]
) -> Callable[[], Any]:
    """A function that builds the model ``factory(**cfg)`` with the same initial values
    every time (``init_weights(model, 0)``)."""

    def build() -> Any:
        import torch

        torch.manual_seed(0)
        model = factory(**cfg)
        init_weights(model, 0)
        return model

    return build


def _setup_llama(opts: dict[str, Any], layout: Any) -> Setup:
    """The Llama's three variants on ``dp_shard x tp``."""
    import torch
    import torch.distributed as dist

    from examples.models import llama

    cfg = opts["model"]
    mesh = layout.build_mesh(tp=opts["tp"])
    dp_mesh = mesh["dp_shard"]
    axes = {dist.group.WORLD.group_name: "world"}  # a mesh axis spanning the world wins
    _axis_names(axes, [("dp_shard", dp_mesh), ("tp", mesh["tp"])])

    build = _builder(llama.tiny, llama.init_weights, cfg)
    models = {}
    for v in opts["variants"]:
        model = build()
        if v == "parallelize":
            layout.parallelize(model, mesh)
            layout.verify(model, mesh)
        elif v == "handwritten":
            handwritten(model, mesh)
        else:
            layout.distribute(model, mesh)
            layout.verify(model, mesh)
            # An embedding sharded on the vocabulary alone (dp_shard 1: a size-1 axis is
            # Replicate) makes torch's dispatch give a _MaskPartial output, whose mask torch
            # 2.13 releases at its first reduction (the residual stream's second use fails)
            # and whose backward it cannot redistribute (pytorch/pytorch#130725's family):
            # look up in the gathered table instead, as torch did for the strided layout.
            model.tok_embeddings.forward = functools.partial(_gathered_lookup, model.tok_embeddings)
        models[v] = (model, torch.optim.AdamW(model.parameters(), lr=LR))
    return Setup(models, dp_mesh, mesh, axes, mesh.device_type)


def _setup_moe(opts: dict[str, Any], layout: Any) -> Setup:
    """The MoE's two variants on the folded views: shardspec's side
    (``layout.parallelize(model, views)``) and the hand-written torchtitan-style one."""
    import torch
    import torch.distributed as dist

    from bench import moe_handwritten
    from examples.models import moe

    cfg = opts["model"]
    views = layout.build_mesh(tp=opts["tp"], ep=opts["ep"])
    dense, expert = views["dense"], views["expert"]
    axes = {dist.group.WORLD.group_name: "world"}

    build = _builder(moe.tiny_qwen3, moe.init_weights, {"sparse_experts": True, **cfg})
    models = {}
    for v in opts["variants"]:
        model = build()
        if v == "parallelize":
            layout.parallelize(model, views)  # the spec states the q/k norms' style
            dmesh, smesh = dense, expert
        elif v == "handwritten":
            dmesh, smesh = moe_handwritten.build_meshes(
                dense.size(), opts["tp"], opts["ep"], dense.device_type
            )
            moe_handwritten.parallelize_moe(model, dmesh, smesh)
        else:
            raise ValueError(f"the moe model has no {v!r} variant")
        _axis_names(axes, [(a, dmesh[a]) for a in ("fsdp", "tp")])
        _axis_names(axes, [(a, smesh[a]) for a in ("ep", "efsdp")])
        models[v] = (model, torch.optim.AdamW(model.parameters(), lr=LR))
    return Setup(models, dense["fsdp"], dense, axes, dense.device_type, reference=build)


SETUPS: dict[str, Callable[[dict[str, Any], Any], Setup]] = {
    "llama": _setup_llama,
    "moe": _setup_moe,
}


def grad_norms(model: Any) -> dict[str, float]:
    """Every parameter's gradient norm (of the whole gradient, gathered where sharded)."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        g = g.full_tensor() if isinstance(g, DTensor) else g
        out[name] = float(torch.linalg.vector_norm(g.float()))
    return out


def _measure(opts: dict[str, Any]) -> dict[str, Any]:
    """Build the variants on this rank; warm up, count, measure memory, time."""
    import importlib
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # DTensor warns at every suboptimal redistribution of the distribute-only model, and
    # FSDP2 that the root returns a view (the logits; nothing modifies them in place).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    torch.set_num_threads(opts["threads"])
    if opts["build_dir"] not in sys.path:
        sys.path.insert(0, opts["build_dir"])
    phases: dict[str, float] = {}
    t_phase = time.perf_counter()
    layout = importlib.import_module(opts["module"])
    cfg = opts["model"]
    setup = SETUPS[opts.get("kind", "llama")](opts, layout)
    models, dp_mesh, mesh, axes = setup.models, setup.dp_mesh, setup.mesh, setup.axes
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    memory = PeakMemory(cuda=setup.device_type == "cuda")
    phases["setup"] = time.perf_counter() - t_phase

    def sdpa(v: str) -> Any:
        if opts["sdpa"] == "math" or v == "distribute":
            return sdpa_kernel(SDPBackend.MATH)
        return contextlib.nullcontext()

    def step(v: str, tokens: Any, update: bool = True) -> Any:
        """One training step of variant ``v`` on this rank's part of ``tokens`` (without
        ``update``: forward and backward only, the gradients kept); its loss."""
        model, optim = models[v] if v in models else (setup.reference(), None)  # type: ignore[misc]
        part = tokens.chunk(dp)[dp_rank] if v in models else tokens
        inputs, targets = part[:, :-1].contiguous(), part[:, 1:].contiguous()
        model.zero_grad(set_to_none=True)
        if v == "distribute":
            place = [Shard(0), Replicate()]
            inputs = DTensor.from_local(inputs, mesh, place, run_check=False)
            targets = DTensor.from_local(targets, mesh, place, run_check=False)
            ctx: Any = implicit_replication()
        else:
            ctx = contextlib.nullcontext()
        with ctx, sdpa(v):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            if optim is not None and update:
                optim.step()
        if not update:
            res["grad_norms"][v] = grad_norms(model)
            model.zero_grad(set_to_none=True)
        loss = loss.detach()
        return loss.to_local() if isinstance(loss, DTensor) else loss  # global mean: Replicate

    res: dict[str, Any] = {
        v: {"times": [], "cpu": [], "memory": [], "losses": []} for v in opts["variants"]
    }
    k = 0
    losses: dict[str, list[Any]] = {v: [] for v in opts["variants"]}

    def timed(v: str, tokens: Any) -> None:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses[v].append(step(v, tokens))
        res[v]["times"].append(time.perf_counter() - t0)
        res[v]["cpu"].append(time.process_time() - c0)

    vocab = cfg["vocab_size"]
    if setup.reference is not None:
        # Gradient check: batch 0's gradients (no update) of every variant and of the
        # unparallelized model on the whole batch, in one process (every rank alike).
        res["grad_norms"] = {}
        tokens = batch(0, vocab, opts["batch"], opts["seq"])
        for v in (*opts["variants"], "reference"):
            step(v, tokens, update=False)
    # Warm-up, then the counting step, every variant on the same batches.
    for _ in range(opts["warmup"]):
        tokens = batch(k, vocab, opts["batch"], opts["seq"])
        for v in opts["variants"]:
            t_phase = time.perf_counter()
            losses[v].append(step(v, tokens))
            phases[f"warmup {v}"] = phases.get(f"warmup {v}", 0.0) + time.perf_counter() - t_phase
        k += 1
    tokens = batch(k, vocab, opts["batch"], opts["seq"])
    for v in opts["variants"]:
        dist.barrier()
        t_phase = time.perf_counter()
        sequence: list[tuple[str, int]] = []
        with count_calls() as calls, count_dispatched(axes, sequence) as seen:
            losses[v].append(step(v, tokens))
        res[v]["sequence"] = sequence
        phases[f"count {v}"] = time.perf_counter() - t_phase
        res[v]["calls"] = dict(calls)
        res[v]["dispatched"] = {key: dict(row) for key, row in seen.items()}
    k += 1
    # Peak memory: MEMORY_STEPS untimed steps per variant, each between a reset of the
    # high-water mark and its reading (the reset trims the heap, which the timed steps
    # must not pay for).
    for _ in range(MEMORY_STEPS):
        tokens = batch(k, vocab, opts["batch"], opts["seq"])
        for v in opts["variants"]:
            dist.barrier()
            memory.start()
            losses[v].append(step(v, tokens))
            res[v]["memory"].append(memory.stop())
        k += 1
    # Timed steps, interleaved step by step: batch k goes through every variant in turn
    # (the order rotates with k), so slow changes of the machine's load hit all alike and
    # neighbouring steps of two variants pair up.
    t_phase = time.perf_counter()
    order = list(opts["variants"])
    for _ in range(opts["rounds"] * opts["steps"]):
        tokens = batch(k, vocab, opts["batch"], opts["seq"])
        turn = order[k % len(order) :] + order[: k % len(order)]
        for v in turn:
            timed(v, tokens)
        k += 1
    dist.barrier()
    phases["timed"] = time.perf_counter() - t_phase
    res["phases"] = phases
    for v in opts["variants"]:
        model, optim = models[v]
        res[v]["state"] = state_bytes(model, optim)
        values = torch.stack([t.reshape(()) for t in losses[v]]).float()
        if v != "distribute":  # each dp rank's mean over as many tokens: mean of means
            dist.all_reduce(values, group=dp_mesh.get_group())
            values /= dp
        res[v]["losses"] = values.tolist()
    res["memory_kind"] = memory.kind
    res["threads"] = torch.get_num_threads()
    return res


# ------------------------------------------------------------------------------- run


def run(
    model: dict[str, int] | None = None,
    *,
    world: int = WORLD,
    tp: int = TP,
    steps: int = 10,
    warmup: int = 3,
    rounds: int = 3,
    seq: int = SEQ,
    batch_size: int = BATCH,
    sdpa: str = "math",
    threads: int | None = None,
    variants: tuple[str, ...] | None = None,
    timeout: float = 600.0,
    kind: str = "llama",
    ep: int = EP,
) -> dict[str, Any]:
    """Run the benchmark on ``world`` gloo ranks; every rank's numbers, and the options.
    ``kind``: ``"llama"`` (``model`` a Llama config, mesh dp_shard x tp) or ``"moe"``
    (``model`` overrides of the example MoE's config, views dense (fsdp, tp) and expert
    (ep, efsdp); variants parallelize and handwritten)."""
    from shardspec.testing import run_ranks

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: choose from {', '.join(KINDS)}")
    default_model, allowed = KINDS[kind]
    variants = allowed if variants is None else variants
    if any(v not in allowed for v in variants):
        raise ValueError(f"{kind} variants: choose from {', '.join(allowed)}")
    cfg = dict(model if model is not None else default_model)
    if batch_size % (world // tp):
        raise ValueError(f"batch ({batch_size}) must divide by dp_shard ({world // tp})")
    with tempfile.TemporaryDirectory(prefix="shardspec-bench-train-") as build_dir:
        if kind == "moe":
            module = compile_text(moe_spec_text(world, tp, ep), MOE_SPEC_NAME, build_dir)
        else:
            module = compile_spec(cfg, build_dir)
        opts = dict(
            kind=kind,
            model=cfg,
            tp=tp,
            ep=ep,
            steps=steps,
            warmup=warmup,
            rounds=rounds,
            seq=seq,
            batch=batch_size,
            sdpa=sdpa,
            threads=threads or max(1, (os.cpu_count() or 1) // world),
            variants=tuple(variants),
            build_dir=build_dir,
            module=module,
        )
        ranks = run_ranks(_rank, world, opts, timeout=timeout)
    return {"options": {k: v for k, v in opts.items() if k != "build_dir"}, "ranks": ranks}


def summary(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per variant: step times (the slowest rank's, per step), counts, bytes, memory."""
    ranks = res["ranks"]
    variants = res["options"]["variants"]
    steps = res["options"]["steps"]
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        per_step = [max(t) for t in zip(*(r[v]["times"] for r in ranks), strict=True)]
        cpu = [sum(c) for c in zip(*(r[v]["cpu"] for r in ranks), strict=True)]
        rounds = [per_step[i : i + steps] for i in range(0, len(per_step), steps)]
        seen = ranks[0][v]["dispatched"]
        colls = {k: row for k, row in seen.items() if not k.startswith("op:")}
        out[v] = {
            "times": per_step,
            "cpu_steps": cpu,
            "median": statistics.median(per_step),
            "best": min(per_step),
            "round_medians": [statistics.median(x) for x in rounds],
            "cpu": statistics.median(cpu),
            "calls": ranks[0][v]["calls"],
            "collectives": colls,
            "ops": {k[3:]: row["calls"] for k, row in seen.items() if k.startswith("op:")},
            "n_collectives": sum(row["calls"] for row in colls.values()),
            "bytes": sum(row["bytes"] for row in colls.values()),
            "sent": sum(row["sent"] for row in colls.values()),
            "same_on_every_rank": all(
                _comparable(r[v]["dispatched"]) == _comparable(seen) for r in ranks
            ),
            # The routed rows each rank sends (routing-dependent: summed over the ranks).
            "all_to_all_bytes": sum(
                r[v]["dispatched"].get(k, {}).get("bytes", 0)
                for r in ranks
                for k in r[v]["dispatched"]
                if k.startswith("all_to_all ")
            ),
            "grad_gap": grad_gap(ranks[0], v) if "grad_norms" in ranks[0] else None,
            "sequence": [tuple(x) for x in ranks[0][v]["sequence"]],
            "memory": [max(r[v]["memory"]) for r in ranks],
            "state": [r[v]["state"] for r in ranks],
            "losses": ranks[0][v]["losses"],
        }
    return out


def _comparable(seen: dict[str, dict[str, float]]) -> dict[str, Any]:
    """A rank's counts as they must agree between ranks: every collective's calls, and the
    bytes of all but the all-to-alls (whose rows follow the routing)."""
    return {k: row["calls"] if k.startswith("all_to_all") else row for k, row in seen.items()}


def grad_gap(rank: dict[str, Any], v: str) -> float:
    """The largest relative difference of a parameter's gradient norm between variant
    ``v`` and the unparallelized model (the gradient check on batch 0)."""
    got, want = rank["grad_norms"][v], rank["grad_norms"]["reference"]
    if set(got) != set(want):
        raise RuntimeError(f"{v}: gradients of {sorted(set(got) ^ set(want))} missing")
    return max(abs(got[k] - w) / max(w, 1e-12) for k, w in want.items())


def all_to_all_floor(options: dict[str, Any], world: int) -> int:
    """The bytes the routed rows must travel per step, summed over the ranks: each rank's
    tokens x top-k x hidden x 4 (fp32), dispatched and combined, forward and backward, per
    MoE layer."""
    cfg = {**MOE_MODEL, **options["model"]}
    tokens = options["batch"] // (world // options["tp"]) * options["seq"]
    per_rank = tokens * cfg["top_k"] * cfg["dim"] * 4 * 2 * 2 * cfg["n_layers"]
    return int(world * per_rank)


def ratios(s: dict[str, dict[str, Any]], a: str, b: str) -> dict[str, float]:
    """``a`` against ``b``: the ratio of the step-time medians, the median and quartiles of
    the per-step ratios (batch k of ``a`` over batch k of ``b``, run back to back), and the
    ratio of the CPU medians."""
    pairs = sorted(x / y for x, y in zip(s[a]["times"], s[b]["times"], strict=True))
    q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    return {
        "median": s[a]["median"] / s[b]["median"],
        "paired": statistics.median(pairs),
        "paired_q1": q[0],
        "paired_q3": q[2],
        "cpu": s[a]["cpu"] / s[b]["cpu"],
    }


def same_sequence(a: list[tuple[str, int]], b: list[tuple[str, int]]) -> str:
    """A sentence comparing two steps' collectives in order (parallelize, hand-written)."""
    if a == b:
        return (
            f"Order: parallelize and hand-written issue the same {len(a)} collectives in the "
            "same order, each with the same buffer size and group."
        )
    pairs = enumerate(zip(a, b, strict=False))
    i = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
    x = a[i] if i < len(a) else "nothing"
    y = b[i] if i < len(b) else "nothing"
    return (
        f"Order: the collectives differ from #{i + 1} on (of {len(a)} and {len(b)}): "
        f"parallelize {x}, hand-written {y}."
    )


def loss_gap(s: dict[str, dict[str, Any]], a: str, b: str) -> float:
    """The largest relative difference of two variants' losses over every step."""
    return max(
        abs(x - y) / max(1.0, abs(y)) for x, y in zip(s[a]["losses"], s[b]["losses"], strict=True)
    )


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _ms(t: float) -> str:
    return f"{t * 1e3:,.0f} ms"


def _sdpa_text(o: dict[str, Any]) -> str:
    if o["sdpa"] == "math":
        return "math backend for every variant"
    return "default kernel (math for distribute)"


def _model_line(o: dict[str, Any], world: int) -> str:
    """The model and the mesh, in words."""
    import torch

    if o.get("kind") == "moe":
        from examples.models import moe

        cfg = moe.MoEConfig(**{**MOE_MODEL, **o["model"], "hc_mult": 0})
        with torch.device("meta"):
            n_params = sum(p.numel() for p in moe.MoETransformer(cfg).parameters())
        tp, ep = o["tp"], o["ep"]
        return (
            f"Model: the example MoE as Qwen3-MoE computes it (examples/models/moe.py, "
            f"hc_mult 0, sparse_experts: each expert on its routed rows) {o['model']} "
            f"({n_params:,} parameters, fp32); {world} gloo ranks on the CPU, views dense "
            f"fsdp {world // tp} x tp {tp} and expert ep {ep} x efsdp {world // ep} over the "
            "same ranks;"
        )
    from examples.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        n_params = sum(p.numel() for p in Llama(LlamaConfig(**o["model"])).parameters())
    return (
        f"Model: Llama {o['model']} ({n_params:,} parameters, fp32); {world} gloo ranks on "
        f"the CPU, mesh dp_shard {world // o['tp']} x tp {o['tp']},"
    )


def _moe_lines(o: dict[str, Any], s: dict[str, dict[str, Any]], world: int) -> list[str]:
    """All-to-all bytes against the floor, and the gradient check, per variant."""
    floor = all_to_all_floor(o, world)
    rows = "; ".join(
        f"{SHORT[v]} {_mb(s[v]['all_to_all_bytes'])} ({s[v]['all_to_all_bytes'] / floor:.3f}x)"
        for v in o["variants"]
    )
    grads = "; ".join(f"{SHORT[v]} {s[v]['grad_gap']:.1e}" for v in o["variants"])
    return [
        f"All-to-all of the routed rows per step, summed over the {world} ranks: {rows}; "
        f"the floor (each rank's tokens x top-k x hidden x 4 bytes, dispatch and combine, "
        f"forward and backward, per layer) {_mb(floor)}.  ",
        "Gradients (batch 0, before any update) against one process on the whole batch: "
        f"largest relative difference of a parameter's gradient norm {grads}.  ",
    ]


def report(res: dict[str, Any]) -> list[str]:
    """Markdown lines: set-up, the tables, ratios, the target."""
    o = res["options"]
    s = summary(res)
    variants = o["variants"]
    world = len(res["ranks"])
    moe = o.get("kind") == "moe"
    labels = {**LABELS, **(MOE_LABELS if moe else {})}
    n_timed = o["rounds"] * o["steps"]
    lines = [
        f"{_model_line(o, world)} {res['ranks'][0]['threads']} torch thread(s) per rank; "
        f"global batch {o['batch']} x {o['seq']} tokens; AdamW (lr {LR}); SDPA {_sdpa_text(o)}.",
        f"Per variant, untimed: {o['warmup']} warm-up steps, 1 counting step, "
        f"{MEMORY_STEPS} memory steps; then {n_timed} timed steps ({o['rounds']} rounds x "
        f"{o['steps']}), interleaved: each batch goes through the variants back to back, "
        "the order rotating with the batch.",
        "Step time: the slowest rank's, from a barrier to the end of its step; median and "
        f"best over the {n_timed} timed steps, and the median of each round's {o['steps']}. "
        "CPU: the process time of all ranks, summed, median per step. Peak memory: "
        f"{res['ranks'][0]['memory_kind']} during one step (the larger of the "
        f"{MEMORY_STEPS} memory steps), max over ranks; state: parameters + AdamW state "
        "per rank.",
        "",
        "| variant | step time median | best | round medians | CPU s/step (all ranks) "
        "| collectives/step | bytes/step (buffers) | sent/rank/step (ring est.) "
        "| peak memory growth/rank | state/rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        x = s[v]
        lines.append(
            f"| {labels[v]} | {_ms(x['median'])} | {_ms(x['best'])} | "
            f"{' / '.join(_ms(t) for t in x['round_medians'])} | {x['cpu']:.2f} | "
            f"{x['n_collectives']} | {_mb(x['bytes'])} | {_mb(x['sent'])} | "
            f"{_mb(max(x['memory']))} | {_mb(max(x['state']))} |"
        )
    lines += [
        "",
        "| collectives per step, per rank (counting step) | by kind and mesh axis "
        "(calls; buffer bytes) | torch.distributed functions (wrapped) |",
        "|---|---|---|",
    ]
    for v in variants:
        x = s[v]
        kinds = "; ".join(
            f"{k} {int(row['calls'])} ({_mb(row['bytes'])})"
            for k, row in sorted(x["collectives"].items())
        )
        calls = ", ".join(f"{k} {n}" for k, n in sorted(x["calls"].items())) or "0"
        same = "" if x["same_on_every_rank"] else " (differs between ranks)"
        lines.append(f"| {labels[v]} | {kinds or '0'}{same} | {calls} |")
    lines.append("")
    lines.append(
        "Dispatcher ops: "
        + "; ".join(
            f"{SHORT[v]}: " + ", ".join(f"{op} {n}" for op, n in sorted(s[v]["ops"].items()))
            for v in variants
        )
        + "."
    )
    lines.append(
        "Peak memory growth per rank: "
        + "; ".join(f"{SHORT[v]} " + ", ".join(_mb(m) for m in s[v]["memory"]) for v in variants)
        + "."
    )
    if "parallelize" in s and "handwritten" in s:
        lines.append(same_sequence(s["parallelize"]["sequence"], s["handwritten"]["sequence"]))
    lines.append("")
    for a, b in (("parallelize", "handwritten"), ("parallelize", "distribute")):
        if a not in s or b not in s:
            continue
        r, x, y = ratios(s, a, b), s[a], s[b]
        lines.append(
            f"{SHORT[a]} / {SHORT[b]}: step time {r['median']:.3f}x (medians), {r['paired']:.3f}x "
            f"(median of the per-step ratios; quartiles {r['paired_q1']:.3f} to "
            f"{r['paired_q3']:.3f}), CPU {r['cpu']:.3f}x; collectives {x['n_collectives']} / "
            f"{y['n_collectives']}; bytes {_mb(x['bytes'])} / {_mb(y['bytes'])}; peak memory "
            f"{_mb(max(x['memory']))} / {_mb(max(y['memory']))}.  "
        )
    if "parallelize" in s and "handwritten" in s:
        p, h = s["parallelize"], s["handwritten"]
        r = ratios(s, "parallelize", "handwritten")
        met_time = r["median"] <= TARGET_TIME and r["paired"] <= TARGET_TIME
        met_comm = p["n_collectives"] <= h["n_collectives"] and p["bytes"] <= h["bytes"]
        lines.append(
            f"Target (step time <= {TARGET_TIME}x hand-written, no more collectives or "
            f"bytes): step time {'met' if met_time else 'NOT met'} (both ratios), "
            f"communication {'met' if met_comm else 'NOT met'}.  "
        )
    if moe:
        lines += _moe_lines(o, s, world)
    gaps = [
        f"{SHORT[a]} vs {SHORT[b]} {loss_gap(s, a, b):.1e}"
        for i, a in enumerate(variants)
        for b in variants[i + 1 :]
    ]
    first, last = s[variants[0]]["losses"][0], s[variants[0]]["losses"][-1]
    lines.append(
        f"Losses (global mean, {len(s[variants[0]]['losses'])} steps, {first:.4f} -> "
        f"{last:.4f})" + (f": largest relative difference {', '.join(gaps)}." if gaps else ".")
    )
    return lines


def _config_from(args: argparse.Namespace) -> dict[str, int]:
    """The model config the command line asks for (the kind's defaults where it is quiet)."""
    if args.model == "llama":
        return model_config(
            args.dim or MODEL["dim"],
            args.layers or MODEL["n_layers"],
            args.heads,
            args.kv_heads,
            args.ffn,
            args.vocab or MODEL["vocab_size"],
        )
    cfg = dict(MOE_MODEL)
    given = {
        "dim": args.dim,
        "n_layers": args.layers,
        "moe_ffn_dim": args.ffn,
        "n_experts": args.experts,
        "top_k": args.top_k,
        "vocab_size": args.vocab,
    }
    cfg.update({k: v for k, v in given.items() if v is not None})
    cfg.update(n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=cfg["dim"] // args.heads)
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        choices=tuple(KINDS),
        default="llama",
        help="llama (default) or moe: the example MoE on folded views, against a "
        "hand-written torchtitan-style expert-parallel model",
    )
    ap.add_argument("--world", type=int, default=WORLD, help="ranks (default 4)")
    ap.add_argument("--tp", type=int, default=TP, help="tp size (default 2)")
    ap.add_argument("--ep", type=int, default=EP, help="ep size, moe only (default 2)")
    ap.add_argument("--dim", type=int, help="model dim (default 512; moe 256)")
    ap.add_argument("--layers", type=int, help="default 4; moe 2")
    ap.add_argument("--heads", type=int, default=MODEL["n_heads"], help="default 4")
    ap.add_argument("--kv-heads", type=int, default=MODEL["n_kv_heads"], help="default 2")
    ap.add_argument("--ffn", type=int, help="ffn dim (default 3 * dim; moe: per expert, 512)")
    ap.add_argument("--experts", type=int, help="moe: experts (default 8)")
    ap.add_argument("--top-k", type=int, help="moe: experts per token (default 2)")
    ap.add_argument("--vocab", type=int, help="default 8192; moe 4096")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence (default 128)")
    ap.add_argument("--batch", type=int, default=BATCH, help="global batch (default 8)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--sdpa", choices=("math", "default"), default="math")
    ap.add_argument("--threads", type=int, help="torch threads per rank (cores / world)")
    ap.add_argument(
        "--variants",
        help=f"comma-separated, of {', '.join(VARIANTS)} (default: all; moe: "
        f"{', '.join(MOE_VARIANTS)})",
    )
    ap.add_argument("--json", help="also write the raw numbers here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--steps and --rounds must be >= 1, --warmup >= 0")
    allowed = KINDS[args.model][1]
    text = args.variants if args.variants is not None else ",".join(allowed)
    variants = tuple(v.strip() for v in text.split(",") if v.strip())
    if not variants or any(v not in allowed for v in variants):
        ap.error(f"--variants: choose from {', '.join(allowed)}")

    import platform

    cfg = _config_from(args)
    args_text = argv if argv is not None else sys.argv[1:]
    started = time.time()
    load0 = os.getloadavg()[0]
    res = run(
        cfg,
        world=args.world,
        tp=args.tp,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        seq=args.seq,
        batch_size=args.batch,
        sdpa=args.sdpa,
        threads=args.threads,
        variants=variants,
        kind=args.model,
        ep=args.ep,
    )
    load1 = os.getloadavg()[0]
    import torch

    lines = [
        f"Command: `python -m bench.bench_train {' '.join(args_text)}`".rstrip() + "  ",
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, Linux "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}  ",
        f"Date: {datetime.date.today().isoformat()}; code: {_revision()}  ",
        f"Load: 1-minute load average {load0:.1f} before, {load1:.1f} after; whole run "
        f"{time.time() - started:.0f} s  ",
        "",
        *report(res),
    ]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    return 0


def _revision() -> str:
    from bench.bench_checkpoint import _revision as revision

    return revision()


if __name__ == "__main__":
    sys.exit(main())
