"""A Llama-like model whose vocabulary is padded (vLLM's ``VocabParallelEmbedding`` and
``ParallelLMHead``: 1000 rows padded to a multiple of 64, 1024), loaded from and exported
to transformers' own checkpoint of the unpadded model, on 4 gloo ranks (dp_shard 2 x tp 2,
the vocabulary over tp). Used by ``tests/test_hf_pad.py``."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.hf_scenarios import hf_state

__all__ = ["PADDED", "SPEC", "VOCAB", "hf_state", "padded_model", "run", "write_hf"]

VOCAB, PADDED = 1000, 1024

SPEC = """\
manifest "padded.manifest.json"

mesh over 4 ranks {
    dp_shard: *
    tp: 2
}

fsdp dp_shard

param model.embed_tokens.weight [vocab, hidden] {
    shard vocab over tp
}
param lm_head.weight [vocab, hidden] {
    shard vocab over tp
    style colwise output replicate
}
param model.layers.*.*.*_proj.weight [out, in] {}
param **.*norm.weight [hidden] {}

hf "padded.hf.json" {
    model.embed_tokens.weight -> model.embed_tokens.weight pad 0 to 64
    lm_head.weight -> lm_head.weight pad 0 to 64
    model.norm.weight -> model.norm.weight
    model.layers.{i}.{m}.{p}.weight -> model.layers.{i}.{m}.{p}.weight
    model.layers.{i}.{n}.weight -> model.layers.{i}.{n}.weight
}
"""


def config(vocab: int) -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    )


def padded_model() -> Any:
    """The model as an engine holds it: transformers' Llama with the padded vocabulary
    (the manifest factory of :data:`SPEC`)."""
    import transformers

    return transformers.LlamaForCausalLM(config(PADDED))


def write_hf(folder: str) -> None:
    """transformers' own checkpoint of the unpadded model (random weights, norms too)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(VOCAB))
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    model.save_pretrained(folder)


SENTINEL = 7.0  # what every parameter holds before the load: padding must not keep it


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def _fresh(mod: Any, mesh: Any) -> Any:
    with torch.device("meta"):
        model = padded_model()
    mod.distribute(model, mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)
    return model


def run(rank: int, world: int, root: str) -> dict[str, Any]:
    """Load the unpadded checkpoint into the padded model, export it, save and load a DCP
    checkpoint of it; what each rank saw, for the test to assert on."""
    gen = os.path.join(root, "gen")
    if gen not in sys.path:
        sys.path.insert(0, gen)
    mod = importlib.import_module("padded")
    mesh = mod.build_mesh(dp_shard=world // 2, tp=2)
    model = _fresh(mod, mesh)
    hf_dir = os.path.join(root, "hf")
    report = mod.load_hf(model, hf_dir, mesh)
    out: dict[str, Any] = {
        "bytes_read": report.bytes_read,
        "bytes_owned": report.bytes_owned,
        "real_local": sum(_real_local(p, VOCAB) * p.element_size() for p in model.parameters()),
    }
    fulls = {n: _full(p) for n, p in sorted(model.named_parameters())}
    exported = os.path.join(root, "export")
    mod.export_hf(model, exported, mesh, config=hf_dir)
    # DCP: the checkpoint stores the model's padded parameter as it is.
    ckpt = os.path.join(root, "dcp")
    with torch.no_grad():
        model.lm_head.weight.to_local()[-1:].fill_(3.0)  # a padding row (on the last tp rank)
    fulls_saved = _full(model.lm_head.weight)
    mod.save({"model": model.state_dict()}, ckpt, mesh=mesh)
    again = _fresh(mod, mesh)
    mod.load({"model": again.state_dict()}, ckpt, mesh=mesh)
    out["dcp_same"] = torch.equal(_full(again.lm_head.weight), fulls_saved)
    out["dcp_padding"] = _full(again.lm_head.weight)[PADDED - 1].tolist()
    if dist.get_rank() == 0:
        out["fulls"] = fulls
    dist.barrier()
    return out


def _real_local(p: torch.Tensor, vocab: int) -> int:
    """The elements of ``p``'s local shard that are real (rows below ``vocab`` for the
    padded vocabulary; every element otherwise)."""
    if not isinstance(p, DTensor) or p.shape[0] != PADDED:
        return (p.to_local() if isinstance(p, DTensor) else p).numel()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    rows = max(0, min(offset[0] + shape[0], vocab) - offset[0]) if shape[0] else 0
    return rows * (shape[1] if len(shape) > 1 else 1)
