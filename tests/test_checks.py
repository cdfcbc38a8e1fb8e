"""Every check code, tested from one case file per code (``tests/checks/SSxxx.py``).

A case file is plain data: ``CASES``, a list of dicts with

* ``name``: the case's test id;
* ``spec``: the spec text (dedented; a leading newline is dropped, so line 1 is the line
  after the opening quotes), or ``spec_bytes`` (raw bytes), or ``spec_path`` (a path that
  does not exist);
* ``manifest``: ``{fqn: shape}`` (``None`` for an extra state), written to ``m.json`` next
  to the spec in the canonical format (one entry per line, sorted by name, so the first
  entry is on line 3), with ``factory_args`` if given, each parameter's module kind from
  ``modules`` (``{fqn: "linear"}``), any other entry fields from ``fields`` (``{fqn:
  {"class": ..., "tied_to": ...}}``) and persistent buffers from ``buffers`` (``{fqn:
  shape}``); or ``manifest_text``, written as is;
* ``hf_manifest``: ``{"config": {...}, "tensors": {key: shape}}``, written to ``hf.json``
  in the canonical HF manifest format (tensors sorted, one per line from line 4); or
  ``hf_manifest_text``, written as is;
* ``args``: extra ``shardspec lint`` arguments (``-D tp=4``);
* ``expect``: every finding the case must produce, as ``(code, where, message substring)``
  with optionally ``token`` and ``hint substring`` after it. ``where`` is the line in the
  spec, or ``"FILE:LINE"`` for another file (``"m.json:3"``, ``"<command line>:1"``);
  ``token`` is the text the finding's span must start at (``""``: anywhere).

Each case runs ``shardspec lint --format json`` in-process: its findings must be exactly
``expect`` (SS061 aside, outside SS061's own file), and the exit status must follow from
them (2 for input errors, 1 for other errors, else 0). A case whose ``expect`` holds its
file's code is a *failing* case; the others are *passing* cases, close variants that must
not trigger it. Every registered code needs both.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shardspec import cli
from shardspec.api import INPUT_CODES, lint_specs
from shardspec.checks.run import check
from shardspec.findings import catalogue
from shardspec.findings.codes import BY_CODE, CHECKS, RETIRED
from shardspec.findings.diagnostics import MAX_LINE, Severity
from shardspec.frontend.parse import parse
from shardspec.inputs.hfmanifest import dump_hf_manifest
from shardspec.inputs.manifest import dump_manifest

CASE_DIR = Path(__file__).resolve().parent / "checks"
REPO = Path(__file__).resolve().parents[1]
CASE_KEYS = {
    "name",
    "spec",
    "spec_bytes",
    "spec_path",
    "manifest",
    "manifest_text",
    "factory_args",
    "modules",
    "buffers",
    "fields",
    "hf_manifest",
    "hf_manifest_text",
    "args",
    "expect",
    "engine",  # `shardspec transfer`: the engine side's case (spec, manifest), as engine.shard
}
# `file:line:col: severity CODE [name]: message`, as the CLI writes findings to stderr.
HEAD = re.compile(
    r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<severity>error|warning) "
    r"(?P<code>SS\d{3}) \[(?P<name>[a-z0-9-]+)\]: (?P<message>.*)$"
)


def _blocks(text: str) -> list[list[str]]:
    """The findings in rendered text: each from its head line to the next blank line."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if HEAD.match(line):
            current = [line]
            blocks.append(current)
        elif not line.strip():
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _load_cases() -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(CASE_DIR.glob("SS*.py")):
        spec = importlib.util.spec_from_file_location(f"shardspec_cases_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out[path.stem] = list(module.CASES)
    return out


CASES = _load_cases()
ALL = [(code, case) for code, cases in CASES.items() for case in cases]
IDS = [f"{code}-{case['name']}" for code, case in ALL]


@dataclass(frozen=True)
class Finding:
    code: str
    file: str
    line: int
    col: int
    message: str
    severity: str
    hint: str
    name: str


@dataclass
class Run:
    rc: int
    findings: list[Finding]
    stdout: str
    stderr: str
    spec: Path
    sources: dict[str, str]  # basename -> text, for the files a case wrote


def _spec_text(case: dict[str, Any]) -> str:
    return textwrap.dedent(case["spec"]).removeprefix("\n")


def _write_case(
    case: dict[str, Any], tmp: Path, name: str = "spec.shard"
) -> tuple[Path, dict[str, str]]:
    sources: dict[str, str] = {}
    if "spec_path" in case:
        return tmp / case["spec_path"], sources
    spec = tmp / name
    if "spec_bytes" in case:
        spec.write_bytes(case["spec_bytes"])
    else:
        sources[name] = _spec_text(case)
        spec.write_text(sources[name], encoding="utf-8")
    if "manifest" in case:
        modules = case.get("modules", {})
        entries = [
            {"fqn": fqn, "kind": "extra_state"}
            if shape is None
            else {"fqn": fqn, "kind": "param", "shape": list(shape), "dtype": "float32"}
            | ({"module": modules[fqn]} if fqn in modules else {})
            | case.get("fields", {}).get(fqn, {})
            for fqn, shape in case["manifest"].items()
        ]
        entries += [
            {"fqn": fqn, "kind": "buffer", "shape": list(shape), "dtype": "float32"}
            for fqn, shape in case.get("buffers", {}).items()
        ]
        sources["m.json"] = dump_manifest(entries, "tests:model", case.get("factory_args"))
    elif "manifest_text" in case:
        sources["m.json"] = case["manifest_text"]
    if "m.json" in sources:
        (tmp / "m.json").write_text(sources["m.json"], encoding="utf-8")
    if "hf_manifest" in case:
        hf = case["hf_manifest"]
        tensors = {
            k: {"shape": list(shape), "dtype": "F32", "file": "model.safetensors"}
            for k, shape in hf["tensors"].items()
        }
        sources["hf.json"] = dump_hf_manifest(
            {"format": "shardspec-hf-manifest/1", "config": hf["config"], "tensors": tensors}
        )
    elif "hf_manifest_text" in case:
        sources["hf.json"] = case["hf_manifest_text"]
    if "hf.json" in sources:
        (tmp / "hf.json").write_text(sources["hf.json"], encoding="utf-8")
    return spec, sources


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse errors
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


def run_case(case: dict[str, Any], tmp: Path, fmt: str = "json") -> Run:
    """Write the case's files under ``tmp`` and lint them with the real CLI, in-process."""
    spec, sources = _write_case(case, tmp)
    argv = ["lint", "--format", fmt, *case.get("args", []), str(spec)]
    if "engine" in case:  # a transfer pair: the case's spec is the trainer's
        (tmp / "engine").mkdir()
        engine, more = _write_case(case["engine"], tmp / "engine", "engine.shard")
        sources["engine.shard"] = more["engine.shard"]
        argv = ["transfer", "--format", fmt, *case.get("args", []), str(spec), str(engine)]
    rc, stdout, stderr = _cli(argv)
    findings: list[Finding] = []
    if fmt == "json" and stdout.strip():
        doc = json.loads(stdout)
        for d in doc["diagnostics"] if isinstance(doc, dict) else doc:
            findings.append(
                Finding(
                    d["code"],
                    Path(d["file"]).name if d["file"] != "<command line>" else d["file"],
                    d["line"],
                    d["col"],
                    d["message"],
                    d["severity"],
                    d["hint"],
                    d["name"],
                )
            )
    # Argument errors never reach the JSON: the CLI writes them to stderr as text.
    if fmt == "json":
        for block in _blocks(stderr):
            m = HEAD.match(block[0])
            assert m is not None
            hint = block[-1].removeprefix("  hint: ") if block[-1].startswith("  hint: ") else ""
            findings.append(
                Finding(
                    m["code"],
                    m["file"],
                    int(m["line"]),
                    int(m["col"]),
                    m["message"],
                    m["severity"],
                    hint,
                    m["name"],
                )
            )
    return Run(rc, findings, stdout, stderr, spec, sources)


def _where(where: int | str) -> tuple[str, int]:
    if isinstance(where, int):
        return "spec.shard", where
    file, _, line = where.rpartition(":")
    return file, int(line)


def _token_at(run: Run, f: Finding) -> str:
    text = run.sources.get(f.file)
    if text is None:
        return ""
    lines = text.splitlines()
    return lines[f.line - 1][f.col - 1 :] if 0 < f.line <= len(lines) else ""


def _matches(run: Run, f: Finding, exp: tuple) -> bool:
    code, where, text = exp[:3]
    token = exp[3] if len(exp) > 3 else ""
    hint = exp[4] if len(exp) > 4 else ""
    file, line = _where(where)
    if (f.code, f.file, f.line) != (code, file, line) or text not in f.message:
        return False
    return _token_at(run, f).startswith(token) and hint in f.hint


def _show(findings: list[Finding]) -> str:
    return "\n".join(f"  {f.code} {f.file}:{f.line}:{f.col} {f.message}" for f in findings)


def _expected_status(expect: list[tuple]) -> int:
    errors = [e[0] for e in expect if BY_CODE[e[0]].severity is Severity.ERROR]
    if any(c in INPUT_CODES for c in errors):
        return 2
    return 1 if errors else 0


# ------------------------------------------------------------------------------ the cases


@pytest.mark.parametrize(("code", "case"), ALL, ids=IDS)
def test_case(code: str, case: dict[str, Any], tmp_path: Path) -> None:
    """The case produces exactly its expected findings, and the matching exit status."""
    assert set(case) <= CASE_KEYS, f"unknown keys {set(case) - CASE_KEYS}"
    run = run_case(case, tmp_path)
    assert "Traceback" not in run.stderr, run.stderr
    got = [f for f in run.findings if f.code != "SS061" or code == "SS061"]
    missing = []
    for exp in case["expect"]:
        hit = next((f for f in got if _matches(run, f, exp)), None)
        if hit is None:
            missing.append(exp)
        else:
            got.remove(hit)
    assert not missing and not got, (
        f"missing: {missing}\nunexpected:\n{_show(got)}\nall:\n{_show(run.findings)}"
    )
    assert run.rc == _expected_status(case["expect"]), run.stderr


def test_every_code_has_failing_and_passing_cases() -> None:
    """Every registered code has a case file with a case that triggers it and one that
    does not; no case file is for a code that is not registered."""
    codes = {c.code for c in CHECKS}
    assert set(CASES) == codes, (
        f"no case file: {sorted(codes - set(CASES))}; no such code: {sorted(set(CASES) - codes)}"
    )
    for code, cases in CASES.items():
        failing = [c for c in cases if any(e[0] == code for e in c["expect"])]
        passing = [c for c in cases if all(e[0] != code for e in c["expect"])]
        assert failing, f"{code}: no case triggers it"
        assert passing, f"{code}: no case shows a close variant that does not trigger it"


def test_case_names_are_unique() -> None:
    assert len(set(IDS)) == len(IDS)


# ------------------------------------------------------------------------ rendered findings


@pytest.mark.parametrize(
    ("code", "case"),
    [(code, case) for code, case in ALL if any(e[0] == code for e in case["expect"])],
    ids=[
        f"{code}-{case['name']}" for code, case in ALL if any(e[0] == code for e in case["expect"])
    ],
)
def test_findings_are_complete_and_render(code: str, case: dict[str, Any], tmp_path: Path) -> None:
    """Every finding has a registered code with its name and severity, a 1-based
    file:line:col and a hint, and in text renders its source line and a caret under the
    span whenever the file is known."""
    (tmp_path / "json").mkdir()
    (tmp_path / "text").mkdir()
    run = run_case(case, tmp_path / "json")
    assert run.findings
    for f in run.findings:
        check_def = BY_CODE[f.code]
        assert f.name == check_def.name
        assert f.severity == check_def.severity.value
        assert f.line >= 1 and f.col >= 1
        assert f.message and not f.message.endswith(".")
        assert f.hint, f"{f.code} has no hint: {f.message}"
    text_run = run_case(case, tmp_path / "text", fmt="text")
    blocks = _blocks(text_run.stderr)
    assert len(blocks) == len(run.findings), text_run.stderr
    for block in blocks:
        head = HEAD.match(block[0])
        assert head is not None
        file = Path(head["file"]).name if head["file"] != "<command line>" else head["file"]
        known = file in text_run.sources
        if known:
            line, col = int(head["line"]), int(head["col"])
            source = text_run.sources[file].splitlines()[line - 1]
            caret = block[2].split("| ", 1)[1]
            if len(source) <= MAX_LINE:
                assert block[1] == f" {line} | {source}", block
                assert caret.index("^") == col - 1, block
            else:  # a window of the line, the caret under the span's first character
                shown = block[1].split("| ", 1)[1]
                assert len(shown) <= MAX_LINE + 8, block
                assert shown[caret.index("^")] == source[col - 1], block
        assert block[-1].startswith("  hint: ") and len(block[-1]) > len("  hint: "), block


# --------------------------------------------------------------------------- specific checks


def _check(text: str, **kw: Any):
    spec, diags = parse(textwrap.dedent(text).removeprefix("\n"), "spec.shard")
    assert spec is not None and not diags
    return check(spec, **kw)


def test_unknown_override_through_the_api_is_ss004() -> None:
    """``lint_specs``/``check`` callers that bypass the CLI still get SS004, not a crash."""
    _, diags = _check("mesh over 8 ranks { dp_shard: *  tp: 2 }\n", overrides={"tpp": 4})
    found = [d for d in diags if d.code != "SS061"]
    assert [(d.code, d.span.file) for d in found] == [("SS004", "<command line>")]
    assert "no axis 'tpp'" in found[0].message and found[0].hint


HEAD_RULES = {
    "generic first": """
        param *head.* [vocab, hidden] {}
        param hc_head.* replicate
        """,
    "hc_head first": """
        param hc_head.* replicate
        param *head.* [vocab, hidden] {}
        """,
}


def test_precedence_does_not_depend_on_file_order(tmp_path: Path) -> None:
    """The literal `hc_head.*` beats the generic `*head.*` for hc_head's parameters, and
    loses nothing else, whatever their order in the file."""
    manifest = {
        "hc_head.base": [4],
        "hc_head.fn": [4, 64],
        "head.weight": [256, 64],
        "mtp_head.weight": [256, 64],
    }
    winners = {}
    for order, rules in HEAD_RULES.items():
        text = (
            'manifest "m.json"\nmesh over 8 ranks { dp_shard: * }\nfsdp dp_shard\n'
            + textwrap.dedent(rules)
        )
        case = {"spec": text, "manifest": manifest}
        folder = tmp_path / order.replace(" ", "_")
        folder.mkdir()
        run = run_case(case, folder)
        assert [f.code for f in run.findings] == [], _show(run.findings)
        spec, _ = parse(_spec_text(case), str(run.spec))
        assert spec is not None
        res, diags = check(spec)
        assert not diags
        winners[order] = {
            fqn: res.spec.rules[m.winner].pattern.text
            for fqn, m in res.matches.items()
            if m.winner is not None
        }
        assert not any(m.tied for m in res.matches.values())
    assert (
        winners["generic first"]
        == winners["hc_head first"]
        == {
            "hc_head.base": "hc_head.*",
            "hc_head.fn": "hc_head.*",
            "head.weight": "*head.*",
            "mtp_head.weight": "*head.*",
        }
    )


def test_example_specs_lint_clean() -> None:
    """The shipped example specs lint without a single finding."""
    specs = sorted(str(p) for p in (REPO / "specs").glob("*.shard"))
    assert specs
    _, outcome = lint_specs(specs)
    assert outcome.diagnostics == []


# ------------------------------------------------------------------------------- catalogue


def test_catalogue_is_up_to_date() -> None:
    """docs/checks.md is exactly what the registry renders (regenerate with
    `python -m shardspec.findings.catalogue`)."""
    assert (REPO / "docs" / "checks.md").read_text(encoding="utf-8") == catalogue.render()


def test_catalogue_covers_every_code() -> None:
    text = catalogue.render()
    for c in CHECKS:
        section = text.split(f"## {c.code} {c.name}\n", 1)[1].split("\n## ", 1)[0]
        assert c.summary in section and c.why in section
        assert f"**Severity:** {c.severity.value}" in section
        assert "Bad:" in section and "Good:" in section, f"{c.code} lacks an example"
    for code in RETIRED:
        assert code not in BY_CODE and f"**{code}**" in text


def test_catalogue_check_mode(tmp_path: Path) -> None:
    target = tmp_path / "checks.md"
    args = ["--output", str(target)]
    assert catalogue.main(["--check", *args]) == 1  # missing
    assert catalogue.main(args) == 0
    assert target.read_text(encoding="utf-8") == catalogue.render()
    assert catalogue.main(["--check", *args]) == 0
    target.write_text(catalogue.render() + "edited\n", encoding="utf-8")
    assert catalogue.main(["--check", *args]) == 1
    blocked = tmp_path / "file"
    blocked.write_text("", encoding="utf-8")
    assert catalogue.main(["--output", str(blocked / "checks.md")]) == 2  # reported, not raised


def test_catalogue_table_links_into_its_own_page() -> None:
    """The summary table lives in docs/checks.md only, each code linking to its section
    there; the README links to the page instead of holding a copy that could go stale."""
    text = catalogue.render()
    for c in CHECKS:
        assert f"| [{c.code}](#{c.code.lower()}-{c.name}) |" in text
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "(docs/checks.md)" in readme
    assert "| [SS001]" not in readme


def test_registry_is_well_formed() -> None:
    codes = [c.code for c in CHECKS]
    assert codes == sorted(codes) and len(set(codes)) == len(codes)
    names = [c.name for c in CHECKS]
    assert len(set(names)) == len(names)
    for c in CHECKS:
        assert re.fullmatch(r"SS\d{3}", c.code)
        assert re.fullmatch(r"[a-z]+(-[a-z]+)*", c.name)
        assert c.summary.endswith(".") and c.why.endswith(".")
