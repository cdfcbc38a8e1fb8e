"""Hugging Face load speed: the generated ``load_hf`` against two ways a user would do it.

    python -m bench.bench_hf                    # ~1 GB checkpoint, 4 ranks, 3 timed rounds
    python -m bench.bench_hf --rounds 5 --json /tmp/hf.json
    python -m bench.bench_hf --profile shardspec:cold,dcp:warm

4 gloo CPU ranks (``shardspec.testing.run_ranks``), mesh dp_shard 2 x tp 2, the Llama of
``examples/models/llama.py`` (``MODEL``: about 1 GB in fp32) distributed on the llama
spec's layout (``bench.bench_checkpoint.bench_spec``: the same rules, the q/k/v fusion's
groups set to this model's heads). A Hugging Face checkpoint of the matching
``LlamaForCausalLM`` (names, shapes, rotate-half RoPE rows) is written once into a
temporary folder: ``FILES`` safetensors files and a ``model.safetensors.index.json`` laid
out as ``save_pretrained`` lays them out. Three methods load it into the model:

* ``shardspec``: the generated ``load_hf`` (``shardspec.runtime.hf.load_hf`` with the
  spec and ``generated.llama.HF``, the RoPE head size set to this model's): every rank
  reads the safetensors slices of its own shards, no collective;
* ``full``: every rank reads every tensor whole (``safe_open(...).get_tensor``), converts
  the HF state dict to the model's with the hand conversion
  ``examples.models.hf.llama_from_hf`` (fuse q/k/v and gate/up, RoPE rows), and calls
  ``torch.distributed.tensor.distribute_tensor`` per parameter (its defaults: rank 0's
  data is scattered);
* ``dcp``: ``dcp.load`` with DCP's ``HuggingFaceStorageReader`` into a state dict of
  DTensors with the HF names and shapes (q/k/v and gate/up unfused, rotate-half rows),
  sharded with plain ``Shard`` placements over the same mesh axes as the model's
  parameters; then a hand conversion into the model: where the model's dp_shard split
  nests inside the tp split of the same dimension (embeddings, output, q/k/v: a
  ``_StridedShard`` in the model, which plain placements cannot express) the HF DTensor is
  redistributed to Replicate over dp_shard (all-gathers), fused and permuted per tp
  chunk, and the rank's dp_shard part is cut locally; the rest (o, down, gate/up, norms)
  is already the model's local shard;
* ``dcp_local`` (b'): the same reader, but the HF DTensors take the model parameters' own
  placements, ``_StridedShard`` included (DCP's planner reads each rank's box of them;
  only gate/up, halves of the fused w13, keep plain ones). Every conversion is then
  local, with no redistribution: this needs each rank's rows of ``wqkv`` to be whole GQA
  groups (here 1 group per rank). The strongest DCP baseline found.

A call's time is the slowest rank's wall time between two barriers. ``warm``: the files
are in the page cache (rank 0 reads them through before the warm phase); ``cold``: before
each call rank 0 drops every file of the checkpoint from the page cache with
``posix_fadvise(DONTNEED)`` (the hypervisor may still cache the virtual disk). Round 0 is
untimed: each method loads into parameters filled with NaN and every rank's local shards
must equal the ``shardspec`` load's bit for bit; the same round counts collectives (both
the ``torch.distributed`` functions, wrapped as ``tests/hf_scenarios.py`` does, and every
``c10d`` / functional-collective op that reaches the dispatcher, which also sees DTensor's
redistributions) and tensor bytes that safetensors hands out. Every timed call also
records ``/proc/self/io`` (``rchar``, ``read_bytes``) and page-fault deltas per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import functools
import gc
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from bench.bench_checkpoint import _evict, _profile_text, _revision, bench_spec, machine

# ~1.0 GB fp32 (255M parameters): Llama-2's vocabulary, 6 layers of dim 1536, 12 heads in
# 4 GQA groups of head_dim 128 (2 groups per tp rank, 1 per rank), ffn 4096.
MODEL: dict[str, int] = dict(
    vocab_size=32000, dim=1536, n_layers=6, n_heads=12, n_kv_heads=4, head_dim=128, ffn_dim=4096
)
WORLD = 4
SIZES = {"tp": 2}  # dp_shard takes the rest: 2
FILES = 5
METHODS = ("shardspec", "full", "dcp", "dcp_local")
BASELINES = ("full", "dcp", "dcp_local")
SHORT = {"full": "(a)", "dcp": "(b)", "dcp_local": "(b')"}
TEMPS = ("warm", "cold")
LABELS = {
    "shardspec": "shardspec `load_hf`",
    "full": "(a) full tensors + `distribute_tensor`",
    "dcp": "(b) DCP `HuggingFaceStorageReader`, plain `Shard`",
    "dcp_local": "(b') DCP `HuggingFaceStorageReader`, model placements",
}
TARGET_READ = 1.1  # bytes read / bytes owned per rank, sharded tensors
# Dispatcher ops that do not talk to another rank.
# ----------------------------------------------------------------------------- the map


def bench_hfmap(model_cfg: dict[str, int]) -> Any:
    """``generated.llama.HF`` with every ``rope`` transform's head size set to this model's
    (the spec file says 16, the tiny model's)."""
    import dataclasses

    import generated.llama as L
    from examples.models.llama import LlamaConfig
    from shardspec.core.hfmap import HFMap, Transform

    head_dim = LlamaConfig(**model_cfg).head_dim
    rules = []
    for r in L.HF.rules:
        transforms = tuple(
            Transform("rope", head_dim) if t.kind == "rope" else t for t in r.transforms
        )
        rules.append(dataclasses.replace(r, transforms=transforms))
    return HFMap(rules=tuple(rules), drops=L.HF.drops, ties=L.HF.ties, keeps=L.HF.keeps)


# ----------------------------------------------------------------------- the checkpoint


def hf_shapes(model_cfg: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """``LlamaForCausalLM``'s state dict (untied), names and shapes, in its order."""
    from examples.models.llama import LlamaConfig

    c = LlamaConfig(**model_cfg)
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.dim)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (q, c.dim),
            p + "self_attn.k_proj.weight": (kv, c.dim),
            p + "self_attn.v_proj.weight": (kv, c.dim),
            p + "self_attn.o_proj.weight": (c.dim, q),
            p + "mlp.gate_proj.weight": (c.ffn_dim, c.dim),
            p + "mlp.up_proj.weight": (c.ffn_dim, c.dim),
            p + "mlp.down_proj.weight": (c.dim, c.ffn_dim),
            p + "input_layernorm.weight": (c.dim,),
            p + "post_attention_layernorm.weight": (c.dim,),
        }
    out["model.norm.weight"] = (c.dim,)
    out["lm_head.weight"] = (c.vocab_size, c.dim)
    return out


