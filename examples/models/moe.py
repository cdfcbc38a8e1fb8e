"""A DeepSeek-V4-style MoE decoder whose dense maths equals Hugging Face Qwen3-MoE.

Parameter FQNs (no biases)::

    embed.weight                               [vocab_size, dim]
    layers.{i}.attn_norm.weight                [dim]
    layers.{i}.attn.wq.weight                  [n_heads * head_dim, dim]
    layers.{i}.attn.wk.weight                  [n_kv_heads * head_dim, dim]
    layers.{i}.attn.wv.weight                  [n_kv_heads * head_dim, dim]
    layers.{i}.attn.wo.weight                  [dim, n_heads * head_dim]
    layers.{i}.attn.q_norm.weight              [head_dim]
    layers.{i}.attn.k_norm.weight              [head_dim]
    layers.{i}.ffn_norm.weight                 [dim]
    layers.{i}.moe.router.weight               [n_experts, dim]
    layers.{i}.moe.experts.w1                  [n_experts, moe_ffn_dim, dim]   (gate)
    layers.{i}.moe.experts.w3                  [n_experts, moe_ffn_dim, dim]   (up)
    layers.{i}.moe.experts.w2                  [n_experts, dim, moe_ffn_dim]   (down)
    hc_head.fn                                 [hc_mult, hc_mult * dim]        (hc_mult > 0)
    hc_head.base                               [hc_mult]
    hc_head.scale                              [1]
    norm.weight                                [dim]
    head.weight                                [vocab_size, dim]               (absent when tied)

With ``local_experts=True`` (Megatron style) the stacked ``experts`` module is replaced by the
``n_experts // ep`` experts of one EP rank as separate modules::

    layers.{i}.moe.local_experts.{j}.w1.weight [moe_ffn_dim, dim]
    layers.{i}.moe.local_experts.{j}.w3.weight [moe_ffn_dim, dim]
    layers.{i}.moe.local_experts.{j}.w2.weight [dim, moe_ffn_dim]

where local expert ``j`` on EP rank ``r`` is global expert ``r * (n_experts // ep) + j``.

Each attention module also owns ``fp8_meta``, a parameterless module with TransformerEngine-style
extra state, so the state dict has ``layers.{i}.attn.fp8_meta._extra_state`` entries.

With ``hc_mult == 0`` the forward is exactly Hugging Face's ``Qwen3MoeForCausalLM``: HF
RMSNorm, per-head q/k RMSNorm before RoPE, rotate-half RoPE, GQA attention scaled by
``1 / sqrt(head_dim)``, and a softmax -> top-k (-> renormalise) router whose probabilities are
computed in fp32 and cast back to the activation dtype.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Attention",
    "Block",
    "Experts",
    "FP8Meta",
    "HyperConnectionHead",
    "LocalExpert",
    "MoE",
    "MoEConfig",
    "MoETransformer",
    "RMSNorm",
    "apply_rope",
    "init_weights",
    "local_expert_state",
    "rope_cos_sin",
    "tiny",
    "tiny_local",
    "tiny_qwen3",
]


@dataclass
class MoEConfig:
    """Hyper-parameters of :class:`MoETransformer`; the defaults give a tiny model."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    moe_ffn_dim: int = 32
    n_experts: int = 8
    top_k: int = 2
    norm_topk_prob: bool = True
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hc_mult: int = 2
    local_experts: bool = False
    ep: int = 1
    tie_embeddings: bool = False
    # Experts compute each expert on its routed rows only (a loop over the experts that
    # received rows, as transformers' experts modules do) instead of every expert on every
    # row: the same sums in the same order, for benchmarks. Off: the reference maths.
    sparse_experts: bool = False

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in [1, n_experts={self.n_experts}]")
        if self.ep < 1 or self.n_experts % self.ep != 0:
            raise ValueError(f"ep ({self.ep}) must be >= 1 and divide n_experts ({self.n_experts})")
        if self.hc_mult < 0:
            raise ValueError(f"hc_mult ({self.hc_mult}) must be >= 0")

    @property
    def n_local_experts(self) -> int:
        """Experts held by one EP rank: ``n_experts // ep``."""
        return self.n_experts // self.ep


class RMSNorm(nn.Module):
    """RMSNorm computed like Hugging Face: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``cos`` and ``sin`` [seq_len, head_dim] for the rotate-half RoPE convention.

    As Hugging Face: fp32 ``freqs = pos * theta ** (-(2j) / head_dim)``, duplicated as
    ``cat(freqs, freqs)``, then cast to ``dtype`` (the activation dtype).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    positions = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, heads, T, head_dim] in the rotate-half convention (cos/sin [T, hd])."""
    return x * cos + _rotate_half(x) * sin


