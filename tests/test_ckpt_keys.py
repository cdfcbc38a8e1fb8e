"""The spec's checkpoint key layout (`checkpoint keys NAME`) and `stored fused`: parsing
(both readers), fmt, lint (SS130, SS131), diff, explain and the generated module (single
process), and on 4 gloo ranks (``tests/ckpt_keys_scenarios.py``): the generated
``save``/``load`` of a spec saying `checkpoint keys torchtitan` exchange checkpoints with
torchtitan's checkpointer without ``keys=``, and `stored fused` tensors are stored whole
and reshard on load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardspec.api import compile_specs
from shardspec.checks.run import check
from shardspec.diff.facts import SpecDiff, Status, diff_specs
from shardspec.diff.render import render_json_diff, render_text
from shardspec.explain.facts import explain_facts
from shardspec.explain.render import render_text as explain_text
from shardspec.frontend.fmt import format_text
from shardspec.frontend.parse import parse
from shardspec.testing import run_ranks
from tests import ckpt_keys_scenarios
from tests.test_torchtitan_ckpt import SPEC

ROOT = Path(__file__).resolve().parent.parent
CASE = ROOT / "tests" / "cases" / "checkpoint_keys"
QKV_FUSE = "fuse qkv as 2 groups of q 32, k 16, v 16\n"
W13_FUSE = "fuse ffn as gate, up\n"


def keys_spec(layout: str = "torchtitan") -> str:
    return SPEC.replace("fsdp dp_shard\n", f"fsdp dp_shard\ncheckpoint keys {layout}\n")


def stored_spec(text: str = SPEC) -> str:
    """``text`` with both fused parameters `stored fused` (wqkv in whole groups over tp)."""
    out = text.replace(QKV_FUSE, QKV_FUSE.replace("\n", " stored fused\n"))
    return out.replace(W13_FUSE, W13_FUSE.replace("\n", " stored fused\n"))


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the torchtitan stand-in's manifest (with its hooks' keys)."""
    root = tmp_path_factory.mktemp("titan")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "shardspec",
            "manifest",
            "examples.models.llama3_fused:titan_tiny",
            "-o",
            str(root / "manifest.json"),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return root


def _lint(root: Path, name: str, text: str) -> list[str]:
    path = root / f"{name}.shard"
    path.write_text(text)
    spec, diags = parse(text, str(path))
    assert spec is not None, diags
    _, found = check(spec)
    return [f"{d.code}: {d.message} | {d.hint}" for d in [*diags, *found]]


# ----------------------------------------------------------------------------- syntax


@pytest.mark.parametrize("fast", [True, False])
def test_checkpoint_keys_parses_in_both_readers(fast: bool) -> None:
    text = "mesh over 2 ranks { dp: * }\ncheckpoint keys torchtitan   # theirs\nfsdp dp\n"
    spec, diags = parse(text, "s.shard", fast=fast)
    assert not diags and spec is not None and spec.checkpoint_keys is not None
    assert spec.checkpoint_keys.layout.text == "torchtitan"
    assert (spec.checkpoint_keys.span.line, spec.checkpoint_keys.layout.span.col) == (2, 17)
    bare, _ = parse("mesh over 2 ranks { dp: * }\n", "s.shard", fast=fast)
    assert bare is not None and bare.checkpoint_keys is None


def test_checkpoint_keys_once() -> None:
    _, diags = parse("checkpoint keys torchtitan\ncheckpoint keys shardspec\n", "s.shard")
    assert [(d.code, d.span.line) for d in diags] == [("SS005", 2)]
    assert "`checkpoint keys` appears more than once" in diags[0].message


def test_checkpoint_keys_is_no_name_elsewhere() -> None:
    """`keys` stays a name where lark expects one (a dimension called keys)."""
    text = "param a.weight [keys, hidden] {\n    shard keys over tp\n}\n"
    spec, diags = parse(text, "s.shard")
    assert not diags and spec is not None and spec.rules[0].dims[0].text == "keys"
    _, diags = parse("checkpoint keys\n", "s.shard")
    assert [d.code for d in diags] == ["SS001"]


def test_fmt_lays_out_checkpoint_keys() -> None:
    text = "checkpoint   keys\n   torchtitan # theirs\nfsdp dp\n"
    out, diags = format_text(text)
    assert not diags and out == "checkpoint keys torchtitan   # theirs\nfsdp dp\n"
    assert format_text(out)[0] == out
    fused = "param w [ffn, h] {\n  fuse ffn as gate,up   stored   fused\n}\n"
    out, _ = format_text(fused)
    assert out == "param w [ffn, h] {\n    fuse ffn as gate, up stored fused\n}\n"


# ----------------------------------------------------------------------------- lint


def test_ss130_unknown_key_layout(titan: Path) -> None:
    found = _lint(titan, "bad", keys_spec("titan"))
    assert [f for f in found if f.startswith("SS130")] == [
        "SS130: `checkpoint keys titan`: no such checkpoint key layout | did you mean "
        "'torchtitan'? key layouts: shardspec, torchtitan"
    ]
    for ok in ("torchtitan", "shardspec"):
        assert _lint(titan, ok, keys_spec(ok)) == []


def test_ss131_components_other_than_the_hooks(titan: Path) -> None:
    text = keys_spec().replace(QKV_FUSE, "fuse qkv as 2 groups of q 32, kv 32\n")
    found = [f for f in _lint(titan, "two", text) if f.startswith("SS131")]
    assert len(found) == 1
    assert "stores this fused parameter's components as wq, wk, wv" in found[0]
    assert "declares 2 (q, kv)" in found[0] and "declare 3 components" in found[0]
    # The same fuse line in shardspec's own layout is fine.
    assert not [
        f
        for f in _lint(titan, "own", text.replace("keys torchtitan", "keys shardspec"))
        if f.startswith("SS131")
    ]