def write_checkpoint(folder: str, model_cfg: dict[str, int], files: int = FILES) -> dict:
    """A random fp32 ``LlamaForCausalLM`` checkpoint in ``folder``: ``files`` safetensors
    files split by size in state-dict order, an index and (with transformers) config.json,
    as ``save_pretrained(max_shard_size=...)`` writes them."""
    import torch
    from safetensors.torch import save_file

    shapes = hf_shapes(model_cfg)
    total = sum(math.prod(s) * 4 for s in shapes.values())
    groups: list[list[str]] = [[] for _ in range(files)]
    start = 0
    for key, shape in shapes.items():  # each tensor goes where its middle byte falls
        n = math.prod(shape) * 4
        groups[min(files - 1, (2 * start + n) * files // (2 * total))].append(key)
        start += n
    groups = [g for g in groups if g]
    os.makedirs(folder, exist_ok=True)
    weight_map = {}
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for key in keys:
            gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            t = torch.randn(shapes[key], generator=gen) * 0.02
            tensors[key] = t + 1.0 if key.endswith("norm.weight") else t
            weight_map[key] = name
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        del tensors
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:  # clean pages only: posix_fadvise(DONTNEED) cannot drop dirty ones
            os.fsync(fd)
        finally:
            os.close(fd)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    try:
        from examples.models import hf as hfm
        from examples.models.llama import LlamaConfig

        hfm.llama_config(LlamaConfig(**model_cfg)).to_json_file(os.path.join(folder, "config.json"))
    except ImportError:  # transformers: only for config.json, which no method reads
        pass
    return {"tensor_bytes": total, "files": len(groups), "keys": len(shapes)}


# ------------------------------------------------------------------------------ counters


def _proc_io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io", encoding="ascii") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["majflt"], out["minflt"] = ru.ru_majflt, ru.ru_minflt
    return out


_IO_KEYS = ("rchar", "read_bytes", "syscr", "majflt", "minflt")


def _io_delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in _IO_KEYS}


class _Slice:
    def __init__(self, sl: Any, counts: dict[str, int]) -> None:
        self._sl, self._counts = sl, counts

    def get_shape(self) -> Any:
        return self._sl.get_shape()

    def get_dtype(self) -> Any:
        return self._sl.get_dtype()

    def __getitem__(self, idx: Any) -> Any:
        t = self._sl[idx]
        self._counts["bytes"] += t.numel() * t.element_size()
        self._counts["reads"] += 1
        return t


class _Handle:
    """A ``safe_open`` handle that counts the tensor bytes it hands out."""

    def __init__(self, h: Any, counts: dict[str, int]) -> None:
        self._h, self._counts = h, counts

    def __enter__(self) -> _Handle:
        self._h.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._h.__exit__(*exc)

    def keys(self) -> Any:
        return self._h.keys()

    def metadata(self) -> Any:
        return self._h.metadata()

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self._h.get_slice(key), self._counts)

    def get_tensor(self, key: str) -> Any:
        t = self._h.get_tensor(key)
        self._counts["bytes"] += t.numel() * t.element_size()
        self._counts["reads"] += 1
        return t