class FP8Meta(nn.Module):
    """Stand-in for TransformerEngine fp8 metadata: no parameters, only ``_extra_state``."""

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, Any] = {"scale": 1.0}

    def get_extra_state(self) -> dict[str, Any]:
        """Return the state saved under ``<fqn>._extra_state``."""
        return dict(self.state)

    def set_extra_state(self, state: Any) -> None:
        """Restore the state produced by :meth:`get_extra_state`."""
        self.state = dict(state)


class Attention(nn.Module):
    """Qwen3 causal GQA self-attention: separate q/k/v, per-head q/k RMSNorm before RoPE."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.q_per_kv = config.n_heads // config.n_kv_heads
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.fp8_meta = FP8Meta()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # Head counts come from the (possibly TP-local) weight shapes.
        q = self.q_norm(self.wq(x).view(bsz, seq_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(bsz, seq_len, -1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(self.q_per_kv, dim=1)
        v = v.repeat_interleave(self.q_per_kv, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=1.0 / math.sqrt(self.head_dim)
        )
        return self.wo(out.transpose(1, 2).flatten(2))


def expert_ffn(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """One SwiGLU expert: ``w2 @ (silu(w1 @ x) * (w3 @ x))`` for rows ``x`` [N, dim]."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class Experts(nn.Module):
    """All experts' weights stacked on dim 0 (``w1``/``w3`` [E, ffn, dim], ``w2`` [E, dim, ffn])."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        e, f, d = config.n_experts, config.moe_ffn_dim, config.dim
        self.w1 = nn.Parameter(torch.empty(e, f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))
        self.w3 = nn.Parameter(torch.empty(e, f, d))
        self.sparse = config.sparse_experts
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Default init, N(0, 0.02) (a no-op on the meta device)."""
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(w1, w3, w2)`` of each expert, in expert order."""
        return [(self.w1[e], self.w3[e], self.w2[e]) for e in range(self.w1.shape[0])]

    def expert_parallel(self) -> tuple[int, Any] | None:
        """When ``parallelize`` placed the experts on an expert-parallel mesh axis (its
        ``style none``: stacked experts as a DTensor sharded on dim 0): the first expert
        this rank holds and that axis's process group; else ``None``."""
        w = self.w1
        if not hasattr(w, "device_mesh"):
            return None
        from torch.distributed.tensor import Shard

        mesh = w.device_mesh
        for i, p in enumerate(w.placements):
            if isinstance(p, Shard) and p.dim == 0:
                n_local = w.to_local().shape[0]
                return mesh.get_local_rank(i) * n_local, mesh.get_group(i)
        return None

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``hidden_states`` [N, dim] routed to experts ``top_k_index`` [N, k] with
        weights ``top_k_weights`` [N, k] -> [N, dim] (transformers' experts convention; an
        index equal to the expert count selects nothing).

        Reference maths, not a fast kernel: every expert processes every row and rows not
        routed to it get weight 0, which keeps all shapes static (so the forward also runs on
        meta tensors and under ``torch.compile``) and sums the experts in ascending order like
        Hugging Face. With ``sparse_experts`` (:meth:`routed_rows_only`) each expert runs on
        its own rows only.
        """
        ep = self.expert_parallel()
        if ep is not None:
            return self._expert_parallel(hidden_states, top_k_index, top_k_weights, *ep)
        if self.sparse:
            return self.routed_rows_only(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        for e, (w1, w3, w2) in enumerate(self.expert_weights()):
            # [N]: this expert's routing weight per row, 0 where it was not selected.
            gate = (top_k_weights * (top_k_index == e)).sum(dim=-1)
            out = out + expert_ffn(hidden_states, w1, w3, w2) * gate[:, None]
        return out

    def routed_rows_only(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`forward`'s sums, each expert computed on the rows routed to it only (the
        experts that received no row are skipped), as transformers' experts modules loop.
        Each row adds its experts' weighted outputs in ascending expert order, as the
        reference does; the rows not routed to an expert, which the reference adds ``0`` for,
        are left alone. Shapes depend on the routing (not for the meta device)."""
        n_experts = self.w1.shape[0]
        hits = torch.bincount(top_k_index.reshape(-1), minlength=n_experts + 1)[:n_experts]
        out = torch.zeros_like(hidden_states)
        for e in hits.nonzero().flatten().tolist():
            token, slot = torch.where(top_k_index == e)
            rows = expert_ffn(hidden_states[token], self.w1[e], self.w3[e], self.w2[e])
            out = out.index_add(0, token, rows * top_k_weights[token, slot, None])
        if not bool(hits.any()):
            # No expert computes: tie the output to the experts' weights, the input and the
            # routing weights (zero gradients, as the reference's weight-0 rows give).
            tied = (hidden_states, top_k_weights, self.w1, self.w2, self.w3)
            out = out + sum(t.reshape(-1)[:0].sum() for t in tied)
        return out

    def _expert_parallel(
        self,
        rows: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        first: int,
        group: Any,
    ) -> torch.Tensor:
        """Expert parallelism over a group whose ranks see the same tokens (``style none``):
        each computes its own experts' weighted outputs, and the partial sums are added over
        the group (the same arithmetic as :meth:`forward`, summed in another order). Tokens
        never move; the expert-parallel style with token dispatch
        (``shardspec.runtime.expert_parallel``) is the scalable alternative."""
        # Megatron's copy to / reduce from a model-parallel region (identity forward and
        # gradients summed over the group; a sum over the group forward, identity backward).
        from shardspec.runtime.expert_parallel import copy_to_group, reduce_from_group

        rows_in = copy_to_group(rows, group)
        weights_in = copy_to_group(weights, group)
        w1, w3, w2 = (w.to_local() for w in (self.w1, self.w3, self.w2))
        out = torch.zeros_like(rows)
        for j in range(w1.shape[0]):
            gate = (weights_in * (indices == first + j)).sum(dim=-1)
            out = out + expert_ffn(rows_in, w1[j], w3[j], w2[j]) * gate[:, None]
        return reduce_from_group(out, group)


