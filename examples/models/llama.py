"""A dense Llama-style decoder in the Meta/torchtitan layout, with fused projections.

Parameter FQNs (no biases)::

    tok_embeddings.weight                      [vocab_size, dim]
    layers.{i}.attention_norm.weight           [dim]
    layers.{i}.attention.wqkv.weight           [n_kv_heads * (q_per_group + 2) * head_dim, dim]
    layers.{i}.attention.wo.weight             [dim, n_heads * head_dim]
    layers.{i}.ffn_norm.weight                 [dim]
    layers.{i}.feed_forward.w13.weight         [2 * ffn_dim, dim]
    layers.{i}.feed_forward.w2.weight          [dim, ffn_dim]
    norm.weight                                [dim]
    output.weight                              [vocab_size, dim]   (absent when tied)

``wqkv`` uses the Megatron "GQA groups" row layout: the rows are ``n_kv_heads`` groups, and
group ``g`` holds the q heads ``g * q_per_group ... (g + 1) * q_per_group - 1`` (``head_dim``
rows each), then k head ``g``, then v head ``g``. A column-parallel shard of whole groups is
therefore a self-contained set of q/k/v heads. ``w13`` holds the gate (w1) rows, then the up
(w3) rows; its TP-local shard is ``[gate_shard; up_shard]``.

The forward reads the number of heads and the FFN width from the (possibly TP-local) weight
shapes, so a module holding only some GQA groups and some FFN columns still runs; its output
is then that rank's partial sum of the row-parallel ``wo``/``w2`` outputs.

With ``tp > 1`` (:func:`tiny_tp_local`, Megatron style) every tensor-parallel module is built
with the shape of one TP rank's shard: ``tok_embeddings``/``output`` hold ``vocab_size // tp``
rows, ``wqkv`` holds ``n_kv_heads // tp`` whole GQA groups, ``w13`` holds
``[gate_shard; up_shard]`` (``2 * ffn_dim // tp`` rows), ``wo`` and ``w2`` hold ``1 / tp`` of
their input columns. :func:`local_tp_state` cuts a full state dict into one rank's. The
attention and feed-forward of such a module compute that rank's partial sums; the trainer's
communication (all-reduce, vocabulary-parallel embedding and logits) is out of this file's
scope.

RoPE uses the Meta/torchtitan *interleaved* convention: the adjacent pairs ``(2j, 2j + 1)`` of
each head form a complex number rotated by ``pos * theta ** (-2j / head_dim)``.

Pipeline parallelism (torchtitan style): :func:`stage_model` cuts a full model, in place, to
one pipeline stage: the layers it keeps (``layers`` is a ``ModuleDict``, so a stage keeps
the global keys ``layers.{i}``; ``renumber=True`` numbers them ``0 .. k-1`` instead, as
Megatron's stage-local numbering), ``tok_embeddings`` only on the first stage, ``norm`` and
``output`` only on the last (dropped modules are set to ``None``). A stage's ``forward``
then takes token ids ``[B, T]`` (first stage) or hidden states ``[B, T, dim]`` (any other),
and returns hidden states ``[B, T, dim]`` (any stage but the last) or logits. Composing the
stages' forwards gives the full model's logits bitwise. :func:`stage_layers` is the even
split of the layers over the stages.

A tied model (``tie_embeddings``) whose last stage is not also its first gets, on that
stage, an ``output`` module holding a *copy* of the embedding (Megatron style): the last
stage's parameter is ``output.weight``, and keeping it tied is the trainer's job (sum the
gradients of ``tok_embeddings.weight`` on the first stage and ``output.weight`` on the last
before every optimizer step, so that the two copies receive the same updates).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope_interleaved",
    "fuse_wqkv",
    "init_weights",
    "local_tp_state",
    "rope_cos_sin",
    "split_wqkv",
    "stage_layers",
    "stage_model",
    "tiny",
    "tiny4",
    "tiny_tied",
    "tiny_tp_local",
]


@dataclass
class LlamaConfig:
    """Hyper-parameters of :class:`Llama`; the defaults give a tiny model."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 96
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    # Megatron style: > 1 builds every tensor-parallel module with its TP-local shape (one
    # TP rank's shard, as ``local_tp_state`` cuts it); 1 builds the full model.
    tp: int = 1

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.tp < 1:
            raise ValueError(f"tp ({self.tp}) must be >= 1")
        for what, n in (
            ("n_kv_heads", self.n_kv_heads),
            ("ffn_dim", self.ffn_dim),
            ("vocab_size", self.vocab_size),
        ):
            if n % self.tp != 0:
                raise ValueError(f"{what} ({n}) must be divisible by tp ({self.tp})")
        if self.tp > 1 and self.tie_embeddings:
            raise ValueError("a TP-local model (tp > 1) cannot tie its embeddings")

    @property
    def q_per_group(self) -> int:
        """Number of q heads sharing one kv head (the size of a GQA group in heads)."""
        return self.n_heads // self.n_kv_heads

    @property
    def group_rows(self) -> int:
        """Rows of ``wqkv`` per GQA group: ``(q_per_group + 2) * head_dim``."""
        return (self.q_per_group + 2) * self.head_dim

    @property
    def qkv_dim(self) -> int:
        """Output features of the fused ``wqkv``."""
        return self.n_kv_heads * self.group_rows


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
    seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return fp32 ``cos`` and ``sin`` of shape ``[seq_len, head_dim // 2]`` for positions 0..T-1.

    Pair ``j`` rotates with frequency ``theta ** (-(2j) / head_dim)`` (as torchtitan's
    ``precompute_freqs_cis``).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    positions = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(positions, inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, head_dim] in the interleaved convention (pairs ``(2j, 2j + 1)``).

    Equivalent to torchtitan's ``apply_rotary_emb``: ``view_as_complex(x) * freqs_cis``, done
    with real arithmetic in fp32 and cast back to ``x.dtype``.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal GQA self-attention with a fused, group-major ``wqkv`` projection."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.q_per_group = config.q_per_group
        tp = config.tp  # > 1: this TP rank's whole GQA groups, and its columns of wo
        self.wqkv = nn.Linear(config.dim, config.qkv_dim // tp, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim // tp, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # [B, T, groups, q_per_group + 2, head_dim]; "groups" is whatever this module holds.
        qkv = self.wqkv(x).view(bsz, seq_len, -1, self.q_per_group + 2, self.head_dim)
        q = qkv[..., : self.q_per_group, :].flatten(2, 3)  # head g * q_per_group + i
        k = qkv[..., self.q_per_group, :]
        v = qkv[..., self.q_per_group + 1, :]

        q = apply_rope_interleaved(q, cos, sin)
        k = apply_rope_interleaved(k, cos, sin)

        # [B, heads, T, head_dim]; q head h reads kv head h // q_per_group.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k = k.repeat_interleave(self.q_per_group, dim=1)
        v = v.repeat_interleave(self.q_per_group, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=1.0 / math.sqrt(self.head_dim)
        )
        return self.wo(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into ``w13``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        ffn = config.ffn_dim // config.tp  # > 1: [gate_shard; up_shard] and w2's columns
        self.w13 = nn.Linear(config.dim, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Dense Llama-style decoder; ``forward(tokens [B, T]) -> logits [B, T, vocab_size]``.

    On a pipeline stage (:func:`stage_model`) ``tok_embeddings`` is ``None`` on every stage
    but the first (the input is then hidden states ``[B, T, dim]``), and ``norm`` and
    ``output`` are ``None`` on every stage but the last (the output is then hidden states).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        vocab = config.vocab_size // config.tp  # > 1: this TP rank's rows of the vocabulary
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(vocab, config.dim)
        # A ModuleDict (as in torchtitan) keeps the FQNs stable when stages drop layers.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config) for i in range(config.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Linear | None = (
            None if config.tie_embeddings else nn.Linear(config.dim, vocab, bias=False)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: ids [B, T] on the first stage (or the whole model), else hidden [B, T, dim].
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        cfg = self.config
        cos, sin = rope_cos_sin(tokens.shape[1], cfg.head_dim, cfg.rope_theta, device=h.device)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is None:  # not the last pipeline stage: hand the hidden states on
            return h
        h = self.norm(h)
        if self.output is not None:
            # Call the module (not F.linear on its weight), so tensor-parallel hooks run.
            return self.output(h)
        if self.tok_embeddings is None:
            raise RuntimeError(
                "a tied last pipeline stage without the embedding needs an output module "
                "(stage_model gives it a copy of the embedding)"
            )
        return F.linear(h, self.tok_embeddings.weight)


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[int]:
    """The global layer indices of pipeline stage ``stage``: an even, consecutive split.

    Raises ``ValueError`` unless ``n_stages`` divides ``n_layers`` and ``0 <= stage <
    n_stages``.
    """
    if n_stages < 1:
        raise ValueError(f"n_stages ({n_stages}) must be >= 1")
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage ({stage}) must be in [0, n_stages={n_stages})")
    if n_layers < 1 or n_layers % n_stages:
        raise ValueError(f"n_layers ({n_layers}) does not split evenly over {n_stages} stages")
    per = n_layers // n_stages
    return list(range(stage * per, (stage + 1) * per))


def stage_model(
    model: Llama, layers: Sequence[int], *, first: bool, last: bool, renumber: bool = False
) -> Llama:
    """Cut a full ``model``, in place, to one pipeline stage, and return it.

    Keeps the blocks ``layers`` (global indices, strictly increasing) under their global keys
    (torchtitan), or under ``"0" .. "k-1"`` with ``renumber=True`` (Megatron); keeps
    ``tok_embeddings`` only if ``first``, ``norm`` and ``output`` only if ``last``, and sets
    the dropped modules to ``None``. ``model.config`` is unchanged (it describes the whole
    pipeline: ``n_layers`` stays the global count).

    A tied model (``config.tie_embeddings``) on a last stage that is not also the first gets
    ``output = nn.Linear(dim, vocab, bias=False)`` holding a copy of the embedding weight
    (same device, dtype and ``requires_grad``): the stage's logits parameter is then
    ``output.weight``, a tied copy that the trainer keeps equal to the first stage's
    ``tok_embeddings.weight`` by summing their gradients (Megatron's shared embedding).
    :func:`init_weights` on such a stage would draw ``output.weight`` from its own seed:
    cut an already initialised model instead.
    """
    keys = list(model.layers.keys())
    full = [str(i) for i in range(model.config.n_layers)]
    if model.tok_embeddings is None or model.norm is None or keys != full:
        raise ValueError("stage_model cuts a full model; this one is already a stage")
    wanted = [int(i) for i in layers]
    if not wanted and not (first or last):
        raise ValueError("a pipeline stage needs at least one layer, or to be first or last")
    if any(b <= a for a, b in itertools.pairwise(wanted)):
        raise ValueError(f"layers {wanted} must be strictly increasing")
    bad = [i for i in wanted if not 0 <= i < model.config.n_layers]
    if bad:
        raise ValueError(f"layers {bad} not in [0, n_layers={model.config.n_layers})")

    embedding = model.tok_embeddings
    if last and not first and model.output is None:
        # Tied: the last stage computes its logits with a copy of the embedding.
        weight = embedding.weight
        output = nn.Linear(
            weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype
        )
        with torch.no_grad():
            output.weight.copy_(weight)
        output.weight.requires_grad_(weight.requires_grad)
        model.output = output
    model.layers = nn.ModuleDict(
        {(str(k) if renumber else str(i)): model.layers[str(i)] for k, i in enumerate(wanted)}
    )
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def split_wqkv(
    wqkv: torch.Tensor, cfg: LlamaConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a group-major fused ``wqkv`` into separate ``(wq, wk, wv)``.

    Shapes for the full tensor: ``wq`` [n_heads * head_dim, dim], ``wk`` and ``wv``
    [n_kv_heads * head_dim, dim]. The number of groups is read from ``wqkv.shape[0]``, so a
    TP-local shard holding whole groups splits into that shard's heads.
    """
    if wqkv.shape[0] % cfg.group_rows != 0:
        raise ValueError(
            f"wqkv has {wqkv.shape[0]} rows, not a multiple of the group size {cfg.group_rows}"
        )
    grouped = wqkv.unflatten(0, (-1, cfg.q_per_group + 2, cfg.head_dim))
    wq = grouped[:, : cfg.q_per_group].flatten(0, 2)
    wk = grouped[:, cfg.q_per_group].flatten(0, 1)
    wv = grouped[:, cfg.q_per_group + 1].flatten(0, 1)
    return wq, wk, wv


def fuse_wqkv(
    wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, cfg: LlamaConfig
) -> torch.Tensor:
    """Inverse of :func:`split_wqkv`: interleave q/k/v rows into the group-major layout."""
    n_groups = wk.shape[0] // cfg.head_dim
    if wq.shape[0] != n_groups * cfg.q_per_group * cfg.head_dim or wv.shape != wk.shape:
        raise ValueError(
            f"inconsistent shapes wq {tuple(wq.shape)}, wk {tuple(wk.shape)}, "
            f"wv {tuple(wv.shape)} for q_per_group={cfg.q_per_group}, head_dim={cfg.head_dim}"
        )
    q = wq.unflatten(0, (n_groups, cfg.q_per_group * cfg.head_dim))
    k = wk.unflatten(0, (n_groups, cfg.head_dim))
    v = wv.unflatten(0, (n_groups, cfg.head_dim))
    return torch.cat((q, k, v), dim=1).flatten(0, 1)


def _param_seed(seed: int, name: str) -> int:
    # crc32 is stable across processes (unlike hash()), so every rank draws the same values.
    return zlib.crc32(f"{seed}:{name}".encode())


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter of ``model`` deterministically from ``seed``.

    Each parameter draws from its own CPU ``torch.Generator`` seeded by ``(seed, fqn)``, so the
    values do not depend on the device, the dtype's device kernels or which other parameters
    exist. Norm weights (FQNs ending in ``norm.weight``) get ``1 + 0.05 * N(0, 1)``, everything
    else ``N(0, std)``. DTensor parameters receive their shard of the same full tensor. Raises
    on meta parameters: materialise them first (e.g. ``model.to_empty(device="cpu")``).
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


def tiny(**overrides: Any) -> Llama:
    """A tiny untied Llama (the :class:`LlamaConfig` defaults, updated by ``overrides``)."""
    return Llama(LlamaConfig(**overrides))


def tiny4(**overrides: Any) -> Llama:
    """:func:`tiny` with 4 layers (a pipeline of 2 or 4 stages splits it evenly)."""
    return Llama(LlamaConfig(**{"n_layers": 4, **overrides}))


def tiny_tied(**overrides: Any) -> Llama:
    """A tiny Llama whose logits reuse ``tok_embeddings.weight`` (no ``output`` module)."""
    return Llama(LlamaConfig(**{"tie_embeddings": True, **overrides}))


def tiny_tp_local(*, tp: int = 2, **overrides: Any) -> Llama:
    """A tiny Llama whose tensor-parallel modules hold one TP rank's shard (Megatron style).

    Every TP rank builds the same shapes; :func:`local_tp_state` gives each rank its values.
    """
    return Llama(LlamaConfig(**{**overrides, "tp": tp}))


def local_tp_state(
    full_state: dict[str, Any], tp_rank: int, tp: int, cfg: LlamaConfig
) -> dict[str, Any]:
    """Cut a full model's state dict into TP rank ``tp_rank``'s state for ``tiny_tp_local``.

    Rows of ``tok_embeddings``/``output`` (the vocabulary), whole GQA groups of ``wqkv``, this
    rank's slice of gate and of up in ``w13`` (``[gate_shard; up_shard]``), and columns of
    ``wo``/``w2``; norms are copied. Values are cloned, so the result shares no storage with
    ``full_state``.
    """
    if tp < 1 or not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank ({tp_rank}) must be in [0, tp={tp})")
    for what, n in (("n_kv_heads", cfg.n_kv_heads), ("ffn_dim", cfg.ffn_dim)):
        if n % tp:
            raise ValueError(f"{what} ({n}) must be divisible by tp ({tp})")

    def part(t: torch.Tensor, dim: int) -> torch.Tensor:
        if t.shape[dim] % tp:
            raise ValueError(f"size {t.shape[dim]} of dim {dim} does not divide by tp ({tp})")
        return t.chunk(tp, dim=dim)[tp_rank]

    out: dict[str, Any] = {}
    for key, value in full_state.items():
        if key in ("tok_embeddings.weight", "output.weight") or key.endswith(
            "attention.wqkv.weight"
        ):
            # wqkv is group-major, so a contiguous 1/tp of its rows is 1/tp of the groups.
            value = part(value, 0)
        elif key.endswith("feed_forward.w13.weight"):
            gate, up = value.chunk(2, dim=0)
            value = torch.cat((part(gate, 0), part(up, 0)), dim=0)
        elif key.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            value = part(value, 1)
        out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out
