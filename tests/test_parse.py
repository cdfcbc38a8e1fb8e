"""The parser (``shardspec.frontend.parse``): every statement into the right IR with the right
spans, comments and suppressions, duplicate statements, and syntax errors that are diagnostics
with helpful hints, never exceptions."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardspec.findings.diagnostics import Diagnostic, Span, attach_sources, render_text
from shardspec.frontend import ir
from shardspec.frontend.parse import parse, parse_file

FULL = """\
# A spec that uses every statement and form.
manifest "model.manifest.json"

mesh over 8 ranks {
    dp_shard: *     # the rest
    tp: 2
}

fsdp dp_shard
ignore **._extra_state

param tok_embeddings.weight [vocab, hidden] {
    shard vocab over tp
}
param layers.*.attention.wqkv.weight [qkv, hidden] {
    fuse qkv as 2 groups of q 32, k 16, v 16 stored fused
    shard qkv over (tp, dp_shard)
}
param layers.*.feed_forward.w13.weight [ffn, hidden] {
    fuse ffn as gate, up
    shard ffn over tp
    local ep, cp
    replicate dp_shard
}
param layers.*.moe.local_experts.{expert}.w{1,3}.weight [expert, ffn, hidden] replicate
param hc_head.* replicate
param empty.body [] {}
"""


def pos(text: str, needle: str, nth: int = 0) -> tuple[int, int]:
    """1-based (line, col) of the ``nth`` occurrence of ``needle`` in ``text``."""
    i = -1
    for _ in range(nth + 1):
        i = text.index(needle, i + 1)
    line = text.count("\n", 0, i) + 1
    return line, i - (text.rfind("\n", 0, i) + 1) + 1


def at(span: Span) -> tuple[int, int]:
    return span.line, span.col


def ok(text: str, path: str = "t.shard") -> ir.Spec:
    spec, diags = parse(text, path)
    assert spec is not None, [d.message for d in diags]
    assert diags == []
    return spec


# ----------------------------------------------------------------------------- statements


def test_full_spec_top_level() -> None:
    spec = ok(FULL, "specs/full.shard")
    assert spec.path == "specs/full.shard"
    assert spec.name == "full"
    assert spec.source == FULL
    assert spec.sha256 == hashlib.sha256(FULL.encode()).hexdigest()
    assert spec.manifest == "model.manifest.json"
    assert spec.manifest_span is not None
    assert at(spec.manifest_span) == pos(FULL, '"model.manifest.json"')
    assert spec.manifest_span.end_col == spec.manifest_span.col + len('"model.manifest.json"')
    assert spec.fsdp is not None and spec.fsdp.text == "dp_shard"
    line, col = pos(FULL, "fsdp dp_shard")
    assert at(spec.fsdp.span) == (line, col + len("fsdp "))
    assert [ig.pattern.text for ig in spec.ignores] == ["**._extra_state"]
    assert at(spec.ignores[0].span) == pos(FULL, "ignore")
    assert at(spec.ignores[0].pattern.span) == pos(FULL, "**._extra_state")
    assert len(spec.rules) == 6
    assert [r.index for r in spec.rules] == list(range(6))
    assert spec.suppressions == ()


def test_mesh() -> None:
    spec = ok(FULL)
    mesh = spec.mesh
    assert mesh is not None
    assert mesh.world == 8
    assert at(mesh.span) == pos(FULL, "mesh over")
    assert (mesh.span.end_line, mesh.span.end_col) == (pos(FULL, "}")[0], 2)
    assert [(a.name.text, a.size) for a in mesh.axes] == [("dp_shard", None), ("tp", 2)]
    assert at(mesh.axes[0].name.span) == pos(FULL, "dp_shard")
    assert at(mesh.axes[1].span) == pos(FULL, "tp: 2")
    assert mesh.axes[1].span.end_col == pos(FULL, "tp: 2")[1] + len("tp: 2")


def test_mesh_without_world_and_on_one_line() -> None:
    spec = ok("mesh { dp: * tp: 2 cp: 4 }")
    assert spec.mesh is not None and spec.mesh.world is None
    assert [(a.name.text, a.size) for a in spec.mesh.axes] == [("dp", None), ("tp", 2), ("cp", 4)]
    assert ok("mesh {}").mesh == ir.MeshDecl(**ir.placed(Span("t.shard", 1, 1, 1, 8)), axes=())


def test_rule_with_shard() -> None:
    spec = ok(FULL)
    r = spec.rules[0]
    assert r.pattern.text == "tok_embeddings.weight"
    assert at(r.span) == pos(FULL, "param tok_embeddings")
    assert r.span.end_line == pos(FULL, "shard vocab")[0] + 1  # the closing brace
    assert at(r.pattern.span) == pos(FULL, "tok_embeddings.weight")
    assert r.pattern.span.end_col == r.pattern.span.col + len("tok_embeddings.weight")
    assert [d.text for d in r.dims] == ["vocab", "hidden"]
    assert r.dims_given and not r.replicate_all
    assert [at(d.span) for d in r.dims] == [pos(FULL, "vocab"), pos(FULL, "hidden")]
    (s,) = r.shards
    assert s.dim.text == "vocab" and [a.text for a in s.axes] == ["tp"]
    assert at(s.span) == pos(FULL, "shard vocab")
    assert at(s.dim.span) == pos(FULL, "vocab", 1)
    assert at(s.axes[0].span) == pos(FULL, "tp", 1)
    assert r.fusions == () and r.local == () and r.replicate == ()


def test_rule_with_grouped_fusion_and_axis_tuple() -> None:
    spec = ok(FULL)
    r = spec.rules[1]
    (f,) = r.fusions
    assert f.dim.text == "qkv" and f.groups == 2 and f.stored_fused
    assert [(c.name.text, c.size) for c in f.components] == [("q", 32), ("k", 16), ("v", 16)]
    assert at(f.span) == pos(FULL, "fuse qkv")
    assert at(f.components[1].span) == pos(FULL, "k 16")
    assert f.components[1].span.end_col == pos(FULL, "k 16")[1] + 4
    (s,) = r.shards
    assert [a.text for a in s.axes] == ["tp", "dp_shard"]  # outer to inner
    assert at(s.axes[1].span) == pos(FULL, "dp_shard)")


def test_rule_with_plain_fusion_local_and_replicate() -> None:
    spec = ok(FULL)
    r = spec.rules[2]
    (f,) = r.fusions
    assert f.groups is None and not f.stored_fused
    assert [(c.name.text, c.size) for c in f.components] == [("gate", None), ("up", None)]
    assert [a.text for a in r.local] == ["ep", "cp"]
    assert [a.text for a in r.replicate] == ["dp_shard"]
    assert at(r.local[1].span) == pos(FULL, "cp")
    assert at(r.replicate[0].span) == pos(FULL, "dp_shard\n}")


def test_replicate_rules_with_and_without_dims() -> None:
    spec = ok(FULL)
    with_dims, without, empty = spec.rules[3], spec.rules[4], spec.rules[5]
    assert with_dims.replicate_all and with_dims.dims_given
    assert with_dims.pattern.text == "layers.*.moe.local_experts.{expert}.w{1,3}.weight"
    assert [d.text for d in with_dims.dims] == ["expert", "ffn", "hidden"]
    assert without.replicate_all and not without.dims_given and without.dims == ()
    assert without.pattern.text == "hc_head.*"
    assert at(without.span) == pos(FULL, "param hc_head")
    assert without.span.end_col == pos(FULL, "param hc_head")[1] + len("param hc_head.* replicate")
    assert empty.dims_given and empty.dims == () and not empty.replicate_all
    assert empty.shards == () and empty.fusions == ()


def test_keywords_can_be_names_and_patterns() -> None:
    text = (
        "mesh { over: 2 ranks: * }\nfsdp ranks\nignore mesh.param\n"
        "param shard.over [replicate, fuse] { shard replicate over over }"
    )
    spec = ok(text)
    assert spec.mesh is not None
    assert [a.name.text for a in spec.mesh.axes] == ["over", "ranks"]
    assert spec.fsdp is not None and spec.fsdp.text == "ranks"
    assert spec.ignores[0].pattern.text == "mesh.param"
    r = spec.rules[0]
    assert r.pattern.text == "shard.over"
    assert [d.text for d in r.dims] == ["replicate", "fuse"]
    assert r.shards[0].dim.text == "replicate" and r.shards[0].axes[0].text == "over"


def test_style_lines() -> None:
    text = (
        "mesh { dp: * tp: 2 }\n"
        "param output.weight [vocab, hidden] {\n"
        "    shard vocab over tp\n"
        "    style colwise input sequence output replicate dtensor\n"
        "}\n"
        "param norm.weight [hidden] { style sequence_parallel }\n"
        "param w [input, output] { shard input over tp style rowwise style none }\n"
    )
    spec = ok(text)
    a, b, c = spec.rules
    assert a.style is not None and a.extra_styles == ()
    assert a.style.kind.text == "colwise"
    assert a.style.input is not None and a.style.input.text == "sequence"
    assert a.style.output is not None and a.style.output.text == "replicate"
    assert a.style.dtensor
    assert at(a.style.span) == pos(text, "style colwise")
    assert at(a.style.kind.span) == pos(text, "colwise")
    assert at(a.style.output.span) == pos(text, "replicate")
    assert b.style is not None and b.style.kind.text == "sequence_parallel"
    assert b.style.input is None and b.style.output is None and not b.style.dtensor
    # `input` and `output` stay dimension names; a second style is kept for lint (SS029).
    assert [d.text for d in c.dims] == ["input", "output"]
    assert c.style is not None and c.style.kind.text == "rowwise"
    assert [s.kind.text for s in c.extra_styles] == ["none"]


def test_style_line_syntax_errors() -> None:
    for text in ("param w [a] { style }", "param w [a] { style colwise output }"):
        spec, diags = parse(text, "t.shard")
        assert spec is None and [d.code for d in diags] == ["SS001"], text


@pytest.mark.parametrize(
    "pattern", ["*", "**", "**.w", "w{1,3}", "{a,b}.x", "x.{e}.y", "a*b.*c*", "layers.10.w2"]
)
def test_pattern_forms_are_kept_verbatim(pattern: str) -> None:
    spec = ok(f"param {pattern} [x] {{}}\nignore {pattern}")
    assert spec.rules[0].pattern.text == pattern
    assert spec.ignores[0].pattern.text == pattern


def test_statements_may_share_a_line_and_order_is_free() -> None:
    spec = ok('param a [x] {} fsdp dp mesh { dp: 2 } manifest "m.json" param b [y] {}')
    assert [r.pattern.text for r in spec.rules] == ["a", "b"]
    assert [r.index for r in spec.rules] == [0, 1]
    assert spec.manifest == "m.json" and spec.fsdp is not None


def test_empty_and_comment_only_specs() -> None:
    for text in ["", "\n\n", "# only a comment", "# a\n\n   # b\n"]:
        spec = ok(text)
        assert spec.mesh is None and spec.rules == () and spec.manifest is None


def test_windows_line_ends() -> None:
    text = FULL.replace("\n", "\r\n")
    spec = ok(text)
    assert len(spec.rules) == 6
    assert at(spec.rules[1].pattern.span) == pos(FULL, "layers.*.attention.wqkv.weight")


# ----------------------------------------------------------------------------- comments


def test_comments_are_ignored_everywhere() -> None:
    text = (
        "# head\nmesh { # open\n  tp: 2 # size\n} # close\n"
        "param a [x, # dims\n y] { # body\n shard x over tp # item\n }\n"
    )
    spec = ok(text)
    assert spec.mesh is not None and spec.mesh.axes[0].size == 2
    assert [d.text for d in spec.rules[0].dims] == ["x", "y"]


def test_hash_inside_a_string_is_not_a_comment() -> None:
    spec = ok('manifest "models/#1.json"')
    assert spec.manifest == "models/#1.json"


def test_suppression_comments() -> None:
    text = (
        "param a [x] {}  # shardspec: ignore[SS041]\n"
        "param b [x] {}\n"
        "#shardspec:ignore[ss021, SS040 ,SS041]\n"
        "# note: nothing to see  # shardspec: ignore[SS030]\n"
    )
    spec = ok(text)
    assert [(s.codes, s.span.line) for s in spec.suppressions] == [
        (("SS041",), 1),
        (("SS021", "SS040", "SS041"), 3),
        (("SS030",), 4),
    ]
    first = spec.suppressions[0]
    assert first.span.col == text.index("# shardspec") + 1
    assert first.span.end_col == len("param a [x] {}  # shardspec: ignore[SS041]") + 1


def test_suppression_words_inside_a_string_suppress_nothing() -> None:
    text = 'manifest "a # shardspec: ignore[SS002].json"\n'
    spec = ok(text)
    assert spec.suppressions == ()
    both = 'manifest "x # shardspec: ignore[SS001]" # shardspec: ignore[SS041]\n'
    spec = ok(both)
    assert [s.codes for s in spec.suppressions] == [("SS041",)]
    assert spec.suppressions[0].span.col == both.index("# shardspec: ignore[SS041]") + 1


def test_a_plain_comment_is_not_a_suppression() -> None:
    assert ok("# shardspec ignores nothing here\n# ignore[SS041]\n").suppressions == ()


# ----------------------------------------------------------------------------- duplicates


def test_duplicate_statements_are_ss005() -> None:
    text = (
        'mesh { tp: 2 }\nfsdp tp\nmanifest "a.json"\nfsdp dp\nmesh { dp: 2 }\nmanifest "b.json"\n'
    )
    spec, diags = parse(text, "t.shard")
    assert spec is not None
    assert [(d.code, d.span.line) for d in diags] == [("SS005", 4), ("SS005", 5), ("SS005", 6)]
    assert all(d.is_error and d.name == "duplicate-statement" for d in diags)
    assert "`fsdp` appears more than once" in diags[0].message
    assert "line 2" in diags[0].hint
    # the first one holds
    assert spec.fsdp is not None and spec.fsdp.text == "tp"
    assert spec.manifest == "a.json"
    assert spec.mesh is not None and spec.mesh.axes[0].name.text == "tp"


def test_repeated_rules_and_ignores_are_not_duplicates() -> None:
    spec = ok("param a [x] {}\nparam a [x] {}\nignore b\nignore b\n")
    assert len(spec.rules) == 2 and len(spec.ignores) == 2


# ----------------------------------------------------------------------------- syntax errors


def syntax_error(text: str) -> Diagnostic:
    spec, diags = parse(text, "t.shard")
    assert spec is None
    (d,) = diags
    assert d.code == "SS001" and d.name == "syntax-error" and d.is_error
    assert d.message.startswith("syntax error: ")
    assert d.span.file == "t.shard"
    return d


@pytest.mark.parametrize(
    ("text", "where", "found", "hint"),
    [
        ("mesh { tp 2 }", (1, 11), "unexpected '2'", "mesh axes are written `name: size`"),
        ("mesh {\n  dp: *\n  tp 2\n}", (3, 6), "unexpected '2'", "`name: size`"),
        ("mesh { tp = 2 }", (1, 11), "unexpected '='", "`name: size`"),
        ("mesh { tp: 2, dp: 4 }", (1, 13), "unexpected ','", "not commas"),
        ("mesh { dp: rest }", (1, 12), "unexpected 'rest'", "`*` for the rest"),
        ("mesh { tp: -2 }", (1, 12), "unexpected character '-'", "positive whole number"),
        ("mesh over 8 { tp: 2 }", (1, 13), "unexpected '{'", "`mesh over N ranks"),
        ("param a [x, y] {\n  shard x on tp\n}", (2, 11), "unexpected 'on'", "over AXIS"),
        ("param a [x] {\n  shard x over tp, dp\n}", (2, 18), "unexpected ','", "parentheses"),
        ("param a [x] { shard x over tp dp }", (1, 31), "unexpected 'dp'", "parentheses"),
        ("param a [x] { shard x over (tp dp) }", (1, 32), "unexpected 'dp'", "with commas"),
        ("param a [x] { shard x }", (1, 23), "unexpected '}'", "`shard DIM over AXIS`"),
        ("param a [x] { fuse x gate, up }", (1, 22), "unexpected 'gate'", "`fuse DIM as"),
        ("param a [x] { fuse x as 2 groups q 32 }", (1, 34), "unexpected 'q'", "groups of"),
        ("param a [x] { fuse x as a, b stored }", (1, 37), "unexpected '}'", "`stored fused`"),
        ("param a [x] { shrd x over tp }", (1, 15), "unexpected 'shrd'", "did you mean `shard`?"),
        ("parm a [x] {}", (1, 1), "unexpected 'parm'", "did you mean `param`?"),
        ("shard x over tp", (1, 1), "unexpected 'shard'", "`shard` goes inside a rule"),
        ("param a x {}", (1, 9), "unexpected 'x'", "names the parameter's dimensions"),
        ("param a [x]", (1, 12), "unexpected end of file", "needs a body"),
        ("param a [x, y {\n}", (1, 15), "unexpected '{'", "close the dimension list with `]`"),
        ("param a.{b, c} [x] {}", (1, 10), "unexpected 'b'", "no spaces"),
        ('param "a.b" [x] {}', (1, 7), "unexpected '\"a.b\"'", "without quotes"),
        ('manifest "abc\nmesh { tp: 2 }', (1, 10), "unexpected character '\"'", "same line"),
        ("fsdp dp;", (1, 8), "unexpected character ';'", "no `;`"),
        ("mesh { tp: 2 } }", (1, 16), "unexpected '}'", "closes nothing"),
        ("param a [x] {\n  shard x over tp\n", (2, 18), "unexpected end of file", "line 1"),
        ("param a [x] {\n  local ep\n\n# the end\n", (2, 11), "unexpected end of file", "`}`"),
        ("fsdp", (1, 5), "unexpected end of file", "expected a name"),
    ],
)
def test_common_mistakes(text: str, where: tuple[int, int], found: str, hint: str) -> None:
    d = syntax_error(text)
    assert at(d.span) == where
    assert d.message == f"syntax error: {found}"
    assert hint in d.hint


def test_hints_list_the_expected_tokens() -> None:
    d = syntax_error("mesh { tp 2 }")
    assert d.hint.endswith("expected ':'")
    d = syntax_error("param a [x] { bogus }")
    assert (
        "expected 'checkpoint', 'fuse', 'heads', 'local', 'replicate', 'shard', 'style', "
        "'view' or '}'" in d.hint
    )
    d = syntax_error("param a [x] { fuse x as }")
    assert d.hint == "expected a name or a whole number"
    d = syntax_error("}")
    assert (
        "expected 'checkpoint', 'fsdp', 'hf', 'ignore', 'manifest', 'mesh', 'param', "
        "'pipeline' or the end of the file" in d.hint
    )


def test_error_span_covers_the_offending_token() -> None:
    d = syntax_error("param a [x] { shrd x over tp }")
    assert (d.span.line, d.span.col, d.span.end_line, d.span.end_col) == (1, 15, 1, 19)
    rendered = render_text(attach_sources([d], {"t.shard": "param a [x] { shrd x over tp }"})[0])
    assert rendered.splitlines()[2] == "   |               ^^^^"


def test_only_the_first_syntax_error_is_reported() -> None:
    spec, diags = parse("mesh { tp 2 }\nparam a x {}\n", "t.shard")
    assert spec is None and len(diags) == 1 and diags[0].span.line == 1


def test_a_byte_order_mark_in_text_is_a_syntax_error_but_not_in_a_file(tmp_path: Path) -> None:
    d = syntax_error("\ufeffmesh { tp: 2 }")
    assert at(d.span) == (1, 1)
    path = tmp_path / "bom.shard"
    path.write_bytes("\ufeffmesh { tp: 2 }\n".encode())
    spec, diags = parse_file(path)
    assert diags == [] and spec is not None and spec.mesh is not None


# ----------------------------------------------------------------------------- files


def test_parse_file_reads_and_names_the_spec(tmp_path: Path) -> None:
    path = tmp_path / "model.shard"
    path.write_text(FULL, encoding="utf-8")
    spec, diags = parse_file(path)
    assert diags == [] and spec is not None
    assert spec.path == str(path) and spec.name == "model"
    assert spec.rules[0].span.file == str(path)


def test_unreadable_file_is_ss002(tmp_path: Path) -> None:
    missing = tmp_path / "nope.shard"
    spec, diags = parse_file(missing)
    assert spec is None
    (d,) = diags
    assert d.code == "SS002" and d.is_error
    assert "cannot read spec" in d.message and "No such file" in d.message
    assert d.span == Span(str(missing), 1, 1)

    spec, diags = parse_file(tmp_path)  # a directory
    assert spec is None and diags[0].code == "SS002"

    binary = tmp_path / "bin.shard"
    binary.write_bytes(b"mesh { tp: 2 }\n\xff\xfe")
    spec, diags = parse_file(binary)
    assert spec is None and diags[0].code == "SS002"
    assert "UTF-8" in diags[0].hint and "byte 15" in diags[0].message


# ----------------------------------------------------------------------------- robustness

_WORDS = [
    "mesh", "over", "8", "ranks", "{", "}", "dp", ":", "*", "tp", "2", "fsdp", "ignore",
    "param", "a.b", "**", "[", "]", ",", "shard", "(", ")", "fuse", "as", "groups", "of",
    "stored", "fused", "local", "replicate", "manifest", '"m.json"', "\n", "# c\n", "{x}",
    "w{1,3}", "=", ";", '"', "é", "\t", "0", "\r\n", "\ufeff", "hf", "->", "drop", "tie",
    "keep", "config", "transpose", "rope", "16", "[e]", "a * b", "heads", "head_dim",
]  # fmt: skip


def _never_raises(text: str) -> None:
    spec, diags = parse(text, "f.shard")
    # SS001 a syntax error; SS006/SS007 a number or token beyond bounds (refused when read)
    assert (spec is None) == any(d.code in ("SS001", "SS006", "SS007") for d in diags)
    assert all(d.code in ("SS001", "SS005", "SS006", "SS007") for d in diags)
    for d in attach_sources(diags, {"f.shard": text}):
        assert d.span.line >= 1 and d.span.col >= 1
        render_text(d)


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(min_codepoint=1, max_codepoint=0x2FFF), max_size=80))
def test_random_text_never_raises(text: str) -> None:
    _never_raises(text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_WORDS), max_size=30))
def test_random_token_soup_never_raises(words: list[str]) -> None:
    _never_raises(" ".join(words))


# ----------------------------------------------------------------------------- hf block

HF = """\
manifest "m.json"
hf "llama.hf.json" {
    model.embed_tokens.weight -> tok_embeddings.weight
    lm_head.weight -> output.weight
    tie lm_head.weight = model.embed_tokens.weight
    model.layers.{i}.self_attn.q_proj.weight -> layers.{i}.attention.wqkv.weight.q rope 16
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight -> layers.{i}.moe.experts.w1[e]
    some.conv.weight -> conv.weight transpose rope 8   # in the order written
    drop model.rotary_emb.inv_freq
    keep hc_head.*
    config hidden = hidden_size
    config q = num_attention_heads * head_dim*2
}
"""


def test_hf_block_items_and_spans() -> None:
    spec = ok(HF)
    hf = spec.hf
    assert hf is not None
    assert hf.manifest == "llama.hf.json" and hf.manifest_span is not None
    assert at(hf.manifest_span) == pos(HF, '"llama.hf.json"')
    assert at(hf.span) == pos(HF, "hf ")
    assert hf.span.end_line == HF.count("\n")
    assert [(m.hf.text, m.target.text) for m in hf.maps] == [
        ("model.embed_tokens.weight", "tok_embeddings.weight"),
        ("lm_head.weight", "output.weight"),
        ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wqkv.weight.q"),
        ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "layers.{i}.moe.experts.w1"),
        ("some.conv.weight", "conv.weight"),
    ]
    q, w1, conv = hf.maps[2], hf.maps[3], hf.maps[4]
    assert at(q.span) == at(q.hf.span) == pos(HF, "model.layers.{i}.self_attn")
    assert at(q.target.span) == pos(HF, "layers.{i}.attention")
    assert [(t.kind, t.head_dim) for t in q.transforms] == [("rope", 16)]
    assert at(q.transforms[0].span) == pos(HF, "rope 16")
    assert q.transforms[0].span.end_col == pos(HF, "rope 16")[1] + len("rope 16")
    assert q.stack is None
    assert w1.stack is not None and w1.stack.text == "e"
    assert at(w1.stack.span) == pos(HF, "e]")
    assert w1.span.end_col == pos(HF, "w1[e]")[1] + len("w1[e]")
    assert [(t.kind, t.head_dim) for t in conv.transforms] == [("transpose", 0), ("rope", 8)]
    assert at(conv.transforms[0].span) == pos(HF, "transpose")
    (tie,) = hf.ties
    assert (tie.alias.text, tie.source.text) == ("lm_head.weight", "model.embed_tokens.weight")
    assert at(tie.span) == pos(HF, "tie ")
    assert at(tie.source.span) == pos(HF, "model.embed_tokens.weight", 1)
    assert [d.pattern.text for d in hf.drops] == ["model.rotary_emb.inv_freq"]
    assert at(hf.drops[0].pattern.span) == pos(HF, "model.rotary_emb")
    assert [k.pattern.text for k in hf.keeps] == ["hc_head.*"]
    hidden, qsize = hf.configs
    assert hidden.name.text == "hidden" and [f.text for f in hidden.factors] == ["hidden_size"]
    assert at(hidden.span) == pos(HF, "config hidden")
    assert [f.text for f in qsize.factors] == ["num_attention_heads", "head_dim", "2"]
    assert [f.number for f in qsize.factors] == [None, None, 2]
    assert [at(f.span) for f in qsize.factors] == [
        pos(HF, "num_attention_heads"),
        pos(HF, "head_dim*2"),
        pos(HF, "2\n}"),
    ]
    assert qsize.factors[1].span.end_col == pos(HF, "head_dim*2")[1] + len("head_dim")


def test_hf_block_without_manifest_and_empty() -> None:
    spec = ok("hf { }")
    assert spec.hf is not None and spec.hf.manifest is None and spec.hf.maps == ()
    assert ok("param a [x] {}").hf is None
    spec = ok("hf{a->b}")
    assert spec.hf is not None and [(m.hf.text, m.target.text) for m in spec.hf.maps] == [
        ("a", "b")
    ]


def test_hf_keywords_stay_names_and_pattern_segments() -> None:
    """`hf`, `drop`, `tie`, `keep`, `config`, `transpose` and `rope` are keywords only where
    an hf item or a transform can start: elsewhere they are names and pattern segments."""
    words = "hf drop tie keep config transpose rope"
    text = (
        "mesh { hf: 2 drop: 1 rope: 1 }\nfsdp hf\nignore keep.drop.tie\n"
        "param hf.drop.tie.keep.config.transpose.rope [config, rope] { shard rope over hf }\n"
        "param layers.*.tie_word.keep_x.ropey [hf] { shard hf over drop }\n"
        "hf {\n"
        "    drop.tie.weight -> keep.config.weight transpose\n"
        "    config.rope.x -> rope.transpose.x rope 4\n"
        "    tie.hf -> hf.tie\n"
        "    drop keep.x\n    keep drop.y\n    tie tie.a = drop.b\n    config rope = hf * tie\n"
        "}\n"
    )
    spec = ok(text)
    assert spec.mesh is not None and [a.name.text for a in spec.mesh.axes] == ["hf", "drop", "rope"]
    assert spec.fsdp is not None and spec.fsdp.text == "hf"
    assert spec.rules[0].pattern.text == "hf.drop.tie.keep.config.transpose.rope"
    assert [d.text for d in spec.rules[0].dims] == ["config", "rope"]
    hf = spec.hf
    assert hf is not None
    assert [(m.hf.text, m.target.text, [t.kind for t in m.transforms]) for m in hf.maps] == [
        ("drop.tie.weight", "keep.config.weight", ["transpose"]),
        ("config.rope.x", "rope.transpose.x", ["rope"]),
        ("tie.hf", "hf.tie", []),
    ]
    assert [d.pattern.text for d in hf.drops] == ["keep.x"]
    assert [k.pattern.text for k in hf.keeps] == ["drop.y"]
    assert [(t.alias.text, t.source.text) for t in hf.ties] == [("tie.a", "drop.b")]
    assert [f.text for f in hf.configs[0].factors] == ["hf", "tie"]
    assert all(w in text for w in words.split())


def test_existing_example_specs_still_parse() -> None:
    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "specs").glob("*.shard")) + sorted(
        (root / "tests" / "cases").glob("*/spec.shard")
    ):
        spec, diags = parse_file(path)
        assert spec is not None and not [d for d in diags if d.code == "SS001"], path


def test_hf_block_twice_is_ss005() -> None:
    spec, diags = parse('hf "a.json" { a -> b }\nhf { c -> d }\n', "t.shard")
    assert spec is not None and spec.hf is not None
    assert [m.hf.text for m in spec.hf.maps] == ["a"]
    (d,) = diags
    assert d.code == "SS005" and at(d.span) == (2, 1) and "`hf` appears more than once" in d.message


# ----------------------------------------------------------------------------- heads


def test_heads_items_and_spans() -> None:
    text = (
        "mesh { dp: * tp: 2 }\n"
        "param wqkv [qkv, hidden] {\n"
        "    fuse qkv as 2 groups of q 32, k 16, v 16\n"
        "    heads q head_dim, k 16\n"
        "    heads v 16   # a second line adds to the first\n"
        "    shard qkv over tp\n"
        "}\n"
        "param wo [hidden, heads] { heads heads 128  shard heads over tp }\n"
    )
    spec = ok(text)
    a, b = spec.rules
    assert [(h.target.text, h.size, h.size_text) for h in a.heads] == [
        ("q", None, "head_dim"),
        ("k", 16, "16"),
        ("v", 16, "16"),
    ]
    q = a.heads[0]
    assert q.size_name is not None and q.size_name.text == "head_dim"
    assert at(q.span) == pos(text, "q head_dim")
    assert at(q.target.span) == pos(text, "q head_dim")
    assert at(q.size_name.span) == pos(text, "head_dim")
    assert at(a.heads[1].span) == pos(text, "k 16", 1)
    # `heads` is a keyword only where an item starts: it stays a dimension name.
    assert [d.text for d in b.dims] == ["hidden", "heads"]
    assert [(h.target.text, h.size) for h in b.heads] == [("heads", 128)]
    assert b.shards[0].dim.text == "heads"
    assert ok("param w [a] { shard a over tp }").rules[0].heads == ()


@pytest.mark.parametrize(
    ("text", "where", "found", "hint"),
    [
        ("param w [kv] { heads kv }", (1, 25), "unexpected '}'", "write `heads DIM SIZE`"),
        ("param w [kv] {\n    heads kv\n}", (3, 1), "unexpected '}'", "`heads kv head_dim`"),
        ("param w [kv] { heads 128 kv }", (1, 22), "unexpected '128'", "the dimension comes"),
        ("param w [kv] { heads kv of 128 }", (1, 28), "unexpected '128'", "without `of`"),
        ("param w [kv] { heads kv 128 v 16 }", (1, 29), "unexpected 'v'", "with commas"),
        ("param w [kv] { heads kv 128, }", (1, 30), "unexpected '}'", "`heads DIM SIZE`"),
        ("param w [kv] { head kv 128 }", (1, 16), "unexpected 'head'", "did you mean `heads`?"),
        ("heads kv 128", (1, 1), "unexpected 'heads'", "`heads` goes inside a rule"),
    ],
)
def test_heads_syntax_errors(text: str, where: tuple[int, int], found: str, hint: str) -> None:
    d = syntax_error(text)
    assert at(d.span) == where
    assert d.message == f"syntax error: {found}"
    assert hint in d.hint


def test_heads_hint_only_on_a_heads_line() -> None:
    """A dimension named `heads` in a shard line gets the shard hint, not the heads one."""
    d = syntax_error("param w [heads] {\n    shard heads over\n}")
    assert "heads DIM SIZE" not in d.hint


@pytest.mark.parametrize(
    ("text", "where", "found", "hint"),
    [
        ("hf { a b }", (1, 8), "unexpected 'b'", "`HF_NAME -> MODEL_NAME`"),
        ("hf { a -> b rope }", (1, 18), "unexpected '}'", "`rope N`"),
        ("hf { a -> b rope x }", (1, 18), "unexpected 'x'", "`rope N`"),
        ("hf { tie a b }", (1, 12), "unexpected 'b'", "`tie ALIAS = SOURCE`"),
        ("hf { config x 4 }", (1, 15), "unexpected '4'", "`config NAME = "),
        ("hf { config x = }", (1, 17), "unexpected '}'", "config.json keys"),
        ("hf { a -> b[e }", (1, 15), "unexpected '}'", "expected ']'"),
        ('hf { "a" -> b }', (1, 6), "unexpected '\"a\"'", "without quotes"),
        ("drop x.y", (1, 1), "unexpected 'drop'", "`drop` goes inside an `hf { ... }` block"),
        (
            "hf { a -> b }\ntie a = b",
            (2, 1),
            "unexpected 'tie'",
            "a `pipeline` block (parameters) or an `hf`",
        ),
        ("hf { a -> b\n", (1, 12), "unexpected end of file", "line 1"),
    ],
)
def test_hf_syntax_errors(text: str, where: tuple[int, int], found: str, hint: str) -> None:
    d = syntax_error(text)
    assert at(d.span) == where
    assert d.message == f"syntax error: {found}"
    assert hint in d.hint


# ----------------------------------------------------------------------------- pipeline block

PIPE = """\
mesh { pp: 2  dp_shard: * }
pipeline pp {   # stages
    first tok_embeddings, *.embed
    split layers.{layer} as 1, 3 local
    last norm,
         output
    first extra
}
"""


def test_pipeline_block_items_and_spans() -> None:
    p = ok(PIPE).pipeline
    assert p is not None
    assert p.axis.text == "pp" and at(p.axis.span) == pos(PIPE, "pp {")
    assert at(p.span) == pos(PIPE, "pipeline")
    assert (p.span.end_line, p.span.end_col) == (8, 2)  # through the closing brace
    # first/last lists gather every line of their kind, in file order
    assert [x.text for x in p.first] == ["tok_embeddings", "*.embed", "extra"]
    assert [at(x.span) for x in p.first] == [
        pos(PIPE, "tok_embeddings"),
        pos(PIPE, "*.embed"),
        pos(PIPE, "extra"),
    ]
    assert p.first[1].span.end_col == pos(PIPE, "*.embed")[1] + len("*.embed")
    assert [x.text for x in p.last] == ["norm", "output"]
    assert [at(x.span) for x in p.last] == [pos(PIPE, "norm"), pos(PIPE, "output")]
    (split,) = p.splits
    assert split.pattern.text == "layers.{layer}"
    assert at(split.span) == pos(PIPE, "split")
    assert (split.span.end_line, split.span.end_col) == (4, pos(PIPE, "local")[1] + len("local"))
    assert at(split.pattern.span) == pos(PIPE, "layers.{layer}")
    assert split.counts == (1, 3) and split.local_names is True
    assert split.counts_span is not None and at(split.counts_span) == pos(PIPE, "as 1, 3")
    assert split.counts_span.end_col == pos(PIPE, "as 1, 3")[1] + len("as 1, 3")


def test_pipeline_split_forms() -> None:
    def split_of(text: str):
        p = ok(text).pipeline
        assert p is not None
        return p.splits

    (s,) = split_of("pipeline pp { split layers.{layer} }")
    assert (s.counts, s.counts_span, s.local_names) == ((), None, False)
    (s,) = split_of("pipeline pp { split layers.{layer} local }")
    assert (s.counts, s.counts_span, s.local_names) == ((), None, True)
    (s,) = split_of("pipeline pp { split layers.{layer} as 2,2 ,4 }")
    assert s.counts == (2, 2, 4) and not s.local_names
    # a whole block on one line, items in any order
    p = ok("pipeline pp{last c,d split b.{l} as 1, 3 local first a}").pipeline
    assert p is not None
    assert ([x.text for x in p.first], [x.text for x in p.last]) == (["a"], ["c", "d"])
    assert [(s.pattern.text, s.counts, s.local_names) for s in p.splits] == [
        ("b.{l}", (1, 3), True)
    ]
    # an empty block parses; the checks say what it lacks
    p = ok("pipeline pp {}").pipeline
    assert p is not None and (p.first, p.last, p.splits) == ((), (), ())
    # two splits both parse (a second one is SS090, a check's finding)
    assert [s.pattern.text for s in split_of("pipeline pp { split a.{i}\n split b.{i} }")] == [
        "a.{i}",
        "b.{i}",
    ]
    assert ok("mesh { tp: 2 }").pipeline is None


def test_pipeline_ties() -> None:
    text = (
        "pipeline pp {\n    last output\n    tie output.weight = tok_embeddings.weight\n"
        "    first tok_embeddings\n    tie out.b=emb.b\n}\n"
    )
    p = ok(text).pipeline
    assert p is not None
    assert [(t.alias.text, t.source.text) for t in p.ties] == [
        ("output.weight", "tok_embeddings.weight"),
        ("out.b", "emb.b"),
    ]
    t = p.ties[0]
    assert at(t.span) == pos(text, "tie output")
    assert at(t.alias.span) == pos(text, "output.weight")
    assert at(t.source.span) == pos(text, "tok_embeddings.weight")
    assert t.source.span.end_col == pos(text, "tok_embeddings.weight")[1] + len(
        "tok_embeddings.weight"
    )
    assert [x.text for x in p.first] == ["tok_embeddings"]
    # `tie` stays a name elsewhere, and a segment of a pattern
    spec = ok("mesh { tie: 2 }\nparam tie.x [a] { shard a over tie }\npipeline tie { first tie }")
    assert spec.pipeline is not None and spec.pipeline.first[0].text == "tie"


def test_pipeline_keywords_stay_names_and_pattern_segments() -> None:
    """`pipeline`, `first`, `last`, `split`, `as` and `local` are keywords only where a
    pipeline item (or its counts) can start: elsewhere they are names and segments."""
    text = (
        "mesh { pipeline: 2  first: 2  split: * }\nfsdp split\nignore last.first\n"
        "param pipeline.first.split.last.as [first, last] { shard first over pipeline }\n"
        "pipeline pipeline {\n"
        "    first split.x, last.y, first\n"
        "    split as.{local} local\n"
        "    last first.z, local.as\n"
        "}\n"
    )
    spec = ok(text)
    assert spec.mesh is not None
    assert [a.name.text for a in spec.mesh.axes] == ["pipeline", "first", "split"]
    assert spec.rules[0].pattern.text == "pipeline.first.split.last.as"
    p = spec.pipeline
    assert p is not None and p.axis.text == "pipeline"
    assert [x.text for x in p.first] == ["split.x", "last.y", "first"]
    assert [x.text for x in p.last] == ["first.z", "local.as"]
    assert [(s.pattern.text, s.local_names) for s in p.splits] == [("as.{local}", True)]


def test_pipeline_twice_is_ss005() -> None:
    text = "pipeline pp { split a.{i} }\nmesh { pp: 2 }\npipeline stage { first b }\n"
    spec, diags = parse(text, "t.shard")
    assert spec is not None and spec.pipeline is not None
    assert spec.pipeline.axis.text == "pp"  # the first one holds
    (d,) = diags
    assert d.code == "SS005" and at(d.span) == (3, 1)
    assert "`pipeline` appears more than once" in d.message and "line 1" in d.hint


@pytest.mark.parametrize(
    ("text", "where", "found", "hint"),
    [
        ("pipeline pp { frist a }", (1, 15), "unexpected 'frist'", "did you mean `first`?"),
        ("pipeline pp {\n  first a\n  lsat b\n}", (3, 3), "unexpected 'lsat'", "`last`?"),
        ("pipeline pp { splt a.{i} }", (1, 15), "unexpected 'splt'", "did you mean `split`?"),
        ("pipeline pp { shard a }", (1, 15), "unexpected 'shard'", "first, last, split and tie"),
        ("pipeline pp { tei a = b }", (1, 15), "unexpected 'tei'", "did you mean `tie`?"),
        ("pipeline pp {\n  tie a b\n}", (2, 9), "unexpected 'b'", "two parameter names"),
        ("pipeline pp { tie a = }", (1, 23), "unexpected '}'", "expected a parameter pattern"),
        ("pipeline pp { tie = b }", (1, 19), "unexpected '='", "expected a parameter pattern"),
        ("split layers.{i}", (1, 1), "unexpected 'split'", "inside a `pipeline AXIS { ... }`"),
        ("mesh { pp: 2 }\nfirst tok", (2, 1), "unexpected 'first'", "inside a `pipeline AXIS"),
        ("last norm", (1, 1), "unexpected 'last'", "`last` goes inside a `pipeline AXIS"),
        ("pipeline pp { split a.{i} as }", (1, 30), "unexpected '}'", "as whole numbers"),
        ("pipeline pp { split a.{i} as x }", (1, 30), "unexpected 'x'", "as 3, 5`"),
        ("pipeline pp { split a.{i} as 1, }", (1, 33), "unexpected '}'", "as whole numbers"),
        ("pipeline pp { split a.{i} as -1 }", (1, 30), "unexpected character '-'", "whole"),
        ("pipeline pp { split a.{i} as 1 2 }", (1, 32), "unexpected '2'", "with commas"),
        ("pipeline pp { split a.{i} 1, 3 }", (1, 27), "unexpected '1'", "counts follow `as`"),
        (
            "pipeline pp { split a.{i} local as 1, 3 }",
            (1, 33),
            "unexpected 'as'",
            "the counts come before `local`",
        ),
        ("pipeline { first a }", (1, 10), "unexpected '{'", "expected a name"),
        ("pipeline pp { first }", (1, 21), "unexpected '}'", "expected a parameter pattern"),
        ("pipeline pp { last a, }", (1, 23), "unexpected '}'", "expected a parameter pattern"),
        ("pipeline pp {\n  first a\n", (2, 10), "unexpected end of file", "line 1"),
        ("pipelin pp { first a }", (1, 1), "unexpected 'pipelin'", "did you mean `pipeline`?"),
    ],
)
def test_pipeline_syntax_errors(text: str, where: tuple[int, int], found: str, hint: str) -> None:
    d = syntax_error(text)
    assert at(d.span) == where
    assert d.message == f"syntax error: {found}"
    assert hint in d.hint


def test_as_hint_does_not_guess_last() -> None:
    """`as` after `local` is out of order, not a misspelt `last`."""
    d = syntax_error("pipeline pp { split a.{i} local as 1, 3 }")
    assert "did you mean" not in d.hint


_PIPE_WORDS = [
    "first", "last", "split", "as", "local", "tie", "=", "pipeline", "pp", "{", "}", ",", "1",
    "0", "12",
    "layers.{layer}", "layers.*", "{a}.{b}", "tok_embeddings", "norm", "output", "**", "*",
    "{a,b}", "out**put", "\n", "# c\n", "-", ":", "[", "]", '"x"', "é", "\t", "\r\n",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(min_codepoint=1, max_codepoint=0x2FFF), max_size=60))
def test_random_text_in_a_pipeline_block_never_raises(text: str) -> None:
    _never_raises("pipeline pp {\n" + text + "\n}\n")
    _never_raises("pipeline pp { split layers.{layer} " + text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIPE_WORDS), max_size=30))
def test_random_pipeline_token_soup_never_raises(words: list[str]) -> None:
    _never_raises("pipeline pp { " + " ".join(words) + " }")
    _never_raises(" ".join(words))


@pytest.mark.parametrize(
    "text",
    [
        "param {a, b} [x] {}",
        "ignore x.{a, b}",
        # many `{`: the regex behind this hint backtracked quadratically (20,000 took 7 s)
        "param " + "{" * 20000 + "}" * 19999 + "{ [x] {}",
        "param a{" + "{" * 20000 + " [x] {}",
    ],
)
def test_the_no_spaces_in_patterns_hint(text: str) -> None:
    d = syntax_error(text)
    assert "a pattern has no spaces" in d.hint


def test_hf_split_lines() -> None:
    """A target without a component splits; `as` lists the parts in the checkpoint's
    order, each with a size (a number or a config.json product) and transforms."""
    text = (
        "hf {\n"
        "    m.{i}.qkv_proj.weight -> m.{i}.qkv_proj.weight\n"
        "    h.{i}.c_attn.weight -> l.{i}.wqkv transpose as k 32, q (num_heads * hd) rope 16, v\n"
        "    as.{i}.x -> as.{i}.y as as, rope rope 2\n"
        "    12.x -> y\n"
        "}\n"
    )
    spec = ok(text)
    assert spec.hf is not None
    plain, conv, odd, digits = spec.hf.maps
    assert plain.parts is None and digits.parts is None and digits.hf.text == "12.x"
    assert conv.parts is not None and [t.kind for t in conv.transforms] == ["transpose"]
    k, q, v = conv.parts
    assert [p.name.text for p in conv.parts] == ["k", "q", "v"]
    assert [f.text for f in k.size or []] == ["32"] and k.transforms == ()
    assert [f.text for f in q.size or []] == ["num_heads", "hd"]
    assert q.size_span is not None and q.size_span.col == text.split("\n")[2].index("(") + 1
    assert [(t.kind, t.head_dim) for t in q.transforms] == [("rope", 16)]
    assert v.size is None and v.transforms == ()
    assert odd.parts is not None and [p.name.text for p in odd.parts] == ["as", "rope"]
    assert [(t.kind, t.head_dim) for t in odd.parts[1].transforms] == [("rope", 2)]


@pytest.mark.parametrize(
    ("line", "hint"),
    [
        ("a -> b as", "after `as`, name the target's fused components"),
        ("a -> b as q,", "after `as`, name the target's fused components"),
        ("a -> b as q.r", "after `as`, name the target's fused components"),
        ("a -> b as q (x", "a size from config.json is a product in parentheses"),
        ("a -> b as q ()", "a size from config.json is a product in parentheses"),
    ],
)
def test_hf_split_syntax_errors_say_how(line: str, hint: str) -> None:
    spec, diags = parse(f"hf {{\n    {line}\n}}\n", "t.shard")
    assert spec is None and diags[0].code == "SS001"
    assert hint in diags[0].hint, diags[0].hint


_LAYERS_PROBE = """\
import sys
from shardspec.findings import catalogue, suggest
from shardspec.frontend.parse import parse
spec, diags = parse("mesh { tp: 2 }\\nparam w [a] { shard a over tp }\\n", "ok.shard")
assert spec is not None and not diags, diags
spec, diags = parse("mesh { tp: 2 }\\nparma w [a] { shard a over tp }\\n", "bad.shard")
assert spec is None and "did you mean `param`?" in diags[0].hint, diags
print(" ".join(sorted(sys.modules)))
"""


def test_the_parser_and_findings_load_neither_checks_nor_torch() -> None:
    """The front end and the findings stand below the checks (and the compiler never imports
    torch): parsing, a syntax error's hint included, loads neither."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _LAYERS_PROBE],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    loaded = run.stdout.split()
    assert "shardspec.frontend.parse" in loaded and "shardspec.findings.suggest" in loaded
    below = [m for m in loaded if m == "torch" or m.startswith(("torch.", "shardspec.checks"))]
    assert below == [], below


def test_a_value_of_no_known_kind_raises_rather_than_vanish() -> None:
    """The transformer sorts a block's lines by their class: one it has no place for is a bug
    that must show, not a line silently dropped; IR nodes refuse fields they do not have."""
    from shardspec.frontend.parse import _RULE_LISTS, _sort

    with pytest.raises(TypeError, match="ShardItem"):
        _sort([ir.ShardItem(**ir.placed(Span("t.shard", 1, 1)), dim=_name("x"), axes=())], {})
    assert _sort([], _RULE_LISTS)["shards"] == ()
    with pytest.raises(TypeError, match="txet"):
        ir.Name(**ir.placed(Span("t.shard", 1, 1)), text="x", txet="y")  # type: ignore[call-arg]


def _name(text: str) -> ir.Name:
    return ir.Name(**ir.placed(Span("t.shard", 1, 1)), text=text)
