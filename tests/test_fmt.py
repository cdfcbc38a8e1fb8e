"""``shardspec fmt``: the canonical layout, its fixed points, what it keeps (tokens,
comments, the compiled module), and the command's exit codes and file handling."""

from __future__ import annotations

import ast
import os
import re
import shutil
import stat
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardspec.api import render_specs
from shardspec.cli import main
from shardspec.frontend import fmt
from shardspec.frontend.fmt import format_text
from shardspec.frontend.syntax_errors import comment_start

REPO_ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted(REPO_ROOT.glob("specs/*.shard"))
CASES = sorted(REPO_ROOT.glob("tests/cases/**/*.shard"))
EVERY = SPECS + CASES


def _name(p: Path) -> str:
    return str(p.relative_to(REPO_ROOT))


def _comments(text: str) -> Counter[str]:
    """Every comment of ``text`` (found line by line, not by fmt's lexer), as written."""
    out: Counter[str] = Counter()
    for row in text.split("\n"):
        at = comment_start(row)
        if at is not None:
            out[row[at:].rstrip()] += 1
    return out


def _fmt(text: str) -> str:
    out, diags = format_text(text, "spec.shard")
    assert out is not None, [str(d) for d in diags]
    return out


# ------------------------------------------------------------------------ the layout


MESSY = """\


# head comment
manifest   "x.json"     # trailing
mesh over 8 ranks { dp_shard: *  tp: 2 }   # inline mesh



fsdp dp_shard
param a.b [x,y] { shard x over (tp,dp_shard)
  # inside comment

}
param c [ h ]  {   }   # empty
param d [h] {
    # only a comment
}
param e replicate
param f [a] {   # c1
   fuse a as 2 groups of q 32,k 16, v 16 stored fused
   heads a 16,  q 8
   style colwise input sequence output replicate dtensor
   checkpoint shard a over tp
   checkpoint replicate
   local tp
   view dense
}
param g [h,p,d] { fuse p as w1,w3   squeezed }
pipeline pp { first tok ,emb
 split layers.{layer} as 3,5 local
 last norm, output
 tie output.weight=tok.weight }
hf "h.json" {
   a.{i}.q->b.{i}.wqkv.weight.q rope 16 transpose
   a.{e}.w -> b.w[e]
   x.qkv -> y.qkv grouped as q rope 16, k (num_key_value_heads*head_dim) rope 16, v 32
   drop z
   keep k.*
   tie a=b
   config q = a *b*  2
   fp8 m.*.weight scale {key}_s block 64 x 128 ue8m0 e5m2
}
# trailing file comment

# another
"""

CANONICAL = """\
# head comment
manifest "x.json"   # trailing
mesh over 8 ranks {   # inline mesh
    dp_shard: *
    tp: 2
}

fsdp dp_shard
param a.b [x, y] {
    shard x over (tp, dp_shard)
    # inside comment
}
param c [h] {}   # empty
param d [h] {
    # only a comment
}
param e replicate
param f [a] {   # c1
    fuse a as 2 groups of q 32, k 16, v 16 stored fused
    heads a 16, q 8
    style colwise input sequence output replicate dtensor
    checkpoint shard a over tp
    checkpoint replicate
    local tp
    view dense
}
param g [h, p, d] {
    fuse p as w1, w3 squeezed
}
pipeline pp {
    first tok, emb
    split layers.{layer} as 3, 5 local
    last norm, output
    tie output.weight = tok.weight
}
hf "h.json" {
    a.{i}.q -> b.{i}.wqkv.weight.q rope 16 transpose
    a.{e}.w -> b.w[e]
    x.qkv -> y.qkv grouped as q rope 16, k (num_key_value_heads * head_dim) rope 16, v 32
    drop z
    keep k.*
    tie a = b
    config q = a * b * 2
    fp8 m.*.weight scale {key}_s block 64 x 128 ue8m0 e5m2
}
# trailing file comment

# another
"""


def test_every_construct_of_the_language_gets_the_canonical_layout() -> None:
    assert _fmt(MESSY) == CANONICAL
    assert _fmt(CANONICAL) == CANONICAL


def test_fmt_has_a_layout_for_every_rule_of_the_grammar() -> None:
    """A rule added to the grammar without a layout fails here (and fmt refuses it)."""
    trees = {str(r.alias or r.origin.name) for r in fmt._tree_parser().rules}  # a node's name
    assert {n for n in trees if not n.startswith("_")} == set(fmt._RULES)


