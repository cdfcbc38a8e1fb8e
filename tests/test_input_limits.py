"""Input whose cost grew faster than its size (issue 20, point 6): each case is a hostile
input at a size that took seconds to minutes (or hundreds of megabytes) before the fix, and
must now take a small fraction of a generous bound. Times are CPU seconds of this process
(``time.process_time``), so that a loaded machine does not fail them; memory is the peak
that ``tracemalloc`` sees. These are bounds, not benchmarks: ``bench/bench_input_size.py``
measures."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import re
import shutil
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardspec.cli import main
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import (
    MAX_LINE,
    MAX_MESSAGE,
    MAX_WORD,
    Span,
    attach_sources,
    render_json,
    render_text,
)
from shardspec.findings.suggest import closest, closest_few, likeness
from shardspec.frontend.parse import parse
from shardspec.frontend.syntax_errors import _arrow_then_as
from shardspec.inputs.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
BOUND_S = 5.0  # CPU seconds; the fixed code takes milliseconds for each case below


def cpu(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the peak of the memory Python allocated meanwhile (bytes)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def lint(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["lint", *argv])
    text = out.getvalue() + err.getvalue()
    assert "Traceback" not in text
    return status, text


# ------------------------------------------------------------------ syntax errors' hints

MESH = "mesh over 8 ranks { dp: * }\n"
SPACES = 60_000

HOSTILE_SYNTAX = {
    # _hf_parts searched `->\s*\S+.*\bas\b`, which backtracks quadratically over a long
    # target with no `as` (20,000 characters took 16 s; these 60,000 about 30 s). Such a
    # target is one token, now refused when read (SS007): the scan is linear anyway (below).
    "a long hf target and two [": ("SS007", "hf {\n    a -> " + "b" * SPACES + "[[\n}\n"),
    # _heads_line searched the whole text before the error with re.M, and its
    # `([^\n{}]*)\n?[ \t]*$` backtracked quadratically over a heads line's blanks
    # (20,000 took 1.9 s; these 60,000 about 17 s)
    "a heads line of many blanks above the error": (
        "SS001",
        MESH + "param w [x] {\n    heads x" + " " * SPACES + "4 }\nparam w [x] { shard x over }\n",
    ),
    # ... and once per such line
    "many such heads lines": (
        "SS001",
        MESH
        + "".join(f"param w{i} [x] {{\n    heads x" + " " * 3000 + "4 }\n" for i in range(100))
        + "param w [x] { shard x over }\n",
    ),
}


@pytest.mark.parametrize(("code", "text"), HOSTILE_SYNTAX.values(), ids=HOSTILE_SYNTAX)
def test_hostile_syntax_errors_are_explained_in_linear_time(code: str, text: str) -> None:
    (spec, diags), took = cpu(lambda: parse(text, "f.shard"))
    assert spec is None and diags[0].code == code
    assert took < BOUND_S, f"{took:.1f} s"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["->", "as", "a", " ", "\t", ".", "bas", "as_", "\x0b", "["])).map(
        "".join
    )
)
def test_the_split_line_scan_says_what_the_regex_said(line: str) -> None:
    """The one-pass scan that replaced ``->\\s*\\S+.*\\bas\\b`` agrees with it."""
    assert _arrow_then_as(line) == bool(re.search(r"->\s*\S+.*\bas\b", line))


def test_the_split_line_scan_is_linear() -> None:
    """The regex took about 0.5 s at 8,000 characters and four times that per doubling."""
    for line in ("a -> " + "b" * 1_000_000, "->" * 500_000, "a -> b " + "x " * 500_000 + "as"):
        _, took = cpu(lambda line=line: _arrow_then_as(line))
        assert took < 0.5, took


def test_a_heads_hint_is_for_the_heads_line_only() -> None:
    """The heads hint searched the whole text: a correct heads line anywhere above made any
    later error a heads mistake."""
    text = MESH + "param a [x, y] {\n    heads x 4\n    shard x over\n}\n"
    _, (d,) = parse(text, "f.shard")
    assert "heads" not in d.hint and d.hint == "expected '(' or a name"
    _, (d,) = parse(MESH + "param a [x, y] {\n    heads x of 4\n}\n", "f.shard")
    assert d.hint.startswith("write `heads kv 128`, without `of`")


# -------------------------------------------------------------------------- huge names


def _llama_spec(tmp_path: Path, body: str) -> Path:
    shutil.copy(REPO / "specs" / "llama.manifest.json", tmp_path / "m.json")
    spec = tmp_path / "s.shard"
    spec.write_text('manifest "m.json"\n' + MESH + "param ** [a, b] {}\n" + body, encoding="utf-8")
    return spec


@pytest.mark.parametrize(
    "body",
    [
        "param {name} [a] {{}}\n",  # a pattern: compiled, matched and quoted by every check
        "hf {{\n    drop {name}\n    keep {name}\n}}\n",
        "fsdp {name}\n",
    ],
    ids=["rule pattern", "hf globs", "fsdp axis"],
)
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_huge_name_costs_a_line_of_output(tmp_path: Path, body: str, fmt: str) -> None:
    """A 2 MB name took seconds and hundreds of MB (a regex compiled from it, difflib over
    it) and its findings echoed it three times over (6 MB of output); a 50 MB one took
    142 s and 7 GB. It is refused when read, and the finding quotes a line of it."""
    size = 2_000_000
    spec = _llama_spec(tmp_path, body.format(name="a" * size))
    (status, out), used = peak(lambda: lint("--format", fmt, str(spec)))
    assert status == 2 and "SS007" in out and f"is {size} characters long" in out, out[:2000]
    assert len(out) < 3 * MAX_MESSAGE, len(out)
    # the text, its bytes for the hash, one token and one error line: a few times the size
    assert used < 8 * size, used


def test_long_names_within_bounds_are_quoted_in_part(tmp_path: Path) -> None:
    """A name of 4096 characters is read; the findings about it quote at most MAX_WORD
    characters of it, and the source line under them at most MAX_LINE."""
    name = "x" * 4096
    spec = _llama_spec(tmp_path, f"fsdp {name}\nparam w [a] {{\n    shard a over {name}\n}}\n")
    status, out = lint(str(spec))
    assert status == 1 and out.count("SS011") == 2, out
    assert "more characters ...]" in out
    assert max(len(line) for line in out.splitlines()) < MAX_LINE + MAX_MESSAGE // 2
    status, out = lint("--format", "json", str(spec))
    found = json.loads(out)
    assert all(len(d["message"]) < 2 * MAX_WORD + 100 for d in found), found


def test_did_you_mean_skips_huge_names() -> None:
    """difflib over a 2 MB name and one like it took 37 s and 75 MB for one suggestion."""
    word = "ab" * 1_000_000
    got, took = cpu(lambda: (closest(word, [word + "c", "tp"]), closest_few("tp", [word])))
    assert got == (None, [])
    assert likeness(word, word) == 0.0 and likeness("tpp", "tp") > 0.6
    assert took < 0.5, took


# ---------------------------------------------------------------------- what a finding quotes


def test_every_finding_caps_what_it_quotes() -> None:
    """Whatever built a message, its names, its length and the source line shown are capped,
    in text and JSON alike; short ones are untouched."""
    name = "n" * 1_000_000
    d = diag("SS011", f"unknown mesh axis {name!r}", Span("f", 1, 7, 1, 7 + len(name)), name)
    assert len(d.message) < MAX_WORD + 50 and d.message.startswith("unknown mesh axis 'nnn")
    assert "999842 more characters" in d.message and len(d.hint) < MAX_WORD + 50
    many = diag("SS011", " ".join(["word"] * 10_000), Span("f", 1, 1), "")
    assert len(many.message) <= MAX_MESSAGE and "more characters" in many.message
    (shown,) = attach_sources([d], {"f": f"shard {name} over tp\n"})
    text = render_text(shown)
    assert len(text) < MAX_LINE + 3 * MAX_WORD + 200, len(text)
    line, marker = text.splitlines()[1:3]
    assert line.endswith(" ...") and marker.endswith("^ ...")  # the span runs on past it
    assert line.index("n") == marker.index("^")  # the caret under the name's start
    assert len(render_json([d])) < 1000
    short = diag("SS011", "unknown mesh axis 'tpp'", Span("f", 1, 1), "did you mean 'tp'?")
    assert (short.message, short.hint) == ("unknown mesh axis 'tpp'", "did you mean 'tp'?")


def test_a_long_file_name_is_quoted_in_part(tmp_path: Path) -> None:
    """A 100,000-character path on the command line (hypothesis found it) was echoed whole
    as the finding's location; it is quoted capped, in the text renderer."""
    path = "x" * 100_000
    status, out = lint(path)
    assert status == 2 and "SS002" in out and "File name too long" in out, out[:500]
    assert len(out) < 2 * MAX_MESSAGE, len(out)
    assert str(Span("ab", 3, 4)) == "ab:3:4"


