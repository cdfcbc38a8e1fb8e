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

NAMES: tuple[str, ...] = (OWN, *SPLITS)


def split_of(layout: str, fqn: str) -> tuple[str, ...] | None:
    """The leaf names key layout ``layout`` presents the components of parameter ``fqn``
    (``...<module>.<param>``) as, or None where it stores the parameter whole."""
    module = fqn.rpartition(".")[0]
    return dict(SPLITS.get(layout, ())).get(module.rpartition(".")[2])