@contextlib.contextmanager
def count_safetensors() -> Iterator[dict[str, int]]:
    """Tensor bytes handed out by every ``safetensors.safe_open`` handle opened in the
    block (``get_tensor`` and slicing; every method here reads through them)."""
    import safetensors
    import safetensors.torch as st

    counts = {"bytes": 0, "reads": 0, "opens": 0}
    real = safetensors.safe_open

    def opener(*a: Any, **k: Any) -> _Handle:
        counts["opens"] += 1
        return _Handle(real(*a, **k), counts)

    saved = [(m, m.safe_open) for m in (safetensors, st) if hasattr(m, "safe_open")]
    for m, _ in saved:
        m.safe_open = opener
    try:
        yield counts
    finally:
        for m, fn in saved:
            m.safe_open = fn


# ------------------------------------------------------------------------------ methods


class _LazyHF(Mapping):
    """An HF state dict read whole, tensor by tensor, when the conversion asks for it."""

    def __init__(self, path: str) -> None:
        import safetensors

        with open(os.path.join(path, "model.safetensors.index.json"), encoding="utf-8") as f:
            self._where = json.load(f)["weight_map"]
        self._handles = {
            rel: safetensors.safe_open(os.path.join(path, rel), framework="pt")
            for rel in sorted(set(self._where.values()))
        }
        self._read: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._where:
            raise KeyError(key)
        if key not in self._read:  # each tensor read once, as load_file reads it
            self._read[key] = self._handles[self._where[key]].get_tensor(key)
        return self._read[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_full(
    model: Any, path: str, model_cfg: dict[str, int], hf: Mapping[str, Any] | None = None
) -> None:
    """Baseline (a): every rank reads every tensor, converts by hand, distributes
    (``hf``: the HF state dict to read instead of ``path``'s, read lazily)."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    from examples.models import hf as hfm
    from examples.models.llama import LlamaConfig

    full = hfm.llama_from_hf(_LazyHF(path) if hf is None else hf, LlamaConfig(**model_cfg))
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            dt = distribute_tensor(full.pop(fqn), p.device_mesh, p.placements)
            p.detach().to_local().copy_(dt.to_local())


def _plain(placements: Any) -> list[Any]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements]


def _hf_param(key: str) -> tuple[str, str | None]:
    """The model parameter an HF key lands in, and its component (None: the whole)."""
    if key == "model.embed_tokens.weight":
        return "tok_embeddings.weight", None
    if key == "lm_head.weight":
        return "output.weight", None
    if key == "model.norm.weight":
        return "norm.weight", None
    rest = key.removeprefix("model.layers.")
    i, name = rest.split(".", 1)
    p = f"layers.{i}."
    table = {
        "self_attn.q_proj.weight": ("attention.wqkv.weight", "q"),
        "self_attn.k_proj.weight": ("attention.wqkv.weight", "k"),
        "self_attn.v_proj.weight": ("attention.wqkv.weight", "v"),
        "self_attn.o_proj.weight": ("attention.wo.weight", None),
        "mlp.gate_proj.weight": ("feed_forward.w13.weight", "gate"),
        "mlp.up_proj.weight": ("feed_forward.w13.weight", "up"),
        "mlp.down_proj.weight": ("feed_forward.w2.weight", None),
        "input_layernorm.weight": ("attention_norm.weight", None),
        "post_attention_layernorm.weight": ("ffn_norm.weight", None),
    }
    fqn, comp = table[name]
    return p + fqn, comp


def load_dcp(model: Any, path: str, model_cfg: dict[str, int], *, strided: bool = False) -> None:
    """Baseline (b): ``dcp.load`` through ``HuggingFaceStorageReader`` into HF-layout
    DTensors with plain Shard placements, then a hand conversion into the model.

    ``strided`` (b'): the HF DTensors take the model parameter's own placements (with its
    ``_StridedShard``; gate/up, halves of the fused w13, keep plain ones), which DCP's
    planner reads as one box per rank. Then every conversion is local, with no
    redistribution, provided each rank's rows of ``wqkv`` are whole GQA groups (the q, k
    and v of those groups are then this rank's boxes of q_proj, k_proj, v_proj)."""
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.distributed.tensor as dt
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.tensor import Replicate

    from examples.models import hf as hfm
    from examples.models import llama
    from examples.models.llama import LlamaConfig

    cfg = LlamaConfig(**model_cfg)
    params = dict(model.named_parameters())
    state: dict[str, Any] = {}
    for key, shape in hf_shapes(model_cfg).items():
        fqn, comp = _hf_param(key)
        p = params[fqn]
        keep = strided and comp not in ("gate", "up")
        pl = list(p.placements) if keep else _plain(p.placements)
        state[key] = dt.empty(shape, device_mesh=p.device_mesh, placements=pl)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(path))

    def strided_dim(p: Any) -> int | None:
        """The mesh dim whose split nests inside another axis' split of the same tensor
        dim (a ``_StridedShard``), or None."""
        from torch.distributed.tensor.placement_types import _StridedShard

        dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, _StridedShard)]
        return dims[0] if dims else None

    def tp_chunk(d: Any, mesh_dim: int) -> torch.Tensor:
        """Replicate ``d`` over ``mesh_dim`` (all-gathers), keep the other splits."""
        pl = [Replicate() if i == mesh_dim else x for i, x in enumerate(d.placements)]
        return d.redistribute(d.device_mesh, pl).to_local()

    def own_part(t: torch.Tensor, p: Any, mesh_dim: int) -> torch.Tensor:
        """This rank's part along ``mesh_dim`` of ``t`` (a tensor holding every part)."""
        pl = p.placements[mesh_dim]
        n = p.device_mesh.size(mesh_dim)
        coord = p.device_mesh.get_coordinate()[mesh_dim]
        return t.chunk(n, dim=pl.dim)[coord]

    with torch.no_grad():
        for fqn, p in params.items():
            local = p.detach().to_local()
            sd = None if strided else strided_dim(p)
            if fqn.endswith("attention.wqkv.weight"):
                i = fqn.split(".")[1]
                hk = f"model.layers.{i}.self_attn."
                if strided or sd is None:
                    # q, k and v were read as this rank's own rows already (no nested split:
                    # with dp_shard 1 a size-1 axis is Replicate, so tp cuts whole groups).
                    wq, wk, wv = (state[hk + f"{c}_proj.weight"].to_local() for c in "qkv")
                    if wk.shape[0] % cfg.head_dim:
                        raise ValueError("(b') needs whole GQA groups per rank")
                    wq = hfm.hf_rope_to_meta(wq, cfg.head_dim)
                    wk = hfm.hf_rope_to_meta(wk, cfg.head_dim)
                    local.copy_(llama.fuse_wqkv(wq, wk, wv, cfg))
                    continue
                wq, wk, wv = (tp_chunk(state[hk + f"{c}_proj.weight"], sd) for c in "qkv")
                wq = hfm.hf_rope_to_meta(wq, cfg.head_dim)
                wk = hfm.hf_rope_to_meta(wk, cfg.head_dim)
                local.copy_(own_part(llama.fuse_wqkv(wq, wk, wv, cfg), p, sd))
            elif fqn.endswith("feed_forward.w13.weight"):
                i = fqn.split(".")[1]
                hk = f"model.layers.{i}.mlp."
                gate, up = (state[hk + f"{c}_proj.weight"].to_local() for c in ("gate", "up"))
                local.copy_(torch.cat((gate, up)))
            else:
                key = {
                    "tok_embeddings.weight": "model.embed_tokens.weight",
                    "output.weight": "lm_head.weight",
                    "norm.weight": "model.norm.weight",
                }.get(fqn)
                if key is None:
                    i, rest = fqn.removeprefix("layers.").split(".", 1)
                    key = {
                        "attention.wo.weight": "self_attn.o_proj.weight",
                        "feed_forward.w2.weight": "mlp.down_proj.weight",
                        "attention_norm.weight": "input_layernorm.weight",
                        "ffn_norm.weight": "post_attention_layernorm.weight",
                    }[rest]
                    key = f"model.layers.{i}.{key}"
                d = state[key]
                if sd is None:
                    local.copy_(d.to_local())
                else:
                    local.copy_(own_part(tp_chunk(d, sd), p, sd))