def test_a_long_line_is_shown_around_the_caret() -> None:
    line = "a" * 10_000 + " shard x over tpp " + "b" * 10_000
    col = line.index("tpp") + 1
    d = diag("SS011", "unknown mesh axis 'tpp'", Span("f", 1, col, 1, col + 3), "")
    (d,) = attach_sources([d], {"f": line})
    shown, marker = render_text(d).splitlines()[1:3]
    assert shown.startswith(" 1 | ... ") and shown.endswith(" ...")
    assert shown[marker.index("^") : marker.index("^") + 3] == "tpp" and marker.endswith("^^^")


# -------------------------------------------------------------------------- big valid input


def _rules(n: int) -> str:
    return "mesh over 64 ranks {\n    dp_shard: *\n    tp: 2\n}\nfsdp dp_shard\n" + "".join(
        f"param model.layers.{i // 512}.mlp.experts.{i % 512}.gate_proj.weight "
        f"[ffn, hidden] {{\n    shard ffn over tp\n}}\n"
        for i in range(n)
    )


def test_a_spec_of_many_rules_parses_in_memory_proportional_to_it() -> None:
    """The parse tree of the whole spec and pydantic IR nodes beside it took 100 times the
    text (a 50 MB spec of 510,000 rules: 7 GB); slotted nodes, each with a span of its own,
    20 times. Nodes now keep their place as offsets from their statement's start and their
    lists as tuples: the parse peaks at about 11 times the text, and a lint (the checks'
    globs and plain rules beside the IR, their tuples shared) at about 14 times."""
    from shardspec.checks.run import check

    text = _rules(10_000)
    tracemalloc.start()
    try:
        spec, diags = parse(text, "big.shard")
        parsed = tracemalloc.get_traced_memory()[1]
        check(spec)
        linted = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert spec is not None and not diags and len(spec.rules) == 10_000
    assert spec.rules[-1].span.line == text.count("\n") - 2
    assert parsed < 13 * len(text), parsed / len(text)
    assert linted < 16 * len(text), linted / len(text)


