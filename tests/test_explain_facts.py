"""The facts layer of ``shardspec explain`` (:mod:`shardspec.explain.facts`): the typed
values it computes for parameters of specs/llama.shard and the pipeline specs, without
going through the text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardspec.core.layout import Shard, StridedShard
from shardspec.explain import Explanation, Refusal, explain_facts, render_text
from shardspec.explain.facts import HeadsVerdict, StyleSource, Verdict
from shardspec.findings.diagnostics import Severity

LLAMA = "specs/llama.shard"


def facts(spec: str, fqn: str, sizes: dict[str, int] | None = None, **kw) -> Explanation:
    x = explain_facts(spec, fqn, sizes or {}, kw.pop("world", None), kw.pop("ranks", None))
    assert isinstance(x, Explanation), x
    return x


def test_a_fused_colwise_weight(in_repo: Path) -> None:
    """llama's w13 (fuse ffn as gate, up; ffn over tp, hidden over dp_shard)."""
    x = facts(LLAMA, "layers.0.feed_forward.w13.weight")
    assert (x.fqn, x.alias, x.entry.shape, x.status) == (
        "layers.0.feed_forward.w13.weight",
        None,
        (192, 64),
        0,
    )
    assert x.rules is not None and x.rules.runner_up is None and not x.rules.tied
    (only,) = x.rules.candidates
    assert (only.line, only.pattern, only.verdict) == (
        39,
        "layers.*.feed_forward.w13.weight",
        Verdict.WINS,
    )
    f = x.layout
    assert f is not None
    assert [(d.name, d.size, d.axes) for d in f.layout.dims] == [
        ("ffn", 192, ("tp",)),
        ("hidden", 64, ("dp_shard",)),
    ]
    # tp splits gate and up each: a strided shard of the fused dim, split factor 2
    assert f.dtensor_mesh == ("dp_shard", "tp") and f.placements == (Shard(1), StridedShard(0, 2))
    assert (f.style.source, f.style.words, f.style.module, f.style.dim) == (
        StyleSource.DERIVED,
        ("colwise",),
        "linear",
        "ffn",
    )
    assert x.stage is None and x.findings == ()
    assert x.table is not None and x.table.more == 0
    assert [r.shard.rank for r in x.table.rows] == list(range(8))
    last = x.table.rows[7]
    assert last.shard.coord == (3, 1) and last.shard.shape == (96, 16)
    assert last.shard.indices == (((48, 96), (144, 192)), ((48, 64),))
    assert last.components == (("gate", ((48, 96),)), ("up", ((48, 96),)))


def test_heads_and_hugging_face_sources(in_repo: Path) -> None:
    x = facts(LLAMA, "layers.0.attention.wqkv.weight")
    assert x.layout is not None
    (heads,) = x.layout.heads
    assert (heads.dim, heads.sizes, heads.verdict, heads.axes) == (
        "qkv",
        (("qkv", 16),),
        HeadsVerdict.WHOLE,
        ("tp",),
    )
    assert x.layout.placements == (StridedShard(0, 2), Shard(0))  # FSDP over TP: strided
    assert x.hf is not None and x.hf.more == 0
    assert [(u.name, u.shape, u.kept) for u in x.hf.units] == [
        ("layers.0.attention.wqkv.weight.q", (64, 64), False),
        ("layers.0.attention.wqkv.weight.k", (32, 64), False),
        ("layers.0.attention.wqkv.weight.v", (32, 64), False),
    ]
    (q,) = x.hf.units[0].sources
    assert q.source.keys == ("model.layers.0.self_attn.q_proj.weight",)
    assert [str(t) for t in q.source.transforms] == ["rope 16"] and q.line == 62
    # at tp=8, wo's shards cut its heads of 16 (and lint says SS034)
    x = facts(LLAMA, "layers.0.attention.wo.weight", {"tp": 8})
    assert x.layout is not None
    (heads,) = x.layout.heads
    assert heads.verdict is HeadsVerdict.CUT and heads.cut is not None
    assert (heads.cut.axis, heads.cut_axis_size, heads.cut.head, heads.cut.index) == (
        "tp",
        8,
        0,
        8,
    )
    assert "SS034" in [d.code for d in x.findings]


def test_a_stated_style_and_no_layout(in_repo: Path) -> None:
    x = facts(LLAMA, "output.weight")
    assert x.layout is not None
    assert (x.layout.style.source, x.layout.style.words, x.layout.style.line) == (
        StyleSource.STATED,
        ("colwise", "output replicate"),
        20,
    )
    # 2 groups of q/k/v cannot split over tp=4: the rule wins, but there is no layout
    x = facts(LLAMA, "layers.0.attention.wqkv.weight", {"tp": 4})
    assert x.rules is not None and x.layout is None and x.table is None and x.status == 1
    assert x.no_layout == "2 groups of 'qkv' do not divide over tp=4"


