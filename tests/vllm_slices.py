"""What a vLLM tensor-parallel rank holds of each Hugging Face Qwen2 tensor, written from
vLLM's own definitions (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py),
not from shardspec's layout arithmetic: the owner's answer the transfer tests compare with.

* ``QKVParallelLinear.weight_loader``: ``num_heads = total_num_heads // tp``; when
  ``tp >= total_num_kv_heads``: ``num_kv_heads = 1``, ``num_kv_head_replicas = tp //
  total_num_kv_heads``, else ``num_kv_heads = total_num_kv_heads // tp`` and 1 replica.
  The q shard of rank ``r`` starts at head ``r * num_heads``; k's and v's at KV head
  ``(r // num_kv_head_replicas) * num_kv_heads``. The rank's tensor is ``[q; k; v]``.
* ``MergedColumnParallelLinear``: ``[gate.chunk(tp)[r]; up.chunk(tp)[r]]``.
* ``RowParallelLinear``: the input columns ``chunk(tp, dim=1)[r]``.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of
  64, rows ``chunk(tp)[r]`` of it (padding rows: no HF data, ``None`` in :func:`real_rows`).
"""

from __future__ import annotations

import torch

PAD = 64


def _heads(t: torch.Tensor, first: int, count: int, head_dim: int) -> torch.Tensor:
    return t[first * head_dim : (first + count) * head_dim]


def qkv_rank(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    tp: int,
    rank: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """QKVParallelLinear's rank ``rank`` tensor (weight or bias) from HF's q, k, v."""
    num_heads = heads // tp
    if tp >= kv_heads:
        num_kv, replicas = 1, tp // kv_heads
    else:
        num_kv, replicas = kv_heads // tp, 1
    kv_first = (rank // replicas) * num_kv
    return torch.cat(
        [
            _heads(q, rank * num_heads, num_heads, head_dim),
            _heads(k, kv_first, num_kv, head_dim),
            _heads(v, kv_first, num_kv, head_dim),
        ]
    )


def vocab_rows(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """The padded vocabulary's rows ``[start, stop)`` of rank ``rank``."""
    padded = -(-vocab // PAD) * PAD
    per = padded // tp
    return rank * per, (rank + 1) * per


def engine_rank(
    hf: dict[str, torch.Tensor], *, tp: int, rank: int, heads: int, kv_heads: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """Every parameter of vLLM's Qwen2 on tp rank ``rank`` (vLLM's names), from the HF
    tensors ``hf``; padded vocabulary rows are filled with -1 (no HF source)."""
    out: dict[str, torch.Tensor] = {}
    layers = sorted({int(k.split(".")[2]) for k in hf if k.startswith("model.layers.")})
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = hf[name]
        a, b = vocab_rows(t.shape[0], tp, rank)
        rows = torch.full((b - a, *t.shape[1:]), -1, dtype=t.dtype)
        real = t[a:b]
        rows[: real.shape[0]] = real
        out[name] = rows
    out["model.norm.weight"] = hf["model.norm.weight"]
    for i in layers:
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            out[f"{p}self_attn.qkv_proj.{kind}"] = qkv_rank(
                *(hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv"),
                tp=tp,
                rank=rank,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
            )
        out[f"{p}self_attn.o_proj.weight"] = hf[f"{p}self_attn.o_proj.weight"].chunk(tp, 1)[rank]
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat(
            [hf[f"{p}mlp.{x}_proj.weight"].chunk(tp)[rank] for x in ("gate", "up")]
        )
        out[f"{p}mlp.down_proj.weight"] = hf[f"{p}mlp.down_proj.weight"].chunk(tp, 1)[rank]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{norm}.weight"] = hf[f"{p}{norm}.weight"]
    return out