def test_ss131_whole_tensor_in_pieces(titan: Path) -> None:
    """torchtitan stores w13 (and every fused optimizer state) whole: gate and up slices
    over tp are two pieces on each rank."""
    cut = W13_FUSE + "    shard ffn over tp\n"
    text = (
        keys_spec()
        .replace(W13_FUSE, cut)
        .replace(
            "param layers.*.feed_forward.w2.weight [hidden, ffn] {\n",
            "param layers.*.feed_forward.w2.weight [hidden, ffn] {\n    shard ffn over tp\n",
        )
    )
    found = [f for f in _lint(titan, "cut", text) if f.startswith("SS131")]
    assert len(found) == 1 and "holds dimension 'ffn' as 2 separate pieces" in found[0]
    assert "(drop `checkpoint keys`)" in found[0]
    own = text.replace("checkpoint keys torchtitan\n", "")
    assert not [f for f in _lint(titan, "cut-own", own) if f.startswith("SS131")]


# ----------------------------------------------------------------------------- diff, explain


def _diff(root: Path, old: str, new: str) -> SpecDiff:
    (root / "old.shard").write_text(old)
    (root / "new.shard").write_text(new)
    d = diff_specs(str(root / "old.shard"), str(root / "new.shard"))
    assert isinstance(d, SpecDiff), d
    return d


def test_diff_reports_a_key_layout_change(titan: Path) -> None:
    d = _diff(titan, SPEC, keys_spec())
    assert d.keys == ("shardspec", "torchtitan") and d.status == Status.INCOMPATIBLE
    text = render_text(d)
    assert "key layout (`checkpoint keys`): shardspec -> torchtitan" in text
    assert "missing: layers.*.attention.qkv_linear.wk.weight (2 keys)" in text
    assert "as .k, .q, .v under OLD and as wk.weight, wq.weight, wv.weight under NEW" in text
    assert json.loads(render_json_diff(d))["checkpoint"]["keys"] == {
        "old": "shardspec",
        "new": "torchtitan",
    }
    same = _diff(titan, keys_spec(), keys_spec())
    assert same.keys is None and same.status == Status.SAME


def test_diff_stored_fused_verdicts(titan: Path) -> None:
    """Adding `stored fused` breaks loading old per-component checkpoints (the whole key is
    missing); removing it does not (load reads components from the whole tensor)."""
    added = _diff(titan, SPEC, stored_spec())
    assert added.status == Status.INCOMPATIBLE
    assert {(p.kind, p.globs[0][0]) for p in added.checkpoint} >= {
        ("missing", "layers.*.feed_forward.w13.weight"),
        ("unexpected", "layers.*.feed_forward.w13.weight.gate"),
    }
    removed = _diff(titan, stored_spec(), SPEC)
    assert removed.status == Status.CHANGED and not removed.checkpoint
    assert ("layers.*.feed_forward.w13.weight.up", 2) in removed.fallbacks


def test_explain_shows_the_checkpoint_keys(titan: Path) -> None:
    (titan / "k.shard").write_text(stored_spec(keys_spec()))
    (titan / "s.shard").write_text(stored_spec())
    (titan / "o.shard").write_text(SPEC)
    qkv, w13 = "layers.0.attention.qkv_linear.wqkv.weight", "layers.0.feed_forward.w13.weight"
    lines = {
        (f, n): next(
            line
            for line in explain_text(explain_facts(str(titan / f), n, {}, None)).splitlines()
            if "checkpoint keys" in line
        )
        for f in ("k.shard", "s.shard", "o.shard")
        for n in (qkv, w13)
    }
    assert lines[("k.shard", qkv)] == (
        "  checkpoint keys (torchtitan): layers.0.attention.qkv_linear.wq.weight, "
        "layers.0.attention.qkv_linear.wk.weight, layers.0.attention.qkv_linear.wv.weight"
    )
    assert lines[("s.shard", qkv)] == f"  checkpoint keys (shardspec): {qkv}"
    assert lines[("o.shard", w13)] == f"  checkpoint keys (shardspec): {w13}.gate, {w13}.up"
    assert lines[("k.shard", w13)] == f"  checkpoint keys (torchtitan): {w13}"


# ----------------------------------------------------------------------------- codegen


def test_generated_module_carries_the_key_layout() -> None:
    text = (CASE / "expected.py").read_text()
    assert 'CHECKPOINT_KEYS: str | None = "torchtitan"' in text
    assert "    checkpoint_keys=CHECKPOINT_KEYS,\n)" in text
    assert "``'torchtitan'``, the spec's `checkpoint keys`" in text
    assert "stored_fused=True" in text
    plain = (ROOT / "tests" / "cases" / "dense" / "expected.py").read_text()
    assert "CHECKPOINT_KEYS" not in plain and "keys: str | None = None," in plain


# ----------------------------------------------------------------------------- 4 ranks


EXPECTED = {"[generated keys]": 1, "[stored fused]": 1}


@pytest.mark.dist
def test_key_layouts_and_stored_fused_on_4_ranks(titan: Path, tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_bytes((titan / "manifest.json").read_bytes())
    (tmp_path / "keys.shard").write_text(keys_spec())
    (tmp_path / "stored.shard").write_text(stored_spec())
    out = compile_specs(
        [str(tmp_path / "keys.shard"), str(tmp_path / "stored.shard")], str(tmp_path / "out")
    )
    assert not out.errors, out.errors
    results = run_ranks(ckpt_keys_scenarios.run_all, 4, str(tmp_path), timeout=300)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, checked) in enumerate(results):
        assert checked == EXPECTED, f"rank {rank} checked {checked}"