def test_the_winner_beats_the_runner_up_on_a_criterion(in_repo: Path) -> None:
    x = facts("specs/deepseek_moe.shard", "hc_head.fn")
    assert x.rules is not None
    assert [(c.pattern, c.verdict) for c in x.rules.candidates] == [
        ("hc_head.*", Verdict.WINS),
        ("*head.*", Verdict.LOSES),
    ]
    assert (x.rules.runner_up, x.rules.criterion) == ("*head.*", "more literal segments")


def test_a_large_mesh_is_summed_up(in_repo: Path) -> None:
    x = facts(LLAMA, "output.weight", world=1048576)
    assert x.table is not None and len(x.table.rows) == 64 and not x.table.asked
    assert (x.table.total, x.table.more) == (1048576, 1048512)
    assert x.table.shapes == (((1, 64), 256), ((0, 64), 1048320))
    x = facts(LLAMA, "output.weight", world=1048576, ranks=range(1048574, 1048581))
    assert x.table is not None and x.table.asked
    assert [r.shard.rank for r in x.table.rows] == [1048574, 1048575]


def test_a_pipeline_stage(in_repo: Path) -> None:
    x = facts("specs/llama_pp.shard", "layers.2.feed_forward.w13.weight")
    s = x.stage
    assert s is not None
    assert (s.stage, s.n_stages, s.axis, s.layer, s.split, s.claim) == (
        1,
        2,
        "pp",
        "2",
        "layers.{layer}",
        None,
    )
    assert (s.off_stage, s.off_stage_count, s.copies) == ((0, 1, 2, 3), 4, ())
    assert x.table is not None and [r.shard.rank for r in x.table.rows] == [4, 5, 6, 7]
    assert x.layout is not None and x.layout.dtensor_mesh == ("dp_shard", "tp")
    s = facts("specs/llama_pp.shard", "output.weight", {"pp": 4}).stage
    assert s is not None and (s.stage, s.n_stages, s.layer, s.claim) == (3, 4, None, "last")
    assert (s.off_stage, s.off_stage_count) == ((0, 1, 2, 3, 4, 5), 6)


def test_a_tied_alias_explains_as_its_source(in_repo: Path) -> None:
    x = facts("specs/llama_pp_tied.shard", "output.weight")
    assert (x.alias, x.fqn) == ("output.weight", "tok_embeddings.weight")
    s = x.stage
    assert s is not None and (s.stage, s.claim, s.copies) == (0, "first", ((1, "output.weight"),))
    assert s.off_stage == ()  # both stages hold it
    assert x.table is not None and len(x.table.rows) == 8


def test_a_name_indexed_module(in_repo: Path) -> None:
    """local_experts.1 is expert 1 on ep rank 0 and expert 5 on ep rank 1."""
    x = facts("specs/deepseek_moe_local.shard", "layers.0.moe.local_experts.1.w1.weight")
    assert x.table is not None and x.table.name_indexed == (("expert", 1),)
    assert x.table.rows[1].shard.indices[0] == ((5, 6),)
    assert x.hf is not None
    assert [u.name for u in x.hf.units] == [
        "layers.0.moe.local_experts.1.w1.weight",
        "layers.0.moe.local_experts.5.w1.weight",
    ]


def test_no_such_parameter_is_an_ss004_finding(in_repo: Path) -> None:
    x = explain_facts(LLAMA, "layers.0.feed_forward.w13.weigth", {}, None)
    assert isinstance(x, Refusal) and x.status == 1
    (d,) = x.diagnostics
    assert (d.code, d.name, d.severity, d.span.file, d.span.line) == (
        "SS004",
        "bad-argument",
        Severity.ERROR,
        "<command line>",
        1,
    )
    assert d.message == (
        "'layers.0.feed_forward.w13.weigth' is not in the manifest specs/llama.manifest.json"
    )
    assert d.hint.startswith("did you mean layers.0.feed_forward.w13.weight, ")
    (d,) = explain_facts(LLAMA, "zzz", {}, None).diagnostics  # type: ignore[union-attr]
    assert d.hint == "the manifest's names are in specs/llama.manifest.json"


def test_a_spec_without_a_manifest_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SS004 at the spec's first line, rendered as every finding is: with its source line."""
    monkeypatch.chdir(tmp_path)
    Path("bare.shard").write_text("mesh over 2 ranks { dp: * }\n", encoding="utf-8")
    x = explain_facts("bare.shard", "x", {}, None)
    assert isinstance(x, Refusal) and x.status == 2
    (d,) = x.diagnostics
    assert (d.code, d.span.file, d.span.line, d.span.col) == ("SS004", "bare.shard", 1, 1)
    assert render_text(x).splitlines() == [
        "bare.shard:1:1: error SS004 [bad-argument]: explain needs a manifest, and "
        "bare.shard names none",
        " 1 | mesh over 2 ranks { dp: * }",
        "   | ^",
        '  hint: add `manifest "model.json"` (made by `shardspec manifest`)',
        "",
        "1 error(s), 0 warning(s)",
    ]


