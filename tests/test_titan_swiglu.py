"""torchtitan's fused SwiGLU overrides (``torchtitan/overrides/fused_swiglu.py``, read in
github:pytorch/torchtitan at commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a:
``FusedSwiGLU.w13 [hidden, 2, dim]`` checkpointed as ``w1.weight``/``w3.weight``,
``FusedGroupedExperts.w13 [experts, hidden, 2, dim]`` as ``w1_EFD``/``w3_EFD``, each one
index of the size-2 dimension, squeezed): the `fuse DIM as A, B squeezed` form in both
readers and fmt, its lint (SS050, SS051, SS131), the compiler's key and explain facts,
the canonical units (one process), and on 4 gloo ranks (``tests/titan_swiglu_scenarios.py``)
checkpoints exchanged with torchtitan's checkpointer both ways, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardspec.api import compile_specs
from shardspec.core.layout import LayoutError, Mesh, RuleSpec, build_layout
from shardspec.diff.facts import Status
from shardspec.diff.render import render_text
from shardspec.explain.facts import explain_facts
from shardspec.explain.render import render_text as explain_text
from shardspec.frontend import ir
from shardspec.frontend.fastparse import fast_statements
from shardspec.frontend.fmt import format_text
from shardspec.frontend.parse import parse
from shardspec.runtime.canonical import rank_pieces
from tests import titan_swiglu_scenarios
from tests.test_ckpt_keys import _diff, _lint
from tests.test_torchtitan_ckpt import assert_ranks, write_manifest

CASE = Path(__file__).resolve().parent / "cases" / "fused_swiglu"
SPEC = (CASE / "spec.shard").read_text()
DENSE = "    fuse pair as w1, w3 squeezed\n    shard hidden over tp\n"
EXPECTED = {"[torchtitan->shardspec]": 1, "[shardspec->torchtitan]": 2, "[own]": 1}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the stand-in's manifest (with its hooks' keys)."""
    out = tmp_path_factory.mktemp("swiglu")
    write_manifest(out, "examples.models.titan_swiglu:tiny")
    return out


# ----------------------------------------------------------------------------- language


def test_squeezed_parses_in_both_readers_and_formats() -> None:
    text = "param w13 [h, p, d] {\n    fuse p as w1,w3   squeezed stored fused\n}\n"
    assert fast_statements(text, ir.Source("s.shard", text)) is not None  # it reads it
    for fast in (True, False):
        spec, diags = parse(text, "s.shard", fast=fast)
        assert spec is not None and not diags
        fuse = spec.rules[0].fusions[0]
        assert fuse.squeezed and fuse.stored_fused
        assert [c.name.text for c in fuse.components] == ["w1", "w3"]
    plain, _ = parse(text.replace(" squeezed", ""), "s.shard")
    assert plain is not None and not plain.rules[0].fusions[0].squeezed
    formatted, _ = format_text(text, "s.shard")
    assert formatted is not None and "    fuse p as w1, w3 squeezed stored fused\n" in formatted
    assert format_text(formatted, "s.shard")[0] == formatted


def test_squeezed_is_no_name_elsewhere() -> None:
    """`squeezed` is a keyword only after a fuse item's components: a dimension, a
    component or an axis may be called so."""
    text = "param squeezed [squeezed, p] {\n    fuse squeezed as a, b\n}\n"
    for fast in (True, False):
        spec, diags = parse(text, "s.shard", fast=fast)
        assert spec is not None and not diags, diags
        assert not spec.rules[0].fusions[0].squeezed


# ----------------------------------------------------------------------------- lint


def test_lint_accepts_torchtitans_layout(root: Path) -> None:
    assert _lint(root, "ok", SPEC) == []
    assert _lint(root, "own", SPEC.replace("checkpoint keys torchtitan\n", "")) == []


def test_ss131_unsqueezed_components_in_torchtitans_keys(root: Path) -> None:
    found = [f for f in _lint(root, "plain", SPEC.replace(" squeezed\n", "\n")) if "SS131" in f]
    assert len(found) == 2, found
    assert "components as w1, w3 (each one index of the fused dimension, squeezed)" in found[0]
    assert "declares 2 (w1, w3)" in found[0]
    assert "e.g. `fuse pair as w1, w3 squeezed`" in found[0]
    assert "components as w1_EFD, w3_EFD" in found[1]
    # shardspec's own key layout stores either form
    own = SPEC.replace(" squeezed\n", "\n").replace("checkpoint keys torchtitan\n", "")
    assert not [f for f in _lint(root, "plain-own", own) if "SS131" in f]


def test_ss050_squeezed_size_is_the_component_count(root: Path) -> None:
    text = SPEC.replace("fuse pair as w1, w3 squeezed", "fuse pair as w1, w2, w3 squeezed", 1)
    found = [f for f in _lint(root, "three", text) if f.startswith("SS0")]
    assert len(found) == 1 and found[0].startswith("SS050"), found
    assert "'pair' is squeezed, so each of its 3 component(s) is one index of it" in found[0]
    assert "has size 2" in found[0]