def test_a_large_manifest_loads_in_memory_proportional_to_it(tmp_path: Path) -> None:
    """Reading a manifest allocated its 256 MB size limit up front, and each entry was a
    pydantic model of 700 bytes (with the text, 8 times the file); then a slotted pydantic
    dataclass of 170 bytes, beside the text pydantic-core parsed at 5 times the file. Now
    the standard library's decoder makes each entry a named tuple as it reads it (about
    3.3 times the file at the peak, the text included), and the manifest holds its entries
    but not its text (1.7 times the file), which a finding reads again."""
    from bench.synth import config_for, manifest_text

    text = manifest_text(config_for(20_000))
    (tmp_path / "m.json").write_text(text, encoding="utf-8")
    tracemalloc.start()
    try:
        manifest = load_manifest(tmp_path / "m.json")
        held, used = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(manifest.entries) > 20_000
    assert used < 4 * len(text), used / len(text)
    assert held < 2.2 * len(text), held / len(text)
    fqn = manifest.entries[-1].fqn
    at = text.index(json.dumps(fqn))
    line, col = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
    assert manifest.position(fqn) == (line, col)  # the text read again when asked


def test_a_manifest_changed_since_it_was_read_places_findings_at_its_start(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.json"
    path.write_text('{"format": "shardspec-manifest/2",\n "entries": [{"fqn": "a.w"}]}\n')
    manifest = load_manifest(path)
    path.write_text('{"format": "shardspec-manifest/2",\n "entries": [{"fqn": "b.w"}]}\n\n')
    assert manifest.text == "" and manifest.position("a.w") == (1, 1)
    again = load_manifest(path)
    assert again.position("b.w") == (2, 22) and again.text.startswith('{"format"')


# ---------------------------------------------------------------------- fuzz, time-bounded

ATOMS = [
    "->", " as", " ", "\t", "tie ", "split ", "{", "}", "heads ", ",", "shard ", " over ",
    "x", "1", '"', "#", "rope ", "local", "pipeline ", "(", ")", "*", "param ", "ignore ",
    "\n", "a.b", " of ", "=", "[", "]", "-", "**", "{a,b}", ":", "config ", "drop ",
]  # fmt: skip
HEADS = [
    "",
    MESH,
    MESH + "param w [x] {\n    heads x",
    MESH + "hf {\n    a -> b",
    MESH + "pipeline dp {\n    split a",
    MESH + "param w [x] {\n    fuse x as",
]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    head=st.sampled_from(HEADS),
    unit=st.lists(st.sampled_from(ATOMS), min_size=1, max_size=4).map("".join),
    times=st.integers(1, 20_000),
    tail=st.lists(st.sampled_from(ATOMS), max_size=6).map("".join),
)
def test_repeated_pieces_never_cost_more_than_their_size(
    head: str, unit: str, times: int, tail: str
) -> None:
    """Long runs of the language's pieces (a line of 80,000 characters at most), anywhere:
    parsed or explained as a syntax error within the bound, and never a traceback."""
    text = head + unit * min(times, 80_000 // len(unit)) + tail
    (spec, diags), took = cpu(lambda: parse(text, "f.shard"))
    assert (spec is None) == any(d.code in ("SS001", "SS006", "SS007") for d in diags)
    for d in attach_sources(diags, {"f.shard": text}):
        assert len(render_text(d)) < MAX_LINE + 2 * MAX_MESSAGE + 200
    assert took < BOUND_S, f"{took:.1f} s"


def test_a_huge_manifest_name_is_placed_without_backtracking(tmp_path: Path) -> None:
    """A finding about a manifest entry is placed at its name in the file; the search for
    names kept a backtracking entry per character of each (150 MB for a 1 MB name), and
    split the whole file into lines first."""
    fqn = "w" * 1_000_000
    (tmp_path / "m.json").write_text(
        '{"format": "shardspec-manifest/2", "entries": [\n'
        f'  {{"fqn": "{fqn}", "shape": [4]}},\n  {{"fqn": "v", "shape": [4]}}]}}\n'
    )
    spec = tmp_path / "s.shard"
    spec.write_text('manifest "m.json"\n' + MESH + "param v [a] {}\n")
    (status, out), used = peak(lambda: lint(str(spec)))
    assert status == 1 and "SS040" in out and "m.json:2:11" in out, out[:3000]
    assert used < 12 * len(fqn), used / len(fqn)


# ------------------------------------------------------- hints over an HF manifest's keys


def test_the_fused_tensor_hint_compares_no_huge_keys() -> None:
    """SS071's hint looks for the HF key that holds a whole fused parameter: difflib over
    every key of the parameter's shape, with no cap on the names' lengths (a key and a
    parameter name of 20,000 characters took about 1 s per key; this manifest 20 s)."""
    import random

    from shardspec.checks.hf import _fused_key, _Unit
    from shardspec.core.hfmap import Fused
    from shardspec.inputs.hfmanifest import HFManifest, HFTensor

    rnd = random.Random(0)
    alphabet = [chr(0x4E00 + i) for i in range(300)]  # no character common enough for
    huge = lambda: "".join(rnd.choices(alphabet, k=20_000))  # noqa: E731  difflib to skip
    base = f"layers.0.{huge()}.w13"
    unit = _Unit(f"{base}.gate", (4, 8), base, 0, Fused(0, (("gate", 4), ("up", 4))))
    tensor = HFTensor(shape=(8, 8), dtype="F32", file="m.safetensors")
    keys = [f"model.layers.0.{huge()}.w13" for _ in range(20)] + ["model.layers.0.w13"]
    hfm = HFManifest("hf.json", {}, {k: tensor for k in keys})
    found, took = cpu(lambda: _fused_key(unit, base, hfm))
    assert took < 1.0, took
    assert found is not None and found[0] in keys and found[1:] == ((8, 8), False)
    short = HFManifest("hf.json", {}, {k: tensor for k in ("a.0.w13", "model.layers.0.w13")})
    unit = _Unit("layers.0.w13.gate", (4, 8), "layers.0.w13", 0, unit.fused)
    assert _fused_key(unit, "layers.0.w13", short) == ("model.layers.0.w13", (8, 8), False)


# ------------------------------------------------- placing a finding in a large manifest


def test_entry_positions_reads_the_text_once_at_c_speed() -> None:
    """The error path's scan of a manifest for each entry's place walked every character
    in Python (about a minute at 125 MB; 0.5 s for this 1 MB one); now each entry is
    skipped by the standard library's decoder."""
    from shardspec.inputs.manifest import entry_positions

    odd = '}{,[]"\\'  # what a walk over characters must tell from structure
    entries = [{"fqn": f"layers.{i}.w", "shape": [4, 4], "module": odd} for i in range(8000)]
    text = json.dumps({"format": "f", "z": {"entries": [{}]}, "entries": entries}, indent=1)
    got, took = cpu(lambda: entry_positions(text))
    assert len(got) == 8000 and took < 0.15, took
    lines = text.split("\n")
    for line, col in got[:50] + got[-50:]:
        assert lines[line - 1][col - 1] == "{"
    assert {b[0] - a[0] for a, b in itertools.pairwise(got)} == {8}  # lines an entry
    # an element that is no object still has its place: index i is entry i
    assert entry_positions('{"entries": [1, {"fqn": "a"},\n  "x"]}') == [(1, 14), (1, 17), (2, 3)]
    assert entry_positions('{"entries": [{"a": 1}], "entries": [\n {}]}') == [(2, 2)]
    assert entry_positions("[]") == [] and entry_positions('{"entries": {}}') == []