def test_ignored_and_unmatched_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("s.shard").write_text(
        'manifest "m.json"\nmesh over 2 ranks { dp: * }\nfsdp dp\nparam a.* [n] {}\nignore b.*\n',
        encoding="utf-8",
    )
    entries = [
        {"fqn": n, "kind": "param", "shape": [4], "dtype": "float32"} for n in ("a.w", "b.w", "c.w")
    ]
    Path("m.json").write_text(
        json.dumps({"format": "shardspec-manifest/1", "entries": entries}), encoding="utf-8"
    )
    x = facts("s.shard", "b.w")
    assert x.ignored is not None and (x.ignored.pattern, x.ignored.line) == ("b.*", 5)
    assert x.rules is None and x.status == 0
    x = facts("s.shard", "c.w")
    assert x.ignored is None and x.rules is None and x.layout is None and x.status == 1
    x = facts("s.shard", "a.w")
    assert x.status == 0 and x.table is not None and len(x.table.rows) == 2


def _check_case(code: str, name: str, tmp: Path) -> None:
    """Write the case ``name`` of tests/checks/``code``.py (a spec lint rejects) under
    ``tmp``, the current directory."""
    import importlib.util

    from tests.test_checks import CASE_DIR, _write_case

    spec = importlib.util.spec_from_file_location(code, CASE_DIR / f"{code}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (case,) = [c for c in module.CASES if c["name"] == name]
    _write_case(case, tmp)


def test_specs_with_errors_explain_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rule over the pipeline axis (SS090) has no DTensor; a map line with a capture on
    one side only (SS070) names no HF tensor: explain says so, and lists the findings."""
    from shardspec.cli import main

    monkeypatch.chdir(tmp_path)
    _check_case("SS090", "a rule shards over the pipeline axis", Path("."))
    x = facts("spec.shard", "output.weight")
    assert x.layout is not None and x.layout.placements is None
    assert [d.code for d in x.findings] == ["SS090"]
    assert main(["explain", "spec.shard", "output.weight"]) == 0
    out = capsys.readouterr().out
    assert "  DTensor: none (a rule shards it over the pipeline axis: SS090)\n" in out
    assert "error SS090 [bad-pipeline]" in out
    _check_case(
        "SS070", "a capture on one side only, and a stack index that is no capture", Path(".")
    )
    x = facts("spec.shard", "layers.0.w13")
    assert x.hf is not None
    gate, up = x.hf.units
    assert gate.name == "layers.0.w13.gate" and gate.sources == ()
    assert gate.error is not None and "capture {j} is not on the other side" in gate.error
    assert up.error is None and up.sources[0].source.keys == ("model.layers.0.up",)
    assert main(["explain", "spec.shard", "layers.0.w13"]) == 0
    out = capsys.readouterr().out
    assert "    layers.0.w13.gate: model.layers.{i}.{j}.gate: capture {j}" in out


@pytest.mark.parametrize(
    ("case", "fqn", "style"),
    [
        ("a vocab-parallel embedding given the derived rowwise style", "tok.weight", "derived"),
        ("a stated rowwise style on it", "tok.weight", "stated"),
        ("a Linear subclass with its own forward", "head.weight", "stated"),
    ],
)
def test_a_style_lint_refuses_is_shown_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    case: str,
    fqn: str,
    style: str,
) -> None:
    """torch's colwise/rowwise style on a module whose class runs a forward of its own:
    explain shows the style (derived or stated) refused, why and what to do, as SS038 does
    for the same spec (tests/checks/SS038.py's cases)."""
    from shardspec.cli import main

    monkeypatch.chdir(tmp_path)
    _check_case("SS038", case, Path("."))
    x = facts("spec.shard", fqn)
    assert x.layout is not None
    s = x.layout.style
    assert s.source is StyleSource(style) and s.refused is not None and s.refused_hint
    assert "runs its own forward(), not torch's Linear or Embedding forward" in s.refused
    assert [d.code for d in x.findings] == ["SS038"]
    assert x.findings[0].message.endswith(s.refused)  # the finding's own words
    assert main(["explain", "spec.shard", fqn]) == 0
    out = capsys.readouterr().out
    assert "    refused by lint (SS038): its module " in out
    assert "    what to do: state `style none`" in out


def test_torchs_own_modules_are_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardspec.cli import main

    monkeypatch.chdir(tmp_path)
    _check_case("SS038", "torch's own Embedding and Linear", Path("."))
    x = facts("spec.shard", "tok.weight")
    assert x.layout is not None and x.layout.style.refused is None and x.findings == ()
    assert x.layout.style.words == ("rowwise",)
    assert main(["explain", "spec.shard", "tok.weight"]) == 0
    assert "refused" not in capsys.readouterr().out