class LocalExpert(nn.Module):
    """One Megatron-style expert as its own module of three bias-free linears."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.moe_ffn_dim, bias=False)
        self.w2 = nn.Linear(config.moe_ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.moe_ffn_dim, bias=False)


class MoE(nn.Module):
    """Top-k routed mixture of SwiGLU experts, as ``Qwen3MoeSparseMoeBlock``: route, then
    call the experts module (:meth:`Experts.forward`, reference maths)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.norm_topk_prob = config.norm_topk_prob
        self.ep = config.ep
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts: Experts | None = None
        self.local_experts: nn.ModuleList | None = None
        if config.local_experts:
            self.local_experts = nn.ModuleList(
                LocalExpert(config) for _ in range(config.n_local_experts)
            )
        else:
            self.experts = Experts(config)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(weights, indices)`` [N, top_k] for rows ``x`` [N, dim].

        As Hugging Face: softmax of the router logits in fp32, top-k, optional renormalisation,
        then a cast back to the logits' dtype.
        """
        logits = F.linear(x, self.router.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, then call the experts: ``self.experts(rows, top_k_index, top_k_weights)``
        (the call an expert-parallel style dispatches tokens around)."""
        rows = x.reshape(-1, x.shape[-1])
        weights, indices = self.route(rows)
        if self.local_experts is None:
            assert self.experts is not None
            return self.experts(rows, indices, weights).view_as(x)
        if self.ep != 1:
            raise NotImplementedError(
                f"the local-experts MoE holds only {len(self.local_experts)} of the experts "
                f"(ep={self.ep}); its forward needs a token dispatch, which this reference "
                "model does not implement. Use ep=1 or the stacked experts."
            )
        out = torch.zeros_like(rows)
        for e, expert in enumerate(self.local_experts):
            gate = (weights * (indices == e)).sum(dim=-1)
            out = (
                out
                + expert_ffn(rows, expert.w1.weight, expert.w3.weight, expert.w2.weight)
                * (gate[:, None])
            )
        return out.view_as(x)


class Block(nn.Module):
    """Pre-norm decoder block: ``h = x + attn(norm(x)); out = h + moe(norm(h))``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.moe = MoE(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin)
        return h + self.moe(self.ffn_norm(h))


class HyperConnectionHead(nn.Module):
    """A tiny hyper-connection head mixing ``hc_mult`` copies of the residual stream.

    ``w = sigmoid((x.repeat(hc) @ fn.T) * scale + base)``; ``out = x * w.sum(-1) / hc``.
    """

    def __init__(self, dim: int, hc_mult: int) -> None:
        super().__init__()
        self.hc_mult = hc_mult
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * dim))
        self.base = nn.Parameter(torch.empty(hc_mult))
        self.scale = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Default init: ``fn`` N(0, 0.02), ``base`` 0, ``scale`` 1 (a no-op on meta)."""
        nn.init.normal_(self.fn, std=0.02)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.repeat(*([1] * (x.dim() - 1)), self.hc_mult)
        w = torch.sigmoid(F.linear(xs, self.fn) * self.scale + self.base)
        return x * w.sum(dim=-1, keepdim=True) / self.hc_mult


