"""The command line (``shardspec.cli``): help, exit codes, diagnostics, atomic and
all-or-nothing compile, ``--check``, ``-D``, ``explain`` and ``manifest``.

Most tests call ``shardspec.cli.main(argv)`` in-process (fast); a few run the real
``shardspec`` and ``python -m shardspec`` commands.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardspec import __version__
from shardspec.cli import main
from shardspec.findings.diagnostics import Diagnostic, Severity, Span, attach_sources, render_text

REPO = Path(__file__).resolve().parents[1]
DIAG_LINE = re.compile(
    r"^(?P<file>[^\s:][^:]*):(?P<line>\d+):(?P<col>\d+): (?P<sev>error|warning) "
    r"(?P<code>SS\d{3}) \[(?P<name>[a-z-]+)\]: (?P<msg>.+)$",
    re.M,
)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``shardspec ARGV`` in-process: (exit status, stdout, stderr)."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


def codes(text: str) -> list[str]:
    return [m["code"] for m in DIAG_LINE.finditer(text)]


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch project: specs/llama.shard, its manifest and HF manifest, run from its root."""
    (tmp_path / "specs").mkdir()
    for name in ("llama.shard", "llama.manifest.json", "llama.hf.json"):
        shutil.copy(REPO / "specs" / name, tmp_path / "specs" / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


BROKEN = """\
manifest "llama.manifest.json"
mesh over 8 ranks { dp_shard: *  tp: 2 }
fsdp dp_shard
param **.*norm.weight [hidden] {}
param ** [a, b] {
    shard a over tpp
}
"""


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# ----------------------------------------------------------------------------- help


@pytest.mark.parametrize("command", [[], ["compile"], ["lint"], ["explain"], ["manifest"]])
def test_help_for_every_command(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    status, out, err = run(capsys, *command, "--help")
    assert status == 0 and err == ""
    assert out.startswith(f"usage: shardspec {' '.join(command)}".rstrip())
    if not command:
        for name in ("compile", "lint", "explain", "manifest"):
            assert name in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--version")
    assert status == 0 and out.strip() == f"shardspec {__version__}"


def test_real_commands_run() -> None:
    shardspec = shutil.which("shardspec") or str(Path(sys.executable).parent / "shardspec")
    helped = subprocess.run([shardspec, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "compile" in helped.stdout
    as_module = subprocess.run(
        [sys.executable, "-m", "shardspec", "lint", "specs/llama.shard"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert as_module.returncode == 0, as_module.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "shardspec", "lint", "--bogus"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "error SS004 [bad-argument]: unrecognized arguments: --bogus" in bad.stderr
    assert "Traceback" not in bad.stderr


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["lint", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
        (["lint", "--format", "xml"], "invalid choice: 'xml'"),
        (["compile", "-D", "tp"], "'tp' is not AXIS=N"),
        (["compile", "-D", "tp=x"], "'tp=x' is not AXIS=N"),
        (["compile", "-D", "tp=0"], "'tp=0' is not AXIS=N"),
        (["lint", "-D", "tp=-1"], "'tp=-1' is not AXIS=N"),
        (["lint", "-D", "1tp=2"], "'1tp=2' is not AXIS=N"),
        (["explain", "specs/llama.shard"], "the following arguments are required: FQN"),
        (["manifest", "examples.models.llama:tiny"], "required: -o/--output"),
    ],
)
def test_bad_arguments_exit_2_with_ss004(
    capsys: pytest.CaptureFixture[str], work: Path, argv: list[str], message: str
) -> None:
    status, out, err = run(capsys, *argv)
    assert status == 2
    assert out == ""
    m = DIAG_LINE.search(err)
    assert m is not None, err
    assert (m["file"], m["line"], m["col"], m["code"], m["name"]) == (
        "<command line>",
        "1",
        "1",
        "SS004",
        "bad-argument",
    )
    assert message in m["msg"]
    assert "\n  hint: run `shardspec" in err


@pytest.mark.parametrize(
    ("defines", "message"),
    [
        (["-D", "tpp=4"], "-D tpp: spec specs/llama.shard has no mesh axis 'tpp'"),
        (["-D", "tp=2", "-D", "tp=4"], "-D tp is given twice, as 2 and 4"),
    ],
)
@pytest.mark.parametrize("command", ["lint", "compile", "explain"])
def test_defines_must_name_axes_once(
    capsys: pytest.CaptureFixture[str],
    work: Path,
    command: str,
    defines: list[str],
    message: str,
) -> None:
    extra = ["norm.weight"] if command == "explain" else []
    before = files_under(work)
    status, _, err = run(capsys, command, *defines, "specs/llama.shard", *extra)
    assert status == 2
    assert codes(err) == ["SS004"] and message in err
    assert files_under(work) == before


def test_no_specs_given_and_none_found(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for command in ("lint", "compile"):
        status, _, err = run(capsys, command)
        assert status == 2 and codes(err) == ["SS004"] and "specs/*.shard" in err


# ----------------------------------------------------------------------------- lint


def test_lint_clean_spec(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    """A clean run says so in one line (a silent one could have checked nothing)."""
    ok = "shardspec lint: {} spec(s) checked, no findings\n"
    assert run(capsys, "lint", "specs/llama.shard") == (0, ok.format(1), "")
    n = len(list((work / "specs").glob("*.shard")))
    assert run(capsys, "lint") == (0, ok.format(n), "")  # default: specs/*.shard
    status, out, _ = run(capsys, "lint", "--format", "json", "specs/llama.shard")
    assert status == 0 and "no findings" not in out  # JSON output stays JSON


def test_lint_reports_errors_in_text(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    (work / "specs" / "broken.shard").write_text(BROKEN, encoding="utf-8")
    status, out, err = run(capsys, "lint", "specs/broken.shard")
    assert status == 1 and out == ""
    (m,) = [m for m in DIAG_LINE.finditer(err) if m["code"] == "SS011"]
    assert (m["file"], m["line"], m["col"]) == ("specs/broken.shard", "6", "18")
    block = err[m.start() :].split("\n\n")[0].splitlines()
    assert block[1] == " 6 |     shard a over tpp"
    assert block[2] == "   |                  ^^^"
    assert block[3].startswith("  hint: ")
    assert re.search(r"^\d+ error\(s\), \d+ warning\(s\)$", err, re.M)


NO_HF_MANIFEST = """\
mesh over 2 ranks { tp: 2 }
param x [a] {}
hf {
    m.x -> x
}
"""


@pytest.mark.parametrize("absolute", [False, True])
def test_findings_and_suppressions_whichever_way_the_path_is_given(
    capsys: pytest.CaptureFixture[str], work: Path, absolute: bool
) -> None:
    """Every span carries the displayed path: an absolute path inside the working directory
    shows the same findings, source lines and suppressions as the relative one."""
    spec = work / "specs" / "nohf.shard"
    spec.write_text(NO_HF_MANIFEST, encoding="utf-8")
    arg = str(spec) if absolute else "specs/nohf.shard"
    status, _, err = run(capsys, "lint", arg)
    assert status == 0 and codes(err) == ["SS061", "SS079"], err
    (m,) = [m for m in DIAG_LINE.finditer(err) if m["code"] == "SS079"]
    assert m["file"] == "specs/nohf.shard"
    assert err[m.start() :].splitlines()[1] == " 3 | hf {"
    spec.write_text(NO_HF_MANIFEST.replace("hf {", "hf {  # shardspec: ignore[SS079]"), "utf-8")
    status, _, err = run(capsys, "lint", arg)
    assert status == 0 and codes(err) == ["SS061"], err


def test_lint_json(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    (work / "specs" / "broken.shard").write_text(BROKEN, encoding="utf-8")
    status, out, err = run(capsys, "lint", "--format", "json", "specs/broken.shard")
    assert status == 1 and err == ""
    found = json.loads(out)
    assert isinstance(found, list) and found
    keys = {"code", "name", "severity", "message", "hint", "file", "line", "col"}
    assert all(keys <= set(d) for d in found)
    ss011 = next(d for d in found if d["code"] == "SS011")
    assert (ss011["file"], ss011["line"], ss011["col"]) == ("specs/broken.shard", 6, 18)
    assert ss011["severity"] == "error" and ss011["hint"]
    status, out, _ = run(capsys, "lint", "--format", "json", "specs/llama.shard")
    assert status == 0 and json.loads(out) == []


def test_lint_exit_codes(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    specs = work / "specs"
    (specs / "warn.shard").write_text("mesh over 2 ranks { dp: * }\nparam ** [x] {}\n", "utf-8")
    (specs / "syntax.shard").write_text("mesh { tp 2 }\n", encoding="utf-8")
    (specs / "broken.shard").write_text(BROKEN, encoding="utf-8")
    status, _, err = run(capsys, "lint", "specs/warn.shard")  # warnings only: SS061
    assert status == 0 and codes(err) == ["SS061"] and "warning SS061" in err
    status, _, err = run(capsys, "lint", "specs/syntax.shard")
    assert status == 2 and codes(err) == ["SS001"]
    status, _, err = run(capsys, "lint", "specs/missing.shard")
    assert status == 2 and codes(err) == ["SS002"]
    status, _, err = run(capsys, "lint", "specs/llama.shard", "specs/syntax.shard")
    assert status == 2  # unreadable input outranks findings
    status, _, err = run(capsys, "lint", "specs/broken.shard", "specs/llama.shard")
    assert status == 1 and "SS011" in codes(err)


# ----------------------------------------------------------------------------- compile


def test_compile_writes_modules(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    status, out, _ = run(capsys, "compile", "specs/llama.shard")
    assert status == 0 and out == "wrote generated/llama.py\n"
    text = (work / "generated" / "llama.py").read_text(encoding="utf-8")
    assert text == (REPO / "generated" / "llama.py").read_text(encoding="utf-8")
    mode = (work / "generated" / "llama.py").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # not mkstemp's 0600
    assert sorted(p.name for p in (work / "generated").iterdir()) == ["llama.py"]


@pytest.mark.parametrize(
    ("broken", "expected_status"), [(BROKEN, 1), ("mesh { tp 2 }\n", 2)], ids=["error", "syntax"]
)
def test_compile_writes_nothing_if_any_spec_fails(
    capsys: pytest.CaptureFixture[str], work: Path, broken: str, expected_status: int
) -> None:
    (work / "specs" / "broken.shard").write_text(broken, encoding="utf-8")
    status, out, err = run(capsys, "compile", "specs/llama.shard", "specs/broken.shard")
    assert status == expected_status and out == ""
    assert "nothing written" in err
    assert not (work / "generated").exists()
    # Existing outputs are left exactly as they were.
    gen = work / "generated"
    gen.mkdir()
    (gen / "llama.py").write_text("old\n", encoding="utf-8")
    os.utime(gen / "llama.py", (1_000_000, 1_000_000))
    status, _, _ = run(capsys, "compile", "specs/llama.shard", "specs/broken.shard")
    assert status == expected_status
    assert (gen / "llama.py").read_text(encoding="utf-8") == "old\n"
    assert (gen / "llama.py").stat().st_mtime == 1_000_000
    assert sorted(p.name for p in gen.iterdir()) == ["llama.py"]


def test_compile_refuses_specs_that_share_an_output(
    capsys: pytest.CaptureFixture[str], work: Path
) -> None:
    (work / "other").mkdir()
    for name in ("llama.shard", "llama.manifest.json", "llama.hf.json"):
        shutil.copy(work / "specs" / name, work / "other" / name)
    status, out, err = run(capsys, "compile", "specs/llama.shard", "other/llama.shard")
    assert status == 2 and out == "" and codes(err) == ["SS004"]
    assert "specs/llama.shard and other/llama.shard would both write generated/llama.py" in err
    assert not (work / "generated").exists()
    # The same spec named twice is compiled once.
    status, out, _ = run(capsys, "compile", "specs/llama.shard", "./specs/llama.shard")
    assert status == 0 and out == "wrote generated/llama.py\n"


def test_compile_leaves_no_temp_files(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    shutil.copy(REPO / "specs" / "llama.shard", work / "specs" / "second.shard")
    assert run(capsys, "compile", "-o", "out")[0] == 0
    assert sorted(p.name for p in (work / "out").iterdir()) == ["llama.py", "second.py"]
    # A failed write (the output "directory" is a file) leaves nothing behind either.
    (work / "blocked").write_text("", encoding="utf-8")
    status, _, err = run(capsys, "compile", "-o", "blocked/deeper")
    assert status == 2 and codes(err) == ["SS002"] and "cannot write output" in err
    leftovers = [p for p in work.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"]
    assert leftovers == []


def test_compile_check(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    # missing -> 1, with a diff that adds the whole file
    status, out, err = run(capsys, "compile", "--check", "specs/llama.shard")
    assert status == 1
    assert out.startswith("stale: generated/llama.py\n--- generated/llama.py (missing)\n")
    assert "+# Generated by shardspec" in out
    assert "out of date; run `shardspec compile specs/llama.shard`" in err
    assert not (work / "generated").exists()  # --check writes nothing
    # fresh -> 0
    assert run(capsys, "compile", "specs/llama.shard")[0] == 0
    assert run(capsys, "compile", "--check", "specs/llama.shard") == (0, "", "")
    # stale -> 1 with a unified diff of what would change
    target = work / "generated" / "llama.py"
    text = target.read_text(encoding="utf-8")
    target.write_text(text.replace("tp=2", "tp=3", 1), encoding="utf-8")
    status, out, _ = run(capsys, "compile", "--check", "specs/llama.shard")
    assert status == 1
    assert "--- generated/llama.py (on disk)\n+++ generated/llama.py (from spec)\n" in out
    assert re.search(r"^-.*tp=3", out, re.M) and re.search(r"^\+.*tp=2", out, re.M)
    assert target.read_text(encoding="utf-8") != text  # still not rewritten


def test_compile_check_of_the_repo_is_clean(
    in_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "compile", "--check") == (0, "", "")


def test_defines_change_defaults_and_are_recorded(
    capsys: pytest.CaptureFixture[str], work: Path
) -> None:
    assert run(capsys, "compile", "-D", "tp=4", "specs/llama.shard")[0] == 1  # 2 groups / tp=4
    plain = (REPO / "generated" / "llama.py").read_text(encoding="utf-8")
    assert run(capsys, "compile", "-D", "tp=1", "-D", "world=16", "specs/llama.shard")[0] == 0
    text = (work / "generated" / "llama.py").read_text(encoding="utf-8")
    assert "# Compiled with -D tp=1 -D world=16:" in text
    assert "shardspec compile -D tp=1 -D world=16 specs/llama.shard" in text
    assert 'DEFAULT_SIZES: dict[str, int | None] = {"dp_shard": None, "tp": 1}' in text
    assert "DEFAULT_WORLD: int | None = 16" in text
    assert text.split("PARAMS")[1] == plain.split("PARAMS")[1]  # the model is the same
    # --check needs the same -D, in any order
    status, out, _ = run(capsys, "compile", "--check", "specs/llama.shard")
    assert status == 1 and "-# Compiled with -D tp=1 -D world=16:" in out
    argv = ["compile", "--check", "-D", "world=16", "-D", "tp=1", "specs/llama.shard"]
    assert run(capsys, *argv) == (0, "", "")


# ----------------------------------------------------------------------------- explain


def test_explain(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(
        capsys, "explain", "specs/llama.shard", "layers.0.feed_forward.w13.weight"
    )
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "layers.0.feed_forward.w13.weight  [192, 64] float32"
    assert "wins  specs/llama.shard:39  param layers.*.feed_forward.w13.weight" in out
    assert "why: it is the only rule that matches" in out
    assert "mesh: dp_shard=4, tp=2" in out
    assert "ffn=192 over tp [fused: gate 96, up 96]; hidden=64 over dp_shard" in out
    assert "tensor-parallel style: colwise (derived: a Linear sharded on 'ffn')" in out
    rows = {int(r.split()[0]): r.split() for r in lines if re.match(r"^\s+\d+\s+\(", r)}
    assert sorted(rows) == list(range(8))
    # rank, coord, local shape, global offset
    assert rows[0][1:6] == ["(0,0)", "[96,", "16]", "[0,", "0]"]
    assert rows[1][1:6] == ["(0,1)", "[96,", "16]", "[48,", "0]"]
    assert rows[6][1:6] == ["(3,0)", "[96,", "16]", "[0,", "48]"]
    assert rows[7][6:] == ["48:96,144:192", "x", "48:64"]
    assert "gate: 48:96" in out and "up: 48:96" in out


def test_explain_says_why_a_rule_wins(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "explain", "specs/deepseek_moe.shard", "hc_head.fn")
    assert status == 0
    assert re.search(r"wins\s+specs/deepseek_moe.shard:\d+\s+param hc_head\.\*", out)
    assert re.search(r"loses\s+specs/deepseek_moe.shard:\d+\s+param \*head\.\*", out)
    assert "why: it has more literal segments than `*head.*`" in out
    assert "placements (Replicate(), Replicate())" in out
    assert "tensor-parallel style: none (not sharded over a model-parallel axis)" in out


def test_explain_with_defines(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", "-D", "tp=1", "specs/llama.shard", "norm.weight"]
    status, out, _ = run(capsys, *argv)
    assert status == 0 and "mesh: dp_shard=8, tp=1" in out
    assert len([r for r in out.splitlines() if re.match(r"^\s+\d+\s+\(", r)]) == 8


def test_explain_on_a_large_mesh_shows_a_bounded_table(
    in_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At a million ranks: the first 64 rows, then how many more and every local shape
    with its count (from the sampled mesh, not a walk); --ranks picks other rows."""
    argv = ["explain", "-D", "world=1048576", "specs/llama.shard", "output.weight"]
    status, out, _ = run(capsys, *argv)
    rows = [r for r in out.splitlines() if re.match(r"^\s+\d+\s+\(", r)]
    assert status == 0 and len(rows) == 64
    assert "... 1048512 more ranks (--ranks A-B shows others" in out
    assert "local shapes over all 1048576 ranks: [1, 64] on 256; [0, 64] on 1048320" in out
    status, out, _ = run(capsys, *argv, "--ranks", "1048574-1048580")
    rows = [r.split() for r in out.splitlines() if re.match(r"^\s+\d+\s+\(", r)]
    assert status == 0 and [r[:2] for r in rows] == [
        ["1048574", "(524287,0)"],
        ["1048575", "(524287,1)"],
    ]
    assert rows[0][2:4] == ["[0,", "64]"]
    # A range past the mesh is cut to it, not walked (this would never end).
    status, out, _ = run(capsys, *argv, "--ranks", "1048575-999999999999999")
    rows = [r.split() for r in out.splitlines() if re.match(r"^\s+\d+\s+\(", r)]
    assert status == 0 and [r[0] for r in rows] == ["1048575"]
    for bad in ("x", "5-2", "-3", "1-"):
        status, out, err = run(
            capsys, "explain", "specs/llama.shard", "norm.weight", "--ranks", bad
        )
        assert status == 2 and "SS004" in err and "--ranks" in err, (bad, err)


def test_explain_unknown_fqn(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(
        capsys, "explain", "specs/llama.shard", "layers.0.feed_forward.w13.weigth"
    )
    assert status == 1 and out == ""
    assert codes(err) == ["SS004"]
    assert "is not in the manifest specs/llama.manifest.json" in err
    assert "hint: did you mean layers.0.feed_forward.w13.weight" in err
    status, _, err = run(capsys, "explain", "specs/llama.shard", "zzz")
    assert status == 1 and "hint: the manifest's names are in" in err


def test_explain_needs_a_readable_spec_with_a_manifest(
    capsys: pytest.CaptureFixture[str], work: Path
) -> None:
    (work / "specs" / "bare.shard").write_text("mesh over 2 ranks { dp: * }\n", "utf-8")
    status, _, err = run(capsys, "explain", "specs/bare.shard", "x")
    assert status == 2 and "explain needs a manifest" in err and codes(err) == ["SS004"]
    (work / "specs" / "bad.shard").write_text("mesh { tp 2 }\n", encoding="utf-8")
    status, _, err = run(capsys, "explain", "specs/bad.shard", "x")
    assert status == 2 and codes(err) == ["SS001"]


# ----------------------------------------------------------------------------- manifest


def test_manifest_matches_the_committed_one(
    in_repo: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_file = tmp_path / "sub" / "llama.manifest.json"
    status, out, err = run(capsys, "manifest", "examples.models.llama:tiny", "-o", str(out_file))
    assert status == 0 and err == ""
    assert out == f"wrote {out_file} (15 entries)\n"
    assert out_file.read_bytes() == (REPO / "specs" / "llama.manifest.json").read_bytes()
    assert sorted(p.name for p in out_file.parent.iterdir()) == ["llama.manifest.json"]


@pytest.mark.parametrize(
    ("factory", "args", "message"),
    [
        ("examples.models.llama.tiny", [], "is not MODULE:FUNCTION"),
        ("examples.models.llama:", [], "is not MODULE:FUNCTION"),
        ("no_such_package.models:tiny", [], "cannot import 'no_such_package.models'"),
        ("examples.models.llama:no_such_factory", [], "has no function 'no_such_factory'"),
        ("examples.models.llama:tiny", ["--arg", "bogus=3"], "unexpected keyword argument"),
        ("examples.models.llama:tiny", ["--arg", "bogus"], "is not NAME=VALUE"),
        ("examples.models.llama:LlamaConfig", [], "returned LlamaConfig, not an nn.Module"),
        ("json:dumps", [], "json:dumps() failed"),
    ],
)
def test_manifest_bad_factories(
    in_repo: Path,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    factory: str,
    args: list,
    message: str,
) -> None:
    out_file = tmp_path / "m.json"
    status, out, err = run(capsys, "manifest", factory, "-o", str(out_file), *args)
    assert status == 2 and out == ""
    assert codes(err) == ["SS004"] and message in err
    assert re.search(r"^  hint: \S", err, re.M)
    assert list(tmp_path.iterdir()) == []


def test_manifest_factory_that_raises(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "angry_models.py").write_text(
        "def build(**kw):\n    raise ValueError('n_heads must divide dim')\n", encoding="utf-8"
    )
    (tmp_path / "broken_models.py").write_text("raise RuntimeError('boom')\n", "utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    status, _, err = run(capsys, "manifest", "angry_models:build", "-o", str(tmp_path / "m.json"))
    assert status == 2 and "raised ValueError: n_heads must divide dim" in err
    status, _, err = run(capsys, "manifest", "broken_models:x", "-o", str(tmp_path / "m.json"))
    assert status == 2 and "importing 'broken_models' failed: RuntimeError: boom" in err
    assert not (tmp_path / "m.json").exists()


# ----------------------------------------------------------------------------- bad manifests


def two_entries(first: tuple[str, str], second: tuple[str, str]) -> str:
    """A manifest text with two entries (fqn, JSON shape), one per line from line 2."""
    rows = [
        f'{{"fqn": "{f}", "kind": "param", "shape": {s}, "dtype": "float32"}}'
        for f, s in (first, second)
    ]
    return '{"format": "shardspec-manifest/1", "entries": [\n  ' + ",\n  ".join(rows) + "\n]}"


@pytest.mark.parametrize(
    ("body", "message", "line"),
    [
        ('{"format": "shardspec-manifest/1", "entries": [\n', "is not valid JSON", 2),
        ('{"format": "other/2", "entries": []}', "manifest field format", 1),
        ("[]", "manifest field (root)", 1),
        (
            two_entries(("w", "[2]"), ("w", "[2]")),
            "manifest lists 'w' twice",
            3,
        ),
        (
            two_entries(("a", "[2]"), ("w", "[2, -1]")),
            "manifest entry 'w' has a negative size",
            3,
        ),
        (
            two_entries(("a", "[2]"), ("w", '"big"')),
            "manifest field entries.1.shape",
            3,
        ),
    ],
)
def test_corrupted_manifest_is_a_diagnostic(
    capsys: pytest.CaptureFixture[str], work: Path, body: str, message: str, line: int
) -> None:
    from shardspec.inputs.manifest import ManifestError, load_manifest

    (work / "specs" / "llama.manifest.json").write_text(body, encoding="utf-8")
    for command in ("lint", "compile"):
        status, out, err = run(capsys, command, "specs/llama.shard")
        assert status == 2 and out == ""
        assert codes(err) == ["SS003"] and message in err
        m = DIAG_LINE.search(err)
        assert m is not None and m["file"] == "specs/llama.shard"
    assert not (work / "generated").exists()
    with pytest.raises(ManifestError) as info:
        load_manifest(work / "specs" / "llama.manifest.json")
    assert info.value.line == line


def test_missing_manifest_is_ss002(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    (work / "specs" / "llama.manifest.json").unlink()
    status, _, err = run(capsys, "lint", "specs/llama.shard")
    assert status == 2 and codes(err) == ["SS002"] and "cannot read manifest" in err


# ----------------------------------------------------------------------------- rendering


def _diag(col: int, end_line: int | None, end_col: int | None, source: str) -> str:
    d = Diagnostic(
        "SS041",
        "unused-rule",
        Severity.ERROR,
        "msg",
        Span("f.shard", 2, col, end_line, end_col),
        "fix it",
    )
    (d,) = attach_sources([d], {"f.shard": source})
    return render_text(d)


def test_render_text_layout() -> None:
    src = "mesh { tp: 2 }\nparam a.b [x] {\n  shard x over tp\n}\n"
    text = _diag(7, 2, 10, src)
    assert text.splitlines() == [
        "f.shard:2:7: error SS041 [unused-rule]: msg",
        " 2 | param a.b [x] {",
        "   |       ^^^",
        "  hint: fix it",
    ]


def test_render_text_multi_line_span_marks_the_first_line() -> None:
    src = "mesh { tp: 2 }\nparam a.b [x] {   \n  shard x over tp\n}\n"
    lines = _diag(1, 4, 2, src).splitlines()
    assert lines[1] == " 2 | param a.b [x] {"
    assert lines[2] == "   | " + "^" * len("param a.b [x] {") + " ..."


def test_render_text_caret_edge_cases() -> None:
    src = "x\n\tparam a\tb\n"
    # tabs in the source line are kept in the marker's indent
    assert _diag(8, 2, 9, src).splitlines()[2] == "   | \t      ^"
    # a span past the end of the line (end of file) gets one caret after the text
    assert _diag(40, None, None, src).splitlines()[2] == "   | \t       \t ^"
    # an end column beyond the line is clipped to the line
    assert _diag(2, 2, 99, src).splitlines()[2] == "   | \t" + "^" * 9
    # a zero-width span still gets one caret
    assert _diag(3, 2, 3, src).splitlines()[2] == "   | \t ^"


def test_sources_are_split_only_at_newlines() -> None:
    src = "a\x0cb\nsecond\r\nthird"
    d = Diagnostic("SS041", "unused-rule", Severity.ERROR, "m", Span("f", 3, 1))
    (d,) = attach_sources([d], {"f": src})
    assert d.source_line == "third"


# ------------------------------------------------------------------ later additions


def test_json_format_reports_bad_arguments_as_json(tmp_path, capsys) -> None:
    """With --format json, even an argument error is a JSON diagnostic on stdout."""
    spec = tmp_path / "s.shard"
    spec.write_text("mesh over 4 ranks { dp: *  tp: 2 }\n", encoding="utf-8")
    for argv in (
        ["lint", "--format", "json", "-D", "tpp=2", str(spec)],
        ["lint", "--format=json", "--bogus", str(spec)],
    ):
        assert main(argv) == 2
        out = json.loads(capsys.readouterr().out)
        assert [d["code"] for d in out] == ["SS004"] and out[0]["file"] == "<command line>"


def test_compile_makes_importable_module_names(tmp_path) -> None:
    """A spec named my-model.shard compiles to my_model.py, which Python can import."""
    spec = tmp_path / "my-model.shard"
    spec.write_text(
        "mesh { dp: *  tp: 2 }  # shardspec: ignore[SS061]\nfsdp dp\n"
        "param **.weight [out, in] { shard out over tp }\n",
        encoding="utf-8",
    )
    out = tmp_path / "gen"
    assert main(["compile", str(spec), "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["my_model.py"]
    assert "DEFAULT_WORLD: int | None = None" in (out / "my_model.py").read_text()


def test_explain_names_each_ranks_global_expert(in_repo, capsys) -> None:
    """A per-EP-rank expert module is a different global expert on each EP rank: module
    local_experts.1 is expert 1 on ep rank 0 and expert 5 on ep rank 1 (4 per rank)."""
    fqn = "layers.0.moe.local_experts.1.w1.weight"
    assert main(["explain", "specs/deepseek_moe_local.shard", fqn]) == 0
    out = capsys.readouterr().out
    assert "this module on each rank: expert = its rank's first + 1" in out
    rows = {
        int(line.split()[0]): line for line in out.splitlines() if re.match(r"\s+\d+\s+\(", line)
    }
    assert "1:2 x 0:8 x 0:64" in rows[0] and "[1, 0, 0]" in rows[0]
    assert "5:6 x 0:8 x 0:64" in rows[1] and "[5, 0, 0]" in rows[1]


def test_explain_shows_the_hugging_face_sources(in_repo, capsys) -> None:
    """Each storage unit's HF tensor(s), shape, map line and transforms; a name-indexed
    module's global indices only; kept units say so."""
    assert main(["explain", "specs/llama.shard", "layers.0.attention.wqkv.weight"]) == 0
    out = capsys.readouterr().out.split("Hugging Face (the hf block):\n")[1]
    q, k, v = out.splitlines()[:3]
    assert q.split("(")[0].split() == [
        "layers.0.attention.wqkv.weight.q",
        "[64,",
        "64]",
        "<-",
        "model.layers.0.self_attn.q_proj.weight",
        "[64,",
        "64]",
    ]
    assert q.endswith(", rope 16)") and k.endswith(", rope 16)") and "rope" not in v
    fqn = "layers.0.moe.local_experts.1.w1.weight"
    assert main(["explain", "specs/deepseek_moe_local.shard", fqn]) == 0
    out = capsys.readouterr().out.split("Hugging Face (the hf block):\n")[1]
    assert [line.split()[4] for line in out.splitlines()] == [
        "model.layers.0.mlp.experts.1.gate_proj.weight",
        "model.layers.0.mlp.experts.5.gate_proj.weight",
    ]
    assert main(["explain", "specs/deepseek_moe.shard", "layers.0.moe.experts.w2"]) == 0
    out = capsys.readouterr().out
    assert "... model.layers.0.mlp.experts.7.down_proj.weight [64, 32] (8 tensors, stacked)" in out
    assert main(["explain", "specs/deepseek_moe.shard", "hc_head.fn"]) == 0
    assert "hc_head.fn: kept (not in the checkpoint)" in capsys.readouterr().out
    # a split line: each component is its rows (GPT-2: its columns) of the fused tensor
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert main(["explain", "specs/phi3.shard", qkv]) == 0
    out = capsys.readouterr().out.split("Hugging Face (the hf block):\n")[1]
    assert [line.split()[4] for line in out.splitlines()] == [
        f"{qkv}[0:64",
        f"{qkv}[64:96",
        f"{qkv}[96:128",
    ]
    assert main(["explain", "specs/gpt2.shard", "transformer.h.1.attn.c_attn.weight"]) == 0
    out = capsys.readouterr().out
    assert "c_attn.weight.k [64, 64] <- transformer.h.1.attn.c_attn.weight[64:128 of dim 1]" in out
