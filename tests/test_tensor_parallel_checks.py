"""The block arithmetic of shardspec/checks/tensor_parallel.py (SS036) against a plain
definition, on random module trees: a module's block is its nearest enclosing module
holding two or more Linear or Embedding modules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardspec.checks.tensor_parallel import _blocks, _Module

KINDS = ["linear", "embedding", "RMSNorm", None]


def plain_blocks(modules: dict[str, _Module]) -> dict[str, list[str]]:
    """Every enclosing module counted for every member, then each module's nearest one
    with two or more."""
    members = [n for n, m in modules.items() if m.kind in ("linear", "embedding")]

    def ancestors(name: str) -> list[str]:
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]

    count: dict[str, int] = {}
    for n in members:
        for a in ancestors(n):
            count[a] = count.get(a, 0) + 1
    out: dict[str, list[str]] = {}
    for n in modules:
        block = next((a for a in ancestors(n) if count.get(a, 0) >= 2), None)
        if block is not None:
            out.setdefault(block, []).append(n)
    return out


names = st.lists(st.sampled_from(["a", "b", "c", "0", "1"]), min_size=1, max_size=4).map(".".join)


@settings(max_examples=300, deadline=None)
@given(tree=st.dictionaries(names, st.sampled_from(KINDS), max_size=12))
def test_blocks_match_the_plain_definition(tree: dict[str, str | None]) -> None:
    modules = {n: _Module(n, kind, 0, {}) for n, kind in tree.items()}
    got = {b: [m.name for m in mods] for b, mods in _blocks(modules).items()}
    assert got == plain_blocks(modules)
