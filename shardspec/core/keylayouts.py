"""Checkpoint key layouts by name (``checkpoint keys NAME``, ``keys=`` of save/load): plain
data, read by the compiler (lint, codegen, diff) and by the runtime
(:mod:`shardspec.runtime.units`, which builds its ``KeyLayout`` objects from it)."""

from __future__ import annotations

# shardspec's own layout: every fused parameter stored per component (or whole, where its
# `fuse` item says `stored fused`).
OWN = "shardspec"

# name -> (the leaf name of a fused module -> the leaf names of the modules a trainer's
# state-dict hook presents its components as, in declared order). torchtitan: its
# FusedQKVLinear (torchtitan/models/common/attention.py) holds `wqkv` and its hooks write
# `wq`, `wk`, `wv` (read at commit b5bcd76 and in the torchtitan 0.3.0 wheel).
SPLITS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "torchtitan": (("wqkv", ("wq", "wk", "wv")),),
}

# name -> (the leaf name of a fused parameter, its tensor's dimension count, the keys, under
# its module, that a trainer's state-dict hook presents its squeezed components as, in
# declared order). torchtitan: its FusedSwiGLU `w13` [hidden, 2, dim] is written as
# `w1.weight`/`w3.weight` and its FusedGroupedExperts `w13` [experts, hidden, 2, dim] as
# `w1_EFD`/`w3_EFD`, each `w13` indexed on its size-2 dimension (torchtitan/overrides/
# fused_swiglu.py, `_split_w13_on_save`, read at commit b5bcd76).
PARAM_SPLITS: dict[str, tuple[tuple[str, int, tuple[str, ...]], ...]] = {
    "torchtitan": (("w13", 3, ("w1.weight", "w3.weight")), ("w13", 4, ("w1_EFD", "w3_EFD"))),
}

NAMES: tuple[str, ...] = (OWN, *SPLITS)


def split_of(layout: str, fqn: str) -> tuple[str, ...] | None:
    """The leaf names key layout ``layout`` presents the components of parameter ``fqn``
    (``...<module>.<param>``) as, or None where it stores the parameter whole."""
    module = fqn.rpartition(".")[0]
    return dict(SPLITS.get(layout, ())).get(module.rpartition(".")[2])


def param_split_of(
    table: tuple[tuple[str, int, tuple[str, ...]], ...], fqn: str, ndim: int
) -> tuple[str, ...] | None:
    """The keys (under its module) a :data:`PARAM_SPLITS` table presents the squeezed
    components of parameter ``fqn``, a tensor of ``ndim`` dimensions, as; None where it
    names no such parameter."""
    leaf = fqn.rpartition(".")[2]
    return next((keys for name, n, keys in table if name == leaf and n == ndim), None)


def hook_keys(layout: str, fqn: str, ndim: int) -> tuple[tuple[str, ...], bool] | None:
    """The full keys key layout ``layout`` stores the components of fused parameter ``fqn``
    (``ndim`` tensor dimensions) under, and whether the hooks squeeze them (each one index
    of the fused dimension, stored without it); None where it stores the parameter whole."""
    module, _, leaf_param = fqn.rpartition(".")
    pre = f"{module}." if module else ""
    squeezed = param_split_of(PARAM_SPLITS.get(layout, ()), fqn, ndim)
    if squeezed is not None:
        return tuple(pre + k for k in squeezed), True
    split = split_of(layout, fqn)
    if split is None:
        return None
    parent = module.rpartition(".")[0]
    return tuple((f"{parent}." if parent else "") + f"{n}.{leaf_param}" for n in split), False
