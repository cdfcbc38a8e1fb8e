"""A tiny model built from torchtitan's fused SwiGLU overrides, whose state dict does not
say that gate and up are one parameter.

torchtitan's ``torchtitan/overrides/fused_swiglu.py`` (read in github:pytorch/torchtitan at
commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a) replaces the feed-forward's ``w1``/``w3``
by one parameter ``w13``:

* ``FusedSwiGLU``: ``w13`` of shape ``[hidden_dim, 2, dim]`` (``w13[:, 0]`` the gate, the
  stock ``w1``; ``w13[:, 1]`` the up, the stock ``w3``), ``w2`` a plain ``Linear``. Its
  ``_split_w13_on_save`` state-dict post-hook writes ``{prefix}w1.weight`` =
  ``w13[:, 0].contiguous()`` and ``{prefix}w3.weight`` = ``w13[:, 1].contiguous()``
  instead of ``{prefix}w13``; its ``_merge_w13_on_load`` pre-hook stacks them back
  (``dim=1``). Tensor parallelism shards ``w13`` ``Shard(0)`` (hidden) over tp, FSDP its
  dimension 0 too; the size-2 dimension is never sharded.
* ``FusedGroupedExperts``: ``w13`` of shape ``[num_experts, hidden_dim, 2, dim]``,
  ``w2_EDF`` ``[num_experts, dim, hidden_dim]``; the hooks write ``{prefix}w1_EFD`` =
  ``w13[:, :, 0, :]`` and ``{prefix}w3_EFD`` = ``w13[:, :, 1, :]`` (stacked back on
  ``dim=2``). EP shards dimension 0, TP dimension 1 (hidden).

The classes below are those modules with the same parameters, shapes and hooks (the
forward computes the same SwiGLU with plain torch ops instead of torchtitan's Triton
kernel, and the experts take every token, unrouted). Parameters::

    tok_embeddings.weight               [vocab, dim]
    layers.{i}.feed_forward.w13         [hidden, 2, dim]
    layers.{i}.feed_forward.w2.weight   [dim, hidden]
    layers.{i}.moe.experts.w13          [experts, hidden, 2, dim]
    layers.{i}.moe.experts.w2_EDF       [experts, dim, hidden]
    output.weight                       [vocab, dim]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FusedGroupedExperts", "FusedSwiGLU", "TitanSwiGLU", "tiny"]


def _split_w13(state_dict: dict, prefix: str, keys: tuple[str, str], dim: int) -> None:
    """torchtitan's ``_split_w13_on_save``: ``{prefix}w13`` becomes ``keys``, index 0 and 1
    of its size-2 dimension ``dim`` (``w13[:, 0]``, ``w13[:, :, 0, :]``), contiguous."""
    w13 = state_dict.pop(f"{prefix}w13")
    for i, key in enumerate(keys):
        state_dict[f"{prefix}{key}"] = w13.select(dim, i).contiguous()


def _merge_w13(state_dict: dict, prefix: str, keys: tuple[str, str], dim: int) -> None:
    """torchtitan's ``_merge_w13_on_load``: ``keys`` stacked back on ``dim`` into
    ``{prefix}w13`` when both are there."""
    if all(f"{prefix}{k}" in state_dict for k in keys):
        parts = [state_dict.pop(f"{prefix}{k}") for k in keys]
        state_dict[f"{prefix}w13"] = torch.stack(parts, dim=dim)


class FusedSwiGLU(nn.Module):
    """torchtitan's ``FusedSwiGLU``: ``w13 [hidden, 2, dim]``, checkpointed as
    ``w1.weight``/``w3.weight``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(hidden, 2, dim))
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.register_state_dict_post_hook(self._split_w13_on_save)
        self.register_load_state_dict_pre_hook(self._merge_w13_on_load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("...d,hgd->...hg", x, self.w13).unbind(-1)
        return self.w2(F.silu(gate) * up)

    @staticmethod
    def _split_w13_on_save(module: nn.Module, state_dict: dict, prefix: str, meta: Any) -> None:
        _split_w13(state_dict, prefix, ("w1.weight", "w3.weight"), 1)

    @staticmethod
    def _merge_w13_on_load(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        _merge_w13(state_dict, prefix, ("w1.weight", "w3.weight"), 1)


class FusedGroupedExperts(nn.Module):
    """torchtitan's ``FusedGroupedExperts``: ``w13 [experts, hidden, 2, dim]`` and
    ``w2_EDF``, checkpointed as ``w1_EFD``/``w3_EFD``."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(experts, hidden, 2, dim))
        self.w2_EDF = nn.Parameter(torch.empty(experts, dim, hidden))
        self.register_state_dict_post_hook(self._split_w13_on_save)
        self.register_load_state_dict_pre_hook(self._merge_w13_on_load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("...d,efgd->...efg", x, self.w13).unbind(-1)
        return torch.einsum("...ef,edf->...d", F.silu(gate) * up, self.w2_EDF)

    @staticmethod
    def _split_w13_on_save(module: nn.Module, state_dict: dict, prefix: str, meta: Any) -> None:
        _split_w13(state_dict, prefix, ("w1_EFD", "w3_EFD"), 2)

    @staticmethod
    def _merge_w13_on_load(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        _merge_w13(state_dict, prefix, ("w1_EFD", "w3_EFD"), 2)


class MoE(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.experts = FusedGroupedExperts(experts, dim, hidden)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.feed_forward = FusedSwiGLU(dim, hidden)
        self.moe = MoE(experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.feed_forward(x)
        return x + self.moe.experts(x)


class TitanSwiGLU(nn.Module):
    """Embedding, blocks of a fused SwiGLU and fused grouped experts, output projection."""

    def __init__(
        self, vocab: int = 64, dim: int = 16, hidden: int = 32, experts: int = 4, layers: int = 2
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, hidden, experts) for i in range(layers)})
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers.values():
            x = block(x)
        return self.output(x)


def tiny(**overrides: Any) -> TitanSwiGLU:
    return TitanSwiGLU(**overrides)
