"""A torchtitan-like Llama 3 whose attention holds q, k and v in one parameter, and whose
state dict does not say so.

The attention module keeps one fused projection, ``attention.qkv_linear.wqkv`` (rows: every
q head, then every k head, then every v head), but presents
it to checkpoints as three unfused tensors: a state-dict hook replaces
``qkv_linear.wqkv.weight`` by ``wq.weight``, ``wk.weight`` and ``wv.weight`` in
``state_dict()``, and a load-state-dict pre-hook joins them back. Parameters as the model
holds them::

    tok_embeddings.weight                          [vocab_size, dim]
    layers.{i}.attention_norm.weight               [dim]
    layers.{i}.attention.qkv_linear.wqkv.weight    [(n_heads + 2 * n_kv_heads) * head_dim, dim]
    layers.{i}.attention.wo.weight                 [dim, n_heads * head_dim]
    layers.{i}.ffn_norm.weight                     [dim]
    layers.{i}.feed_forward.w13.weight             [2 * ffn_dim, dim]
    layers.{i}.feed_forward.w2.weight              [dim, ffn_dim]
    norm.weight                                    [dim]
    output.weight                                  [vocab_size, dim]

and ``state_dict()`` lists ``layers.{i}.attention.{wq,wk,wv}.weight`` instead of ``wqkv``.
Such a model is what ``shardspec manifest`` has to see through (it records the parameter
and reports the hooks) and what ``save`` refuses to store unmapped.

:func:`titan_tiny` builds it with torchtitan's own fused module instead
(:class:`FusedQKVLinear`: ``wqkv`` rows grouped per kv head, and the hooks on
``qkv_linear`` itself, so ``state_dict()`` lists ``attention.qkv_linear.{wq,wk,wv}.weight``),
the model whose checkpoints ``tests/test_torchtitan_ckpt.py`` exchanges with torchtitan's
checkpointer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.models import llama
from examples.models.llama import LlamaConfig, RMSNorm, apply_rope_interleaved, rope_cos_sin

__all__ = ["Attention", "FusedQKVLinear", "Llama3", "QKVLinear", "tiny", "titan_tiny"]

PARTS = ("wq", "wk", "wv")


class QKVLinear(nn.Module):
    """The fused projection: ``wqkv`` rows are the q heads, then the k heads, then the v."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, rows, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wqkv(x)

    def qkv(self, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
        """q, k and v of ``x`` (``[..., rows]``): the rows one part after another."""
        return tuple(self(x).split(sizes, dim=-1))


class FusedQKVLinear(QKVLinear):
    """torchtitan's own fused projection (``torchtitan/models/common/attention.py``,
    ``FusedQKVLinear``, read at commit b5bcd76): ``wqkv`` rows are grouped per kv head,
    ``[n_kv_heads, n_heads // n_kv_heads + 2, head_dim]`` (that group's q heads, then its k
    head, then its v head), and the module's own state-dict hooks present it as
    ``wq.weight``/``wk.weight``/``wv.weight`` next to it (``attention.qkv_linear.wq.weight``),
    each part's heads in order. The spec declares it ``fuse qkv as N groups of q .., k ..,
    v ..`` (Megatron's grouped layout, the same rows)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.head_dim = config.head_dim
        self.heads_per_kv = config.n_heads // config.n_kv_heads
        self.register_state_dict_post_hook(_split_grouped)
        self.register_load_state_dict_pre_hook(_join_grouped)

    def qkv(self, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
        out = self(x)
        grouped = out.view(*out.shape[:-1], -1, self.heads_per_kv + 2, self.head_dim)
        q, k, v = grouped.split([self.heads_per_kv, 1, 1], dim=-2)
        return tuple(t.flatten(-3) for t in (q, k, v))


class Attention(nn.Module):
    """Causal GQA attention with a fused q/k/v projection that checkpoints see unfused."""

    def __init__(self, config: LlamaConfig, titan: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.head_dim
        # titan: torchtitan's FusedQKVLinear (grouped rows, hooks on qkv_linear itself)
        self.qkv_linear = FusedQKVLinear(config) if titan else QKVLinear(config)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        if not titan:
            self.register_state_dict_post_hook(_split_qkv)
            self.register_load_state_dict_pre_hook(_join_qkv)

    def sizes(self) -> list[int]:
        """Rows of q, k and v in ``wqkv``."""
        kv = self.n_kv_heads * self.head_dim
        return [self.n_heads * self.head_dim, kv, kv]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q, k, v = self.qkv_linear.qkv(x, self.sizes())
        q = apply_rope_interleaved(q.view(bsz, seq_len, -1, self.head_dim), cos, sin)
        k = apply_rope_interleaved(k.view(bsz, seq_len, -1, self.head_dim), cos, sin)
        v = v.view(bsz, seq_len, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=1.0 / math.sqrt(self.head_dim)
        )
        return self.wo(out.transpose(1, 2).flatten(2))


def _split_qkv(module: Attention, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: ``qkv_linear.wqkv.weight`` becomes ``wq``/``wk``/``wv.weight``."""
    fused = state_dict.pop(f"{prefix}qkv_linear.wqkv.weight")
    for name, part in zip(PARTS, fused.split(module.sizes(), dim=0), strict=True):
        state_dict[f"{prefix}{name}.weight"] = part


def _join_qkv(module: Attention, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: the inverse of :func:`_split_qkv`."""
    keys = [f"{prefix}{name}.weight" for name in PARTS]
    if all(k in state_dict for k in keys):
        parts = [state_dict.pop(k) for k in keys]
        state_dict[f"{prefix}qkv_linear.wqkv.weight"] = torch.cat(parts, dim=0)


def _split_grouped(
    module: FusedQKVLinear, state_dict: dict, prefix: str, local_metadata: Any
) -> None:
    """torchtitan's ``_split_qkv_on_save``: ``wqkv.weight`` (grouped rows) becomes
    ``wq``/``wk``/``wv.weight``, a DTensor gathered to replicated first, as torchtitan does."""
    from torch.distributed.tensor import DTensor, Replicate

    fused = state_dict.pop(f"{prefix}wqkv.weight")
    if isinstance(fused, DTensor):
        fused = fused.redistribute(fused.device_mesh, [Replicate()] * fused.device_mesh.ndim)
    hd, hpk = module.head_dim, module.heads_per_kv
    w = fused.reshape(-1, hpk + 2, hd, fused.shape[1])
    state_dict[f"{prefix}wq.weight"] = w[:, :hpk].reshape(-1, fused.shape[1]).contiguous()
    state_dict[f"{prefix}wk.weight"] = w[:, hpk].reshape(-1, fused.shape[1]).contiguous()
    state_dict[f"{prefix}wv.weight"] = w[:, hpk + 1].reshape(-1, fused.shape[1]).contiguous()


def _join_grouped(module: FusedQKVLinear, state_dict: dict, prefix: str, *args: Any) -> None:
    """torchtitan's ``_merge_qkv_on_load``: the inverse of :func:`_split_grouped`."""
    from torch.distributed.tensor import DTensor, Replicate

    keys = [f"{prefix}{name}.weight" for name in PARTS]
    if not all(k in state_dict for k in keys):
        return
    parts = [state_dict.pop(k) for k in keys]
    if isinstance(parts[0], DTensor):
        parts = [t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim) for t in parts]
    hd, hpk = module.head_dim, module.heads_per_kv
    wq, wk, wv = parts
    n_kv, dim = wk.shape[0] // hd, wq.shape[1]
    q, k, v = (
        wq.reshape(n_kv, hpk, hd, dim),
        wk.reshape(n_kv, 1, hd, dim),
        wv.reshape(n_kv, 1, hd, dim),
    )
    state_dict[f"{prefix}wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, dim)


class TransformerBlock(llama.TransformerBlock):
    """The Llama block (pre-norm attention and SwiGLU) with the fused-q/k/v attention."""

    def __init__(self, config: LlamaConfig, titan: bool = False) -> None:
        super().__init__(config)
        self.attention = Attention(config, titan)


class Llama3(nn.Module):
    """``forward(tokens [B, T]) -> logits [B, T, vocab_size]``."""

    def __init__(self, config: LlamaConfig, titan: bool = False) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config, titan) for i in range(config.n_layers)}
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cfg = self.config
        cos, sin = rope_cos_sin(tokens.shape[1], cfg.head_dim, cfg.rope_theta, device=h.device)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def tiny(**overrides: Any) -> Llama3:
    """A tiny model (the :class:`~examples.models.llama.LlamaConfig` defaults, updated by
    ``overrides``)."""
    return Llama3(LlamaConfig(**overrides))


def titan_tiny(**overrides: Any) -> Llama3:
    """:func:`tiny` with torchtitan's own ``FusedQKVLinear`` (grouped ``wqkv`` rows, whose
    hooks write ``attention.qkv_linear.wq.weight``, ``wk`` and ``wv``)."""
    return Llama3(LlamaConfig(**overrides), titan=True)