def test_a_rule_fmt_has_no_layout_for_is_refused_and_the_file_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(fmt, "_RULES", fmt._RULES - {"pipe_tie"})
    spec = tmp_path / "s.shard"
    text = "pipeline pp {\n  first a\n  tie b = a\n}\n"
    spec.write_text(text)
    out, diags = format_text(text, "s.shard")
    assert out is None and diags[0].code == "SS001" and "pipe_tie" in diags[0].message
    assert (diags[0].span.line, diags[0].span.col) == (3, 3)
    assert main(["fmt", str(spec)]) == 2
    assert "pipe_tie" in capsys.readouterr().err
    assert spec.read_text() == text


def test_blank_lines_collapse_to_one_and_none_open_or_close_a_block() -> None:
    text = (
        "\n\nfsdp a\n\n\n\nignore b\nparam c [h] {\n\n\n  replicate h\n\n\n\n  local tp\n\n}\n\n\n"
    )
    assert _fmt(text) == "fsdp a\n\nignore b\nparam c [h] {\n    replicate h\n\n    local tp\n}\n"


def test_a_trailing_suppression_stays_on_the_first_line_of_its_rule() -> None:
    """lint looks for a suppression on a finding's line or its rule's first line: a rule on
    one line keeps its comment on the line that opens it."""
    text = "param a [h] { shard h over tp }   # shardspec: ignore[SS041]\n"
    assert _fmt(text) == "param a [h] {   # shardspec: ignore[SS041]\n    shard h over tp\n}\n"


def test_two_comments_that_meet_on_one_line_are_both_kept() -> None:
    text = "param a [h]   # one\n{   # two\n  shard h over tp\n}\n"
    out = _fmt(text)
    assert _comments(out) == _comments(text)
    assert _fmt(out) == out


def test_an_empty_file_and_a_file_of_comments() -> None:
    assert _fmt("") == ""
    assert _fmt("\n\n  \n") == ""
    assert _fmt("  # a\n\n\n# b   \n") == "# a\n\n# b\n"


# ------------------------------------------------------------ fixed points of the repo