# --------------------------------------------------------------------------- one rank


def _rank(rank: int, world: int, opts: dict) -> dict:
    """One rank of the benchmark (run by ``shardspec.testing.run_ranks``)."""
    import logging

    import torch
    import torch.distributed as dist

    from shardspec.runtime import dtensor as rt
    from shardspec.runtime import hf

    torch.set_num_threads(1)  # the ranks share the cores; no intra-op threads
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    t_setup = time.perf_counter()
    cfg, path = opts["model"], opts["path"]
    spec = bench_spec(cfg)
    hfmap = bench_hfmap(cfg)
    mesh = rt.build_mesh(spec, **opts["sizes"])
    model, locals_ = distributed_llama(spec, cfg, mesh)
    owned = sum(t.numel() * t.element_size() for t in locals_.values())

    def ours() -> Any:
        return hf.load_hf(spec, hfmap, model, path, mesh)

    ops: dict[str, Callable[[], Any]] = {
        "shardspec": ours,
        "full": lambda: load_full(model, path, cfg),
        "dcp": lambda: load_dcp(model, path, cfg),
        "dcp_local": lambda: load_dcp(model, path, cfg, strided=True),
    }

    def timed(fn: Callable[[], Any]) -> tuple[float, float, dict[str, int], Any]:
        dist.barrier()
        io0, t0, c0 = _proc_io(), time.perf_counter(), time.process_time()
        out = fn()
        t, c, io1 = time.perf_counter() - t0, time.process_time() - c0, _proc_io()
        dist.barrier()
        return t, c, _io_delta(io0, io1), out

    def warm_up() -> None:
        if rank == 0:
            for name in os.listdir(path):
                with open(os.path.join(path, name), "rb") as f:
                    while f.read(64 << 20):
                        pass
        dist.barrier()

    still_mapped: list[int] = []

    def evict() -> None:
        """Drop the checkpoint from the page cache. Pages that a process still maps stay,
        so every rank first frees what earlier loads left for the garbage collector, and
        records how many mappings of the files remain (should be 0)."""
        gc.collect()
        still_mapped.append(_mapped(path))
        dist.barrier()
        if rank == 0:
            _evict(path)
        dist.barrier()

    info: dict[str, Any] = {
        "owned": owned,
        "checks": {},
        "round0": {},
        "times": {},
        "cpu": {},
        "io": {},
    }
    info["setup_s"] = time.perf_counter() - t_setup
    reference: dict[str, torch.Tensor] = {}

    # Round 0: bitwise check against ours, collectives and safetensors bytes (warm).
    warm_up()
    for method in METHODS:
        with torch.no_grad():
            for t in locals_.values():
                t.fill_(float("nan"))
        _, _, io, (out, calls, seen, st) = timed(functools.partial(_counted, ops[method]))
        r0: dict[str, Any] = {
            "collectives": dict(calls),
            "dispatched": dict(seen),
            "safetensors": dict(st),
            "io": io,
        }
        if method == "shardspec":
            r0["report"] = {
                "bytes_read": out.bytes_read,
                "bytes_owned": out.bytes_owned,
                "reads": out.reads,
                "units": out.units,
                "files_opened": len(out.files_opened),
            }
            reference = {k: v.clone() for k, v in locals_.items()}
        info["round0"][method] = r0
        info["checks"][method] = [
            k
            for k, v in locals_.items()
            if not torch.equal(v.view(torch.uint8), reference[k].view(torch.uint8))
        ]
    # Ours alone, one rank at a time, cold: this rank's own disk reads, no other rank
    # bringing shared pages in first.
    solo = {}
    for r in range(world):
        evict()
        if rank == r:
            solo, _ = _solo(ours)
        dist.barrier()
    info["solo_cold"] = solo
    info["still_mapped"] = still_mapped

    profile = set(filter(None, (opts.get("profile") or "").split(",")))
    for rnd in range(1, opts["rounds"] + 1):
        order = list(METHODS) if rnd % 2 == 0 else list(reversed(METHODS))
        for temp in TEMPS:
            if temp == "warm":
                warm_up()
            for method in order:
                if temp == "cold":
                    evict()
                tag = f"{method}:{temp}"
                prof = cProfile.Profile() if tag in profile and rank == 0 and rnd == 1 else None
                with prof or contextlib.nullcontext():
                    t, c, io, _ = timed(ops[method])
                if prof is not None:
                    info.setdefault("profile", {})[tag] = _profile_text(prof, top=25)
                info["times"].setdefault(tag, []).append(t)
                info["cpu"].setdefault(tag, []).append(c)
                info["io"].setdefault(tag, []).append(io)
            order.reverse()
    return info