def test_ss051_squeezed_dimension_not_sharded(root: Path) -> None:
    text = SPEC.replace(DENSE, "    fuse pair as w1, w3 squeezed\n    shard pair over tp\n", 1)
    found = [f for f in _lint(root, "cut", text) if f.startswith("SS0")]
    assert len(found) == 1 and found[0].startswith("SS051"), found
    assert "'pair' is squeezed (each component one index of it), but tp shards it" in found[0]
    # not squeezed, the same cut is a split of 1-row components (the older message)
    plain = text.replace(" squeezed\n", "\n").replace("checkpoint keys torchtitan\n", "")
    assert "not divisible by tp=2" in " ".join(_lint(root, "cut-plain", plain))


def test_checkpoint_shard_cannot_cut_a_squeezed_dimension() -> None:
    rule = RuleSpec(
        "w13",
        ("hidden", "pair", "dim"),
        fuse=(("pair", (("w1", None), ("w3", None)), 1),),
        squeezed=("pair",),
        ckpt_shard=(("pair", ("dp",)),),
    )
    with pytest.raises(LayoutError, match="`checkpoint shard` cuts it over dp"):
        build_layout(rule, (8, 2, 4), {"dp": 2})


def test_generated_module_carries_squeezed() -> None:
    """The golden module of the case (tests/cases/fused_swiglu) gives both w13 rules
    ``squeezed=("pair",)``, which the runtime's layouts read."""
    text = (CASE / "expected.py").read_text()
    assert text.count('squeezed=("pair",),') == 2
    assert 'CHECKPOINT_KEYS: str | None = "torchtitan"' in text


# ----------------------------------------------------------------------------- diff, explain


def test_diff_sees_squeezed_shapes_and_torchtitans_keys(root: Path) -> None:
    """Adding `squeezed` in shardspec's own layout keeps the keys and changes the stored
    shapes ([32, 1, 16] -> [32, 16]): checkpoint-incompatible; switching to torchtitan's
    keys renames the components to the hooks' keys."""
    own = SPEC.replace("checkpoint keys torchtitan\n", "")
    plain = own.replace(" squeezed\n", "\n")
    added = _diff(root, plain, own)
    assert added.status == Status.INCOMPATIBLE
    text = render_text(added)
    assert "layers.*.feed_forward.w13.w1 (2 keys)" in text
    assert "global shape [32, 1, 16] under OLD, [32, 16] under NEW" in text
    assert "global shape [4, 32, 1, 16] under OLD, [4, 32, 16] under NEW" in text
    assert "[fused: w1 1, w3 1 squeezed]" in text
    titan = render_text(_diff(root, own, SPEC))
    assert "as .w1, .w3 under OLD and as w1.weight, w3.weight under NEW" in titan
    assert "as .w1, .w3 under OLD and as w1_EFD, w3_EFD under NEW" in titan
    assert _diff(root, SPEC, SPEC).status == Status.SAME


def test_explain_shows_the_hooks_keys(root: Path) -> None:
    (root / "k.shard").write_text(SPEC)
    (root / "o.shard").write_text(SPEC.replace("checkpoint keys torchtitan\n", ""))
    dense, experts = "layers.0.feed_forward.w13", "layers.1.moe.experts.w13"
    got = {}
    for f in ("k.shard", "o.shard"):
        for n in (dense, experts):
            text = explain_text(explain_facts(str(root / f), n, {}, None))
            got[(f, n)] = next(x for x in text.splitlines() if "checkpoint keys" in x)
            assert "pair=2 [fused: w1 1, w3 1 squeezed]" in text
    assert got[("k.shard", dense)] == (
        f"  checkpoint keys (torchtitan): {dense[:-4]}.w1.weight, {dense[:-4]}.w3.weight"
    )
    assert got[("k.shard", experts)] == (
        f"  checkpoint keys (torchtitan): {experts[:-4]}.w1_EFD, {experts[:-4]}.w3_EFD"
    )
    assert got[("o.shard", dense)] == f"  checkpoint keys (shardspec): {dense}.w1, {dense}.w3"


# ----------------------------------------------------------------------------- units


