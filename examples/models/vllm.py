"""A stand-in for a vLLM inference engine's Qwen2 model: the parameters each tensor-parallel
rank holds, under vLLM's names and in vLLM's per-rank layouts (no forward; the engine of
``specs/qwen2_vllm*.shard``, which a trainer's weights are transferred into).

Per rank of ``tp`` (vllm/model_executor/layers/linear.py and vocab_parallel_embedding.py):

* ``qkv_proj`` (``QKVParallelLinear``, weight and bias): ``[q_r; k_r; v_r]``, the rank's
  ``num_heads / tp`` query heads, then its ``max(1, num_kv_heads / tp)`` KV heads; when tp
  exceeds the KV-head count each KV head is replicated on ``tp / num_kv_heads`` ranks;
* ``gate_up_proj`` (``MergedColumnParallelLinear``): ``[gate_r; up_r]``;
* ``o_proj``, ``down_proj`` (``RowParallelLinear``): the rank's columns;
* ``embed_tokens`` / ``lm_head`` (``VocabParallelEmbedding`` / ``ParallelLMHead``): the
  vocabulary padded to a multiple of 64, the rank's rows of it;
* norms whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def padded_vocab(vocab: int) -> int:
    """vLLM's ``pad_vocab_size``: the vocabulary rounded up to a multiple of 64."""
    return -(-vocab // PAD) * PAD


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape))


class _Holder(nn.Module):
    """A module that holds parameters by name (``weight``, ``bias``)."""

    def __init__(self, **params: nn.Parameter) -> None:
        super().__init__()
        for name, p in params.items():
            self.register_parameter(name, p)


def qwen2_engine(*, tp: int = 2, **overrides: Any) -> nn.Module:
    """The tp rank's parameters of a vLLM Qwen2 model of ``examples.models.hf.qwen2_config``
    (every rank builds the same shapes; the transfer fills in its values)."""
    from examples.models.hf import qwen2_config

    cfg = qwen2_config(**overrides)
    hidden, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    if heads % tp or not (kv % tp == 0 or tp % kv == 0) or cfg.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not fit {heads} heads, {kv} KV heads")
    rows = (heads // tp + 2 * max(1, kv // tp)) * head_dim
    ffn = cfg.intermediate_size // tp
    vocab = padded_vocab(cfg.vocab_size) // tp
    model = nn.Module()
    inner = nn.Module()
    inner.embed_tokens = _Holder(weight=_param(vocab, hidden))
    layers = nn.ModuleList()
    for _ in range(cfg.num_hidden_layers):
        layer = nn.Module()
        attn = nn.Module()
        attn.qkv_proj = _Holder(weight=_param(rows, hidden), bias=_param(rows))
        attn.o_proj = _Holder(weight=_param(hidden, heads * head_dim // tp))
        mlp = nn.Module()
        mlp.gate_up_proj = _Holder(weight=_param(2 * ffn, hidden))
        mlp.down_proj = _Holder(weight=_param(hidden, ffn))
        layer.self_attn, layer.mlp = attn, mlp
        layer.input_layernorm = _Holder(weight=_param(hidden))
        layer.post_attention_layernorm = _Holder(weight=_param(hidden))
        layers.append(layer)
    inner.layers = layers
    inner.norm = _Holder(weight=_param(hidden))
    model.model = inner
    model.lm_head = _Holder(weight=_param(vocab, hidden))
    return model
