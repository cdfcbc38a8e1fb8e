"""Checkpoints of a layout with replicated KV heads (run by tests/test_ckpt_kvrep.py).

vLLM's Qwen2 engine (examples/models/vllm.py) at tp 4 over 2 KV heads
(specs/qwen2_vllm_tp4.shard: `heads k 16 replicated`): ranks 0 and 1 hold KV head 0,
ranks 2 and 3 KV head 1, each inside its fused [q_r; k_r; v_r]. On 4 gloo ranks, one
spawn: each layout's engine is filled from one set of HF tensors (tests/vllm_slices.py:
vLLM's weight_loader arithmetic), saved with its generated ``save``; a fresh engine
(other values) of another layout loads it with its generated ``load``. Layouts: tp 4;
tp 2 (2 replicas of a tp 2 engine: ``dp: 2  tp: 2``); dp_shard 4 (the tp 1 engine under
FSDP, DTensors whose ``full_tensor()`` is the whole engine tensor). Every loaded
parameter must equal, bitwise, the owner's: vLLM's slice of the HF tensors for the rank
(local modules), or the whole tensor (``full_tensor()``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardspec.testing import Checks

HF_SEED, TARGET_SEED = 5, 9
CFG = {"heads": 4, "kv_heads": 2, "head_dim": 16}
# name -> (generated module: importable name or a file under the compiled root, tp)
LAYOUTS = {
    "tp4": ("generated.qwen2_vllm_tp4", 4),
    "tp2": ("qwen2_vllm_dp2tp2.py", 2),
    "dp4": ("qwen2_vllm_dp4.py", 1),
}
PAIRS = (("tp4", "tp2"), ("tp4", "dp4"), ("tp2", "tp4"), ("dp4", "tp4"))


def layout(name: str, root: str) -> Any:
    module, _ = LAYOUTS[name]
    if not module.endswith(".py"):
        return importlib.import_module(module)
    stem = module.removesuffix(".py")
    if stem not in sys.modules:
        spec = importlib.util.spec_from_file_location(stem, Path(root) / module)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[stem] = mod
        spec.loader.exec_module(mod)
    return sys.modules[stem]


def hf_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Random HF tensors of transformers' tiny Qwen2 (examples.models.hf.qwen2_tiny)."""
    from examples.models import hf

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in hf.qwen2_tiny().state_dict().items()}
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def engine(name: str, root: str, seed: int) -> tuple[Any, Any, nn.Module, dict[str, torch.Tensor]]:
    """Layout ``name``'s engine on this rank, filled from the HF tensors of ``seed`` and
    distributed: (module, mesh, model, the owner's tensors for this rank)."""
    from examples.models import vllm
    from tests import vllm_slices

    mod, tp = layout(name, root), LAYOUTS[name][1]
    mesh = mod.build_mesh()
    names = mesh.mesh_dim_names
    coord = mesh.get_coordinate()
    rank = coord[names.index("tp")] if "tp" in names else 0
    owner = vllm_slices.engine_rank(hf_tensors(seed), tp=tp, rank=rank, **CFG)
    model = vllm.qwen2_engine(tp=tp)
    model.load_state_dict(owner, strict=True)
    mod.distribute(model, mesh)
    return mod, mesh, model, owner


def mismatches(model: nn.Module, owner: dict[str, torch.Tensor]) -> list[str]:
    """The parameters of ``model`` that are not, bitwise, the owner's tensors (a DTensor
    through torch's ``full_tensor()``), and the names one side lacks."""
    from torch.distributed.tensor import DTensor

    got = dict(model.named_parameters())
    out = sorted(set(got) ^ set(owner))
    for fqn in sorted(set(got) & set(owner)):
        p = got[fqn]
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if full.dtype != owner[fqn].dtype or not torch.equal(full, owner[fqn]):
            out.append(fqn)
    return out


def check_stored_once(c: Checks, path: str) -> None:
    """The tp 4 checkpoint stores each replicated KV head once: the k and v units of every
    layer have one chunk per KV head, and every chunk is written by one rank."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(path).read_metadata()
    chunks = 0
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        chunks += len(meta.chunks)
        if key.endswith((".k", ".v")) and ".qkv_proj." in key:
            starts = sorted(int(ch.offsets[0]) for ch in meta.chunks)
            c.check("stored once", starts == [0, 16], f"{key}: chunks at rows {starts}")
    assert md.storage_data is not None
    c.check("stored once", len(md.storage_data) == chunks, f"{len(md.storage_data)} writes")


def run(rank: int, world: int, root: str) -> dict[str, Any]:
    c = Checks()
    for name in LAYOUTS:
        mod, mesh, model, owner = engine(name, root, HF_SEED)
        c.check(f"source {name}", not mismatches(model, owner), str(mismatches(model, owner)))
        mod.save({"model": model.state_dict()}, os.path.join(root, name), mesh=mesh)
    if rank == 0:
        check_stored_once(c, os.path.join(root, "tp4"))
    for src, dst in PAIRS:
        tag = f"{src} -> {dst}"
        mod, mesh, model, _ = engine(dst, root, TARGET_SEED)
        _, _, _, owner = engine(dst, root, HF_SEED)
        # the fresh engine differs everywhere: only the load can make it the owner's
        c.check(tag, len(mismatches(model, owner)) == len(owner), "fresh engine not fresh")
        mod.load({"model": model.state_dict()}, os.path.join(root, src), mesh=mesh)
        wrong = mismatches(model, owner)
        c.check(tag, not wrong, f"not the owner's after the load: {wrong}")
    return {"fail": c.fail, "count": c.count}