def distributed_llama(spec: Any, cfg: dict[str, int], mesh: Any) -> tuple[Any, dict[str, Any]]:
    """The Llama of ``cfg`` distributed on ``spec``'s layout (uninitialized memory), and
    its parameters' local shards by name."""
    import torch

    from examples.models.llama import Llama, LlamaConfig
    from shardspec.runtime import dtensor as rt

    with torch.device("meta"):
        model = Llama(LlamaConfig(**cfg))
    rt.distribute(spec, model, mesh)
    model.to_empty(device="cpu")
    return model, {fqn: p.detach().to_local() for fqn, p in model.named_parameters()}


def _counted(fn: Callable[[], Any]) -> tuple[Any, dict, dict, dict]:
    """``fn()``, and the collectives (wrapped, dispatched) and safetensors bytes it used."""
    from tests.hf_scenarios import count_collectives, count_dispatched_collectives

    with count_collectives() as calls, count_dispatched_collectives() as seen:
        with count_safetensors() as st:
            out = fn()
    return out, dict(calls), dict(seen), dict(st)


def _mapped(path: str) -> int:
    """Mappings of files under ``path`` in this process."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        return sum(1 for line in f if path in line)


def _solo(fn: Callable[[], Any]) -> tuple[dict[str, int], Any]:
    io0 = _proc_io()
    out = fn()
    return _io_delta(io0, _proc_io()), out


# ------------------------------------------------------------------------------- run


def run(
    model: dict[str, int] | None = None,
    *,
    rounds: int = 3,
    world: int = WORLD,
    sizes: dict[str, int] | None = None,
    files: int = FILES,
    workdir: str | None = None,
    profile: str | None = None,
) -> dict:
    """Write the checkpoint, run every method on ``world`` gloo ranks, return the numbers
    (times: the slowest rank's per round; per-rank counters)."""
    from shardspec.testing import run_ranks

    cfg = model if model is not None else MODEL
    root = tempfile.mkdtemp(prefix="shardspec-bench-hf-", dir=workdir)
    try:
        path = os.path.join(root, "hf")
        t0 = time.perf_counter()
        ckpt = write_checkpoint(path, cfg, files)
        ckpt["write_s"] = time.perf_counter() - t0
        ckpt["file_bytes"] = sum(
            os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if ".safetensors" in n
        )
        opts = dict(model=cfg, rounds=rounds, sizes=sizes or SIZES, path=path, profile=profile)
        per_rank = run_ranks(_rank, world, opts, timeout=1800.0)
        disk = machine(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first = per_rank[0]
    times = {
        tag: [max(r["times"][tag][i] for r in per_rank) for i in range(rounds)]
        for tag in first["times"]
    }
    cpu = {
        tag: [sum(r["cpu"][tag][i] for r in per_rank) for i in range(rounds)]
        for tag in first["cpu"]
    }
    return dict(
        model=cfg,
        world=world,
        sizes=opts["sizes"],
        rounds=rounds,
        checkpoint=ckpt,
        machine=disk,
        times=times,
        cpu=cpu,
        io={tag: [r["io"][tag] for r in per_rank] for tag in first["io"]},
        round0={m: [r["round0"][m] for r in per_rank] for m in METHODS},
        solo_cold=[r["solo_cold"] for r in per_rank],
        owned=[r["owned"] for r in per_rank],
        checks={m: sorted({k for r in per_rank for k in r["checks"][m]}) for m in METHODS},
        setup_s=max(r["setup_s"] for r in per_rank),
        still_mapped=max(max(r["still_mapped"], default=0) for r in per_rank),
        profile=first.get("profile"),
    )


# ----------------------------------------------------------------------------- report

GB = 1e9


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms" if s < 10 else f"{s:,.1f} s"


def _paired(base: list[float], xs: list[float]) -> float:
    """Median over rounds of base / x within a round (> 1: x is faster)."""
    return statistics.median(b / x for b, x in zip(base, xs, strict=True))


def collective_total(counts: Mapping[str, int]) -> int:
    return sum(counts.values())


def summary(res: dict) -> dict:
    """Per method: medians and ratios (the numbers the report and the targets use)."""
    out: dict[str, Any] = {}
    owned = max(res["owned"])
    for m in METHODS:
        r0 = res["round0"][m]
        row: dict[str, Any] = {
            "st_bytes_max": max(x["safetensors"]["bytes"] for x in r0),
            "st_reads_max": max(x["safetensors"]["reads"] for x in r0),
            "collectives": max(collective_total(x["collectives"]) for x in r0),
            "dispatched": max(collective_total(x["dispatched"]) for x in r0),
            "collectives_by_name": r0[0]["collectives"],
            "dispatched_by_name": r0[0]["dispatched"],
            "rchar_warm_max": max(x["io"]["rchar"] for x in r0),
        }
        row["st_ratio"] = max(
            x["safetensors"]["bytes"] / o for x, o in zip(r0, res["owned"], strict=True)
        )
        cold = res["io"][f"{m}:cold"]  # [rank][round]
        row["read_bytes_cold_rank_max"] = max(
            statistics.median(x["read_bytes"] for x in per) for per in cold
        )
        row["read_bytes_cold_sum"] = statistics.median(
            sum(cold[r][i]["read_bytes"] for r in range(len(cold))) for i in range(len(cold[0]))
        )
        row["majflt_cold_max"] = max(statistics.median(x["majflt"] for x in per) for per in cold)
        for temp in TEMPS:
            t = res["times"][f"{m}:{temp}"]
            row[f"{temp}_median"] = statistics.median(t)
            row[f"{temp}_best"] = min(t)
            row[f"{temp}_cpu"] = statistics.median(res["cpu"][f"{m}:{temp}"])
            for b in BASELINES:
                if b != m:
                    base = res["times"][f"{b}:{temp}"]
                    row[f"{temp}_vs_{b}"] = statistics.median(base) / statistics.median(t)
                    row[f"{temp}_vs_{b}_paired"] = _paired(base, t)
        out[m] = row
    ours = res["round0"]["shardspec"]
    out["shardspec"]["report_ratio"] = max(
        x["report"]["bytes_read"] / x["report"]["bytes_owned"] for x in ours
    )
    out["owned_max"] = owned
    out["solo_read_bytes"] = [x["read_bytes"] for x in res["solo_cold"]]
    out["solo_rchar"] = [x["rchar"] for x in res["solo_cold"]]
    return out


def report(res: dict) -> list[str]:
    s = summary(res)
    ck = res["checkpoint"]
    out = []
    out.append(
        f"Model: Llama {res['model']} ({_n_params(res['model']):,} parameters, fp32); HF "
        f"checkpoint {ck['tensor_bytes'] / GB:.3f} GB of tensors in {ck['files']} safetensors "
        f"files + index ({ck['keys']} keys), written in {ck['write_s']:.1f} s."
    )
    axes = {"dp_shard": res["world"] // res["sizes"]["tp"], **res["sizes"]}
    mesh = " x ".join(f"{k} {v}" for k, v in axes.items())
    out.append(
        f"{res['world']} gloo ranks on the CPU, mesh {mesh}; {res['rounds']} timed rounds after "
        "1 untimed round (checks, counts), operations in alternating order; time per call is "
        "the slowest rank's, between barriers; CPU is the process time of all ranks, summed."
    )
    out.append("")
    for temp in TEMPS:
        out.append(
            f"| load ({temp}) | time median | best | "
            + " | ".join(f"vs {SHORT[b]}: median / paired" for b in BASELINES)
            + " | CPU s (all ranks), median |"
        )
        out.append("|---|---:|---:|" + "---:|" * len(BASELINES) + "---:|")
        for m in METHODS:
            row = s[m]
            vs = []
            for b in BASELINES:
                if b == m:
                    vs.append("-")
                else:
                    vs.append(f"{row[f'{temp}_vs_{b}']:.2f}x / {row[f'{temp}_vs_{b}_paired']:.2f}x")
            out.append(
                f"| {LABELS[m]} | {_ms(row[f'{temp}_median'])} | {_ms(row[f'{temp}_best'])} | "
                + " | ".join(vs)
                + f" | {row[f'{temp}_cpu']:.2f} |"
            )
        out.append("")
        out.append("(ratios: baseline time / this method's time; > 1 means faster than it)")
        out.append("")
    owned = s["owned_max"]
    out.append(
        "| bytes per rank (max over ranks) | owned (local shards) | tensor bytes from "
        "safetensors (reads) | / owned | `rchar` warm | `read_bytes` cold, rank max | "
        "`read_bytes` cold, sum of ranks / files | major faults cold |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in METHODS:
        row = s[m]
        out.append(
            f"| {LABELS[m]} | {_mb(owned)} | {_mb(row['st_bytes_max'])} ({row['st_reads_max']}) | "
            f"{row['st_ratio']:.3f} | {_mb(row['rchar_warm_max'])} | "
            f"{_mb(row['read_bytes_cold_rank_max'])} | {_mb(row['read_bytes_cold_sum'])} / "
            f"{_mb(ck['file_bytes'])} ({row['read_bytes_cold_sum'] / ck['file_bytes']:.2f}) | "
            f"{row['majflt_cold_max']:,.0f} |"
        )
    rep = res["round0"]["shardspec"]
    out.append("")
    out.append(
        "shardspec's `HFLoadReport` per rank, bytes_read / bytes_owned: "
        + ", ".join(
            f"{x['report']['bytes_read'] / 1e6:.1f}/{x['report']['bytes_owned'] / 1e6:.1f} MB"
            for x in rep
        )
        + f" (max ratio {s['shardspec']['report_ratio']:.3f}; {rep[0]['report']['reads']} "
        f"reads, {rep[0]['report']['files_opened']} files opened on rank 0). "
        "Alone on a cold cache, one rank at a time: `read_bytes` "
        + ", ".join(_mb(x) for x in s["solo_read_bytes"])
        + "; `rchar` "
        + ", ".join(_mb(x) for x in s["solo_rchar"])
        + "."
    )
    out.append("")
    out.append(
        "| collectives per rank (round 0) | torch.distributed functions (wrapped) | "
        "c10d ops at the dispatcher |"
    )
    out.append("|---|---|---|")
    for m in METHODS:
        row = s[m]

        def fmt(total: int, by: Mapping[str, int]) -> str:
            return f"{total}" + (
                " (" + ", ".join(f"{k} {v}" for k, v in sorted(by.items())) + ")" if by else ""
            )

        out.append(
            f"| {LABELS[m]} | {fmt(row['collectives'], row['collectives_by_name'])} | "
            f"{fmt(row['dispatched'], row['dispatched_by_name'])} |"
        )
    bad = {k: v for k, v in res["checks"].items() if v}
    out.append("")
    out.append(
        "Round 0 check (parameters filled with NaN, loaded, compared bitwise with the "
        "shardspec load on every rank): "
        + ("all methods identical." if not bad else "MISMATCH: " + json.dumps(bad))
    )
    out.append(
        f"Set-up per rank (spec, mesh, model): {res['setup_s']:.1f} s. Checkpoint files "
        f"still mapped by a rank when the cache was dropped: {res['still_mapped']}."
    )
    out.append("")
    out += targets(res, s)
    return out


def targets(res: dict, s: dict | None = None) -> list[str]:
    s = s or summary(res)
    ours = s["shardspec"]
    out = ["Targets:"]
    for temp in TEMPS:
        vs = {b: (ours[f"{temp}_vs_{b}"], ours[f"{temp}_vs_{b}_paired"]) for b in BASELINES}
        ok = all(a > 1 and b > 1 for a, b in vs.values())
        out.append(
            f"- faster than every baseline, {temp}: {'met' if ok else 'missed'} ("
            + ", ".join(
                f"vs {SHORT[b]} {a:.2f}x median / {p:.2f}x paired" for b, (a, p) in vs.items()
            )
            + ")"
        )
    ratio = max(ours["report_ratio"], ours["st_ratio"])
    out.append(
        f"- bytes read <= {TARGET_READ}x owned: {'met' if ratio <= TARGET_READ else 'missed'} "
        f"(HFLoadReport {ours['report_ratio']:.3f}x, safetensors count {ours['st_ratio']:.3f}x)"
    )
    n = ours["collectives"] + ours["dispatched"]
    out.append(
        f"- 0 collectives: {'met' if n == 0 else 'missed'} ({ours['collectives']} wrapped "
        f"calls, {ours['dispatched']} dispatcher ops)"
    )
    return out


def _n_params(cfg: dict[str, int]) -> int:
    import torch

    from examples.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(**cfg))
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    ap.add_argument("--files", type=int, default=FILES, help="safetensors files (default 5)")
    ap.add_argument("--workdir", help="parent of the temporary checkpoint folder ($TMPDIR)")
    ap.add_argument(
        "--profile",
        help="cProfile rank 0 in round 1 of these comma-separated operations, e.g. "
        "shardspec:cold,dcp:warm",
    )
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args(argv)

    args_text = argv if argv is not None else sys.argv[1:]
    started = time.time()
    load0 = os.getloadavg()[0]
    print("loading ...", file=sys.stderr)
    res = run(rounds=args.rounds, files=args.files, workdir=args.workdir, profile=args.profile)
    load1 = os.getloadavg()[0]
    lines = [
        f"Command: `python -m bench.bench_hf {' '.join(args_text)}`".rstrip() + "  ",
        f"Machine: {res['machine']}  ",
        f"Date: {datetime.date.today().isoformat()}; code: {_revision()}  ",
        f"Load: 1-minute load average {load0:.1f} before, {load1:.1f} after; "
        f"whole run {time.time() - started:.0f} s  ",
        "",
        *report(res),
    ]
    for tag, text in (res.get("profile") or {}).items():
        lines += ["", f"cProfile of rank 0, round 1, `{tag}`:", "", "```", text.rstrip(), "```"]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