@pytest.mark.parametrize("path", SPECS, ids=_name)
def test_the_repositorys_specs_are_canonical(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert _fmt(text) == text, f"run `shardspec fmt {_name(path)}`"


@pytest.mark.parametrize("path", EVERY, ids=_name)
def test_every_spec_is_a_fixed_point_after_one_fmt_and_keeps_its_comments(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    once = _fmt(text)
    assert _fmt(once) == once
    assert _comments(once) == _comments(text)


# ---------------------------------------------------------------- property tests


def _strip_sha(module: str) -> str:
    """The module without the spec's sha256 (the header line and SPEC_SHA256): the text
    hashed differs, by design."""
    return re.sub(r"^(# sha256 |SPEC_SHA256 = ).*$", "", module, flags=re.M)


# Generated modules embed spec line numbers: in comments (`spec.shard:12`, `lines 56-80`)
# and as the last argument but options of MapRule (5th) and BlockQuant (6th).
_LINE_ARG = {"MapRule": 4, "BlockQuant": 5}


def _strip_lines(module: str) -> str:
    """The module without the spec's sha256 and with every spec line number replaced by 0:
    a layout that moves lines changes nothing else."""
    text = _strip_sha(module)
    text = re.sub(r"(\.shard):\d+", r"\1:0", text)
    text = re.sub(r"lines \d+-\d+", "lines 0-0", text)
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            at = _LINE_ARG.get(node.func.id)
            if at is not None:
                assert isinstance(node.args[at], ast.Constant)
                assert isinstance(node.args[at].value, int)
                node.args[at] = ast.Constant(0)
    # The comments' words: a comment is wrapped after its line numbers went in, so a number
    # of another width moves a line break.
    comments = [
        row.lstrip().lstrip("#") for row in text.split("\n") if row.lstrip().startswith("#")
    ]
    return ast.dump(tree) + " ".join(" ".join(comments).split())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of specs/ and tests/cases/ (each spec beside its manifests)."""
    root = tmp_path_factory.mktemp("fmt")
    shutil.copytree(REPO_ROOT / "specs", root / "specs")
    shutil.copytree(
        REPO_ROOT / "tests" / "cases", root / "cases", ignore=shutil.ignore_patterns("*.py")
    )
    return root


def _compile(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    outcome, rendered = render_specs([str(path)], str(path.parent / "out"))
    assert not outcome.errors, [str(d) for d in outcome.diagnostics]
    ((_, module),) = rendered
    return module


# The specs that compile (tests/cases/no_manifest has no manifest: compile refuses none,
# but it is compiled all the same), each by its path in the work copy.
COMPILED = [p for p in SPECS] + [p for p in CASES if p.parent.name != "overrides"]


def _copy_of(workdir: Path, path: Path) -> Path:
    rel = path.relative_to(REPO_ROOT)
    parts = rel.parts[2:] if rel.parts[0] == "tests" else rel.parts[1:]
    return workdir / ("cases" if rel.parts[0] == "tests" else "specs") / Path(*parts)


_SEPARATORS = st.sampled_from([" ", "  ", "\t", " \t ", "   "])


@st.composite
def respaced(draw: st.DrawFn, text: str) -> str:
    """``text`` with its blanks changed within each line (indentation, between tokens,
    before a comment, at the end) and some glued where tokens allow: lines stay where
    they are."""
    out = []
    for row in text.split("\n"):
        at = comment_start(row)
        code, comment = (row, "") if at is None else (row[:at], row[at:])
        words = code.split()
        line = draw(st.sampled_from(["", " ", "  ", "\t", "        "]))
        for i, word in enumerate(words):
            if i:
                glue = words[i - 1].endswith(",") or "=" in (word, words[i - 1])
                line += draw(st.sampled_from(["", " "]) if glue else _SEPARATORS)
            line += word
        if comment:
            line += draw(_SEPARATORS) + comment
        out.append(line + draw(st.sampled_from(["", " ", "\t"])))
    return "\n".join(out)


@st.composite
def rearranged(draw: st.DrawFn, text: str) -> str:
    """``text`` with lines moved: blank lines and comment lines inserted, trailing comments
    added, and lines without a comment joined to the next."""
    rows = text.split("\n")
    out: list[str] = []
    for i, row in enumerate(rows):
        what = draw(st.sampled_from(["keep", "keep", "blank", "comment", "trailing", "join"]))
        if what == "blank":
            out += [""] * draw(st.integers(1, 3))
        elif what == "comment":
            out.append(draw(st.sampled_from(["", "  ", "\t"])) + f"# inserted {i}")
        if what == "trailing" and comment_start(row) is None and row.strip():
            row += f"  # added {i}"
        if what == "join" and comment_start(row) is None and out and comment_start(out[-1]) is None:
            out[-1] += " " + row
        else:
            out.append(row)
    return "\n".join(out)


@given(data=st.data(), path=st.sampled_from(COMPILED))
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_respacing_changes_nothing_fmt_keeps(
    data: st.DataObject, path: Path, workdir: Path
) -> None:
    """fmt(fmt(x)) == fmt(x), fmt(x) == the spec, and compile(fmt(x)) == compile(x) byte
    for byte but for the sha256 of the text (the lines stay where they were)."""
    original = path.read_text(encoding="utf-8")
    x = data.draw(respaced(original))
    once = _fmt(x)
    assert _fmt(once) == once
    assert once == _fmt(original)
    assert _comments(once) == _comments(x)
    where = _copy_of(workdir, path)
    assert _strip_sha(_compile(where, once)) == _strip_sha(_compile(where, x))


@given(data=st.data(), path=st.sampled_from(COMPILED))
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_moving_lines_changes_nothing_fmt_keeps(
    data: st.DataObject, path: Path, workdir: Path
) -> None:
    """fmt(fmt(x)) == fmt(x), comments kept, and compile(fmt(x)) == compile(x) but for the
    sha256 and the spec line numbers the module quotes (lines moved)."""
    x = data.draw(rearranged(data.draw(respaced(path.read_text(encoding="utf-8")))))
    once = _fmt(x)
    assert _fmt(once) == once
    assert _comments(once) == _comments(x)
    where = _copy_of(workdir, path)
    assert _strip_lines(_compile(where, once)) == _strip_lines(_compile(where, x))


# ------------------------------------------------------------------- the command


UGLY = "mesh over 8 ranks { dp_shard: *  tp: 2 }   # the mesh\nfsdp   dp_shard\n"
PRETTY = "mesh over 8 ranks {   # the mesh\n    dp_shard: *\n    tp: 2\n}\nfsdp dp_shard\n"


def test_check_lists_what_would_change_and_exits_1_writing_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ugly, pretty = tmp_path / "ugly.shard", tmp_path / "pretty.shard"
    ugly.write_text(UGLY)
    pretty.write_text(PRETTY)
    assert main(["fmt", "--check", str(pretty)]) == 0
    assert main(["fmt", "--check", str(ugly), str(pretty)]) == 1
    out = capsys.readouterr().out
    assert out == f"would reformat: {ugly}\n"
    assert ugly.read_text() == UGLY


def test_diff_prints_the_change_and_exits_1_writing_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ugly = tmp_path / "ugly.shard"
    ugly.write_text(UGLY)
    assert main(["fmt", "--diff", str(ugly)]) == 1
    out = capsys.readouterr().out
    assert f"--- {ugly}" in out and "+    dp_shard: *\n" in out and "-fsdp   dp_shard\n" in out
    assert ugly.read_text() == UGLY


def test_fmt_rewrites_in_place_keeping_the_mode_and_touches_no_canonical_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ugly, pretty = tmp_path / "ugly.shard", tmp_path / "pretty.shard"
    ugly.write_text(UGLY)
    pretty.write_text(PRETTY)
    os.chmod(ugly, 0o640)
    os.utime(pretty, ns=(1, 1))
    before = pretty.stat()
    assert main(["fmt", str(ugly), str(pretty)]) == 0
    assert capsys.readouterr().out == f"reformatted: {ugly}\n"
    assert ugly.read_text() == PRETTY
    assert stat.S_IMODE(ugly.stat().st_mode) == 0o640
    after = pretty.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretty.shard", "ugly.shard"]
    assert main(["fmt", "--check", str(ugly)]) == 0


def test_a_symbolic_link_is_kept_and_its_target_rewritten(tmp_path: Path) -> None:
    target = tmp_path / "real.shard"
    target.write_text(UGLY)
    link = tmp_path / "link.shard"
    link.symlink_to(target)
    assert main(["fmt", str(link)]) == 0
    assert link.is_symlink() and target.read_text() == PRETTY


def test_a_failed_write_leaves_the_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ugly = tmp_path / "ugly.shard"
    ugly.write_text(UGLY)

    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    assert main(["fmt", str(ugly)]) == 2
    assert "SS002" in capsys.readouterr().err
    assert ugly.read_text() == UGLY
    assert [p.name for p in tmp_path.iterdir()] == ["ugly.shard"]


@pytest.mark.parametrize("flags", [[], ["--check"], ["--diff"]])
def test_a_syntax_error_is_reported_as_lint_reports_it_and_the_file_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    bad, ugly = tmp_path / "bad.shard", tmp_path / "ugly.shard"
    text = "mesh over 8 ranks { dp_shard: *  tp 2 }\n"
    bad.write_text(text)
    ugly.write_text(UGLY)
    assert main(["fmt", *flags, str(bad), str(ugly)]) == 2
    err = capsys.readouterr().err
    assert main(["lint", str(bad)]) == 2
    lint_err = capsys.readouterr().err
    assert f"{bad}:1:37: error SS001 [syntax-error]" in err
    assert " 1 | mesh over 8 ranks { dp_shard: *  tp 2 }" in err and "^" in err
    assert err.split("\n\n")[0] == lint_err.split("\n\n")[0]
    assert bad.read_text() == text
    # the other file is handled all the same
    assert ugly.read_text() == (PRETTY if not flags else UGLY)


def test_an_unreadable_file_is_ss002(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fmt", str(tmp_path / "missing.shard")]) == 2
    assert "SS002" in capsys.readouterr().err


def test_without_files_fmt_takes_the_specs_lint_takes(
    in_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fmt", "--check"]) == 0
    assert f"{len(SPECS)} already formatted" in capsys.readouterr().err


# ------------------------------------------------------------------------ any input

_PIECES = [
    "mesh",
    "over",
    "8",
    "ranks",
    "{",
    "}",
    "dp: *",
    "tp: 2",
    "fsdp dp",
    "checkpoint keys torchtitan",
    "param",
    "a.b",
    "[h, w]",
    "shard h over tp",
    "replicate",
    "hf",
    '"x.json"',
    "a -> b",
    "drop c",
    "config q = a * b",
    "# c",
    "# shardspec: ignore[SS041]",
    "pipeline pp",
    "tie a = b",
    "fp8 w scale {key}_s block 1 x 2",
    "(",
    ")",
    ",",
    "=",
    "->",
    "[e]",
    '"#"',
    "\t",
    "\r",
]


@given(st.lists(st.tuples(st.sampled_from(_PIECES), st.sampled_from([" ", "\n", "", "\n\n  "]))))
@settings(max_examples=300, deadline=None)
def test_any_text_is_formatted_idempotently_or_refused_with_a_finding(
    pieces: list[tuple[str, str]],
) -> None:
    text = "".join(p + sep for p, sep in pieces)
    out, diags = format_text(text, "f.shard")
    if out is None:
        assert diags and diags[0].code in ("SS001", "SS006", "SS007")
        return
    assert not diags
    assert format_text(out, "f.shard") == (out, [])
    assert _comments(out) == _comments(text)


def test_a_large_spec_formats_in_time_linear_in_its_size() -> None:
    """A bound, not a benchmark (generous): 5,000 rules, each with comments, format in
    well under the time a quadratic placement of comments would take (about 10 s on a
    loaded 2-core machine: lark's parse, twice, is most of it)."""
    import time

    rule = "# about p{i}\nparam p{i}.weight [a, b] {{   # trailing\n  shard a over tp\n}}\n\n\n"
    text = "mesh over 8 ranks { tp: * }\n" + "".join(rule.format(i=i) for i in range(5_000))
    start = time.perf_counter()
    out = _fmt(text)
    assert time.perf_counter() - start < 120
    assert out.count("\n\n") == 4_999 and _comments(out) == _comments(text)