def test_squeezed_units_drop_the_dimension() -> None:
    """Each rank's units of a squeezed w13 (hidden over tp 2): one per component, its
    global shape without the fused dimension, its cut of the local tensor selecting one
    index of it (the hooks' ``w13[:, 0]``/``w13[:, 1]``)."""
    rule = RuleSpec(
        "w13",
        ("hidden", "pair", "dim"),
        shard=(("hidden", ("tp",)),),
        fuse=(("pair", (("w1", None), ("w3", None)), 1),),
        squeezed=("pair",),
    )
    layout = build_layout(rule, (8, 2, 4), {"tp": 2})
    pieces = rank_pieces(layout, Mesh(("tp",), (2,)))
    got = [[(p.component, p.shape, p.offsets, p.sizes, p.squeeze) for p in row] for row in pieces]
    assert got == [
        [("w1", (8, 4), (0, 0), (4, 4), 1), ("w3", (8, 4), (0, 0), (4, 4), 1)],
        [("w1", (8, 4), (4, 0), (4, 4), 1), ("w3", (8, 4), (4, 0), (4, 4), 1)],
    ]
    from shardspec.runtime.units import Unit, unit_commit, unit_commit_box, unit_data

    local = torch.arange(4 * 2 * 4, dtype=torch.float32).reshape(4, 2, 4)
    for k, p in enumerate(pieces[1]):
        unit = Unit("k", "k", p.shape, p.offsets, p.sizes, p.runs, (1,), 4, p.fused, p.squeeze)
        assert torch.equal(unit_data(unit, local), local[:, k])
        target = torch.zeros_like(local)
        unit_commit(unit, target, local[:, k].clone())
        assert torch.equal(target[:, k], local[:, k]) and not target[:, 1 - k].any()
        target.zero_()
        unit_commit_box(unit, target, (1, 2), (2, 2), local[1:3, k, 2:].clone())
        assert torch.equal(target[1:3, k, 2:], local[1:3, k, 2:]) and target.count_nonzero() == 4


def test_torchtitans_key_layout_names_the_hooks_keys() -> None:
    """``keys="torchtitan"`` stores a squeezed ``w13`` under the hooks' keys by its tensor's
    dimensions (3: FusedSwiGLU, 4: FusedGroupedExperts), refuses one the spec does not
    declare squeezed (or of other components), and maps the hooks' keys back to ``w13``."""
    from shardspec.runtime.units import TORCHTITAN, CheckpointError

    dense, experts = "layers.0.feed_forward.w13", "layers.0.moe.experts.w13"
    assert TORCHTITAN.component_keys(dense, ["w1", "w3"], 3, True) == (
        "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w3.weight",
    )
    assert TORCHTITAN.component_keys(experts, ["gate", "up"], 4, True) == (
        "layers.0.moe.experts.w1_EFD",
        "layers.0.moe.experts.w3_EFD",
    )
    assert TORCHTITAN.component_keys("layers.0.feed_forward.w13.weight", ["a", "b"], 2) is None
    with pytest.raises(CheckpointError, match="declares 2 \\(w1, w3\\), not squeezed"):
        TORCHTITAN.component_keys(dense, ["w1", "w3"], 3, False)
    with pytest.raises(CheckpointError, match="`fuse DIM as w1_EFD, w3_EFD squeezed`"):
        TORCHTITAN.component_keys(experts, ["a", "b", "c"], 4, True)
    assert TORCHTITAN.sources("layers.0.feed_forward.w3.weight") == (dense,)
    assert TORCHTITAN.sources("layers.0.moe.experts.w1_EFD") == (experts,)
    assert TORCHTITAN.sources("layers.0.attention.qkv_linear.wk.weight") == (
        "layers.0.attention.qkv_linear.wqkv.weight",
    )


def test_squeezed_composes_with_name_indexed_experts() -> None:
    """Per-expert modules (``experts.{e}.w13``, the expert index a name capture sharded
    over ep) with a squeezed pair: each rank's units drop the pair dimension of the module
    tensor, whatever name-indexed dimension precedes it."""
    rule = RuleSpec(
        "experts.{e}.w13",
        ("e", "hidden", "pair", "dim"),
        shard=(("e", ("ep",)), ("hidden", ("tp",))),
        fuse=(("pair", (("w1", None), ("w3", None)), 1),),
        local=("ep",),
        name_indexed=("e",),
        squeezed=("pair",),
    )
    layout = build_layout(rule, (8, 2, 4), {"ep": 2, "tp": 2}, {"e": 2})
    pieces = rank_pieces(layout, Mesh(("ep", "tp"), (2, 2)))
    got = {(p.component, p.shape, p.offsets, p.sizes, p.squeeze) for p in pieces[3]}
    assert got == {("w1", (8, 4), (4, 0), (4, 4), 1), ("w3", (8, 4), (4, 0), (4, 4), 1)}
    assert pieces[3][0].name_indexed_start == (2,)


# ----------------------------------------------------------------------------- 4 ranks


@pytest.mark.dist
def test_torchtitan_swiglu_checkpoints_on_4_ranks(root: Path) -> None:
    (root / "titan.shard").write_text(SPEC)
    out = compile_specs([str(root / "titan.shard")], str(root / "out"))
    assert not out.errors, out.errors
    assert_ranks(titan_swiglu_scenarios.run_all, root, EXPECTED, timeout=300)