class MoETransformer(nn.Module):
    """MoE decoder; ``forward(tokens [B, T]) -> logits [B, T, vocab_size]``.

    On a pipeline stage (a spec's ``split_stage``) ``embed`` is ``None`` on every stage but
    the first (the input is then hidden states ``[B, T, dim]``), and ``hc_head``, ``norm``
    and ``head`` are ``None`` on every stage but the last (the output is then hidden
    states), as torchtitan's models skip the modules a stage does not hold.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.embed: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layers)})
        self.hc_head = (
            HyperConnectionHead(config.dim, config.hc_mult) if config.hc_mult > 0 else None
        )
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.head: nn.Linear | None = (
            None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: ids [B, T] on the first stage (or the whole model), else hidden [B, T, dim].
        h = tokens if self.embed is None else self.embed(tokens)
        cfg = self.config
        cos, sin = rope_cos_sin(
            tokens.shape[1], cfg.head_dim, cfg.rope_theta, device=h.device, dtype=h.dtype
        )
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is None:  # not the last pipeline stage: hand the hidden states on
            return h
        if self.hc_head is not None:
            h = self.hc_head(h)
        h = self.norm(h)
        if self.head is not None:
            return F.linear(h, self.head.weight)
        if self.embed is None:
            raise RuntimeError(
                "a tied last pipeline stage without the embedding needs a head module "
                "holding the tied weight (tie head.weight = embed.weight in the spec)"
            )
        return F.linear(h, self.embed.weight)


def local_expert_state(
    full_state: dict[str, Any], ep_rank: int, ep: int, cfg: MoEConfig
) -> dict[str, Any]:
    """Turn a stacked model's state dict into the local-experts model's state dict for a rank.

    ``layers.{i}.moe.experts.w{1,2,3}`` [n_experts, ...] becomes
    ``layers.{i}.moe.local_experts.{j}.w{1,2,3}.weight`` = ``w{1,2,3}[ep_rank * n_local + j]``
    (cloned, so the result shares no storage with ``full_state``); all other keys are copied.
    """
    if ep < 1 or cfg.n_experts % ep != 0:
        raise ValueError(f"ep ({ep}) must be >= 1 and divide n_experts ({cfg.n_experts})")
    if not 0 <= ep_rank < ep:
        raise ValueError(f"ep_rank ({ep_rank}) must be in [0, {ep})")
    n_local = cfg.n_experts // ep
    out: dict[str, Any] = {}
    for key, value in full_state.items():
        prefix, sep, name = key.rpartition("moe.experts.")
        if not sep or name not in ("w1", "w2", "w3"):
            out[key] = value
            continue
        if value.shape[0] != cfg.n_experts:
            raise ValueError(f"{key} has {value.shape[0]} experts, expected {cfg.n_experts}")
        for j in range(n_local):
            out[f"{prefix}moe.local_experts.{j}.{name}.weight"] = value[
                ep_rank * n_local + j
            ].clone()
    return out


def _param_seed(seed: int, name: str) -> int:
    # crc32 is stable across processes (unlike hash()), so every rank draws the same values.
    return zlib.crc32(f"{seed}:{name}".encode())


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter of ``model`` deterministically from ``seed``.

    Each parameter draws from its own CPU ``torch.Generator`` seeded by ``(seed, fqn)``, so the
    values do not depend on the device or on which other parameters exist. Norm weights (FQNs
    ending in ``norm.weight``) get ``1 + 0.05 * N(0, 1)``, everything else ``N(0, std)``.
    DTensor parameters receive their shard of the same full tensor. Raises on meta parameters:
    materialise them first (e.g. ``model.to_empty(device="cpu")``).
    """
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device; materialise it first")
        gen = torch.Generator().manual_seed(_param_seed(seed, name))
        value = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        value = 1.0 + 0.05 * value if name.endswith("norm.weight") else std * value
        _copy_full_value(param, value)


def _copy_full_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the full tensor ``value`` into ``param`` (a plain tensor or a DTensor)."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(param, DTensor):
            local = param.to_local()
            value = value.to(device=local.device, dtype=local.dtype)
            # src_data_rank=None: every rank has the same value, so shard locally without comms.
            value = distribute_tensor(
                value, param.device_mesh, param.placements, src_data_rank=None
            )
    param.copy_(value)


def tiny(**overrides: Any) -> MoETransformer:
    """A tiny MoE with stacked experts and a hyper-connection head (``hc_mult=2``)."""
    return MoETransformer(MoEConfig(**overrides))


def tiny_local(*, ep: int = 2, **overrides: Any) -> MoETransformer:
    """A tiny MoE holding one EP rank's ``n_experts // ep`` experts as separate modules."""
    return MoETransformer(MoEConfig(**{"local_experts": True, "ep": ep, **overrides}))


def tiny_qwen3(**overrides: Any) -> MoETransformer:
    """A tiny MoE without the hyper-connection head: exactly Hugging Face Qwen3-MoE maths."""
    return MoETransformer(MoEConfig(**{"hc_mult": 0, **overrides}))
