"""Property-based fuzzing of everything a user or a file gives the compiler (issue 11): a
spec, its manifest and its HF manifest, built from the language's own pieces and then
mangled. ``shardspec lint`` and ``shardspec compile`` must never raise, exit only 0, 1 or 2,
print no traceback, and every module compile writes must import."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shardspec.cli import COMMANDS, main

NAMES = ["tok_embeddings", "layers", "0", "1", "2", "attention", "wqkv", "w13", "norm", "output"]
AXES = ["dp_shard", "tp", "pp", "ep", "dp", "x"]
NUMBERS = st.one_of(
    st.integers(-3, 9),
    st.sampled_from([16, 64, 1 << 20, (1 << 20) + 1, 1 << 64, 10**30]),
)
FLOATS = st.sampled_from([0.5, float("nan"), float("inf"), -float("inf"), 1e308])


@st.composite
def fqns(draw) -> str:
    parts = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4))
    return ".".join(parts) + "." + draw(st.sampled_from(["weight", "bias"]))


@st.composite
def patterns(draw) -> str:
    pieces = draw(
        st.lists(
            st.sampled_from([*NAMES, "*", "**", "{i}", "{a,b}", "w*", "{", "}", "weight"]),
            min_size=1,
            max_size=5,
        )
    )
    return ".".join(pieces)


@st.composite
def specs(draw) -> str:
    axes = draw(st.lists(st.sampled_from(AXES), min_size=0, max_size=4))
    sizes = [draw(st.one_of(st.just("*"), NUMBERS.map(str))) for _ in axes]
    world = draw(NUMBERS)
    lines = ['manifest "m.json"'] if draw(st.booleans()) else []
    mesh = "  ".join(f"{a}: {s}" for a, s in zip(axes, sizes, strict=True))
    lines.append(f"mesh over {world} ranks {{ {mesh} }}")
    if axes and draw(st.booleans()):
        lines.append(f"fsdp {draw(st.sampled_from(axes))}")
    for _ in range(draw(st.integers(0, 4))):
        dims = draw(st.lists(st.sampled_from(["a", "b", "vocab", "qkv", "i"]), max_size=3))
        body = []
        if dims and axes and draw(st.booleans()):
            body.append(f"shard {draw(st.sampled_from(dims))} over {draw(st.sampled_from(axes))}")
        if dims and draw(st.booleans()):
            n = draw(NUMBERS)
            groups = draw(st.sampled_from(["", "", f"{draw(NUMBERS)} groups of "]))
            body.append(f"fuse {dims[0]} as {groups}q {n}, k {draw(NUMBERS)}")
        if draw(st.booleans()):
            body.append(draw(st.sampled_from(["style colwise", "style rowwise", "style none"])))
        if draw(st.booleans()):
            target = draw(st.sampled_from([*dims, "q", "k", "x"]))
            size = draw(st.one_of(NUMBERS.map(str), st.sampled_from(["head_dim", "nope"])))
            body.append(f"heads {target} {size}")
        head = f"param {draw(patterns())}"
        if draw(st.booleans()):
            lines.append(head + " replicate")
        else:
            items = "".join(f"\n    {item}" for item in body)  # one item per line
            lines.append(head + f" [{', '.join(dims)}] {{{items}\n}}")
    if axes and draw(st.booleans()):
        counts = ", ".join(str(draw(NUMBERS)) for _ in range(draw(st.integers(0, 3))))
        split = f"split {draw(patterns())}" + (f" as {counts}" if counts else "")
        tie = f"tie {draw(fqns())} = {draw(fqns())}" if draw(st.booleans()) else ""
        first, last = draw(patterns()), draw(patterns())
        lines.append(
            f"pipeline {draw(st.sampled_from(axes))} {{ first {first}  {split}  last {last}"
            f"  {tie} }}"
        )
    if draw(st.booleans()):
        hf = ['hf "hf.json" {'] if draw(st.booleans()) else ["hf {"]
        for _ in range(draw(st.integers(0, 3))):
            tail = draw(
                st.sampled_from(
                    [
                        "",
                        " transpose",
                        " as q, k",
                        " transpose as k 4 rope 2, q (a * 2)",
                        " grouped",
                        " transpose grouped as k, q",
                    ]
                )
            )
            hf.append(f"    {draw(patterns())} -> {draw(patterns())}{tail}")
        if draw(st.booleans()):
            hf.append(f"    drop {draw(patterns())}")
        if draw(st.booleans()):
            hf.append(f"    tie {draw(fqns())} = {draw(fqns())}")
        hf.append("}")
        lines += hf
    text = "\n".join(lines) + "\n"
    # then mangle: insert, delete or replace a few characters
    for _ in range(draw(st.integers(0, 2))):
        i = draw(st.integers(0, len(text)))
        junk = draw(st.text(st.sampled_from('{}[],.*:=#"\n\t -0123456789abc\x00é'), max_size=3))
        text = text[:i] + junk + text[i + draw(st.integers(0, 2)) :]
    return text


@st.composite
def manifests(draw) -> str:
    entries = []
    for fqn in draw(st.lists(fqns(), max_size=5, unique=True)):
        shape = draw(st.lists(NUMBERS, max_size=3))
        kind = draw(st.sampled_from(["param", "param", "buffer", "extra_state"]))
        entries.append({"fqn": fqn, "kind": kind, "shape": shape, "dtype": "float32"})
    args = draw(
        st.dictionaries(
            st.sampled_from([*AXES, "head_dim"]), st.one_of(NUMBERS, FLOATS), max_size=2
        )
    )
    fmt = draw(st.sampled_from(["shardspec-manifest/1", "shardspec-manifest/2"]))
    doc: dict = {"format": fmt, "factory_args": args, "entries": entries}
    if draw(st.booleans()):
        doc["state_dict"] = draw(state_dict_sections([e["fqn"] for e in entries]))
    text = json.dumps(doc)
    if draw(st.integers(0, 4)) == 0:
        text = text[: draw(st.integers(0, len(text)))]  # truncated
    return text


@st.composite
def state_dict_sections(draw, entries: list[str], names=None) -> dict:
    """A manifest's ``state_dict`` section: keys hooks add (from entries, or not), drop or
    reshape, sometimes inconsistent with the entries, sometimes malformed."""
    names = names if names is not None else fqns()
    keys = []
    for _ in range(draw(st.integers(0, 4))):
        key: dict = {
            "fqn": draw(st.one_of(names, st.sampled_from(entries or ["w"]))),
            "change": draw(st.sampled_from(["added", "added", "dropped", "reshaped", "x"])),
            "module": draw(st.one_of(st.just(""), names, TEXT)),
        }
        if draw(st.booleans()):
            key["from"] = draw(st.lists(st.sampled_from(entries or ["w"]), max_size=2))
        if draw(st.booleans()):
            key["shape"] = draw(st.lists(NUMBERS, max_size=3))
            key["dtype"] = "float32"
        keys.append(key)
    section: dict = {"keys": keys}
    if draw(st.booleans()):
        section["hooks"] = {draw(TEXT): ["state_dict hook"]}
    if draw(st.integers(0, 5)) == 0:
        section["error"] = draw(TEXT)
    return section


@st.composite
def hf_manifests(draw) -> str:
    tensors = {
        draw(fqns()): {
            "shape": draw(st.lists(NUMBERS, max_size=3)),
            "dtype": draw(st.sampled_from(["F32", "F32", "BF16", "I32", "BOOL", "Q4"])),
            "file": "a",
        }
        for _ in range(draw(st.integers(0, 4)))
    }
    config = draw(st.dictionaries(st.sampled_from(["hidden_size", "head_dim"]), NUMBERS))
    doc = {"format": "shardspec-hf-manifest/1", "config": config, "tensors": tensors}
    return json.dumps(doc)


def _run(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


TEXT = st.text(st.sampled_from("ab\"'\\\n#{}é\x00 "), max_size=8)


@st.composite
def sound_inputs(draw) -> tuple[str, str, str]:
    """A spec and manifest that compile (odd texts where the manifest allows any), so that
    the generated module's import is exercised."""
    names = draw(st.lists(fqns(), min_size=1, max_size=5, unique=True))
    entries = [{"fqn": n, "shape": draw(st.lists(st.integers(1, 16), max_size=3))} for n in names]
    # Buffers and state-dict hooks' keys with odd names: the module embeds them.
    for name in draw(st.lists(TEXT, max_size=2, unique=True)):
        if name not in names:
            entries.append({"fqn": name, "kind": "buffer", "shape": [2]})
    added = [n for n in draw(st.lists(TEXT, max_size=3, unique=True)) if n not in names]
    keys = [
        {"fqn": n, "change": "added", "module": draw(TEXT), "from": [names[0]], "shape": [1]}
        for n in added
        if n not in {e["fqn"] for e in entries}
    ]
    doc = {
        "format": "shardspec-manifest/2",
        "state_dict": {"hooks": {}, "keys": keys},
        "factory": draw(st.one_of(st.none(), TEXT)),
        "factory_args": draw(
            st.dictionaries(TEXT, st.one_of(st.integers(-(2**70), 2**70), TEXT, st.booleans()))
        ),
        "entries": entries,
    }
    tp = draw(st.sampled_from([1, 2]))
    spec = (
        f'manifest "m.json"\nmesh over {draw(st.sampled_from([2, 4, 8]))} ranks '
        f"{{ dp_shard: *  tp: {tp} }}\nfsdp dp_shard\nparam ** replicate\n"
    )
    return spec, json.dumps(doc), json.dumps({"format": "shardspec-hf-manifest/1"})


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    inputs=st.one_of(
        st.tuples(specs(), manifests(), hf_manifests()),
        sound_inputs(),
    )
)
def test_lint_and_compile_never_raise_and_modules_import(inputs: tuple[str, str, str]) -> None:
    spec, manifest, hf = inputs
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "s.shard").write_text(spec, encoding="utf-8")
        (root / "m.json").write_text(manifest, encoding="utf-8")
        (root / "hf.json").write_text(hf, encoding="utf-8")
        code, said = _run("lint", str(root / "s.shard"))
        assert code in (0, 1, 2) and "Traceback" not in said, said
        code, said = _run("compile", str(root / "s.shard"), "-o", str(root / "out"))
        assert code in (0, 1, 2) and "Traceback" not in said, said
        event(f"compile exit {code}")
        written = sorted((root / "out").glob("*.py")) if (root / "out").exists() else []
        assert (code == 0) == bool(written), (code, written, said)
        for module in written:
            loaded = importlib.util.spec_from_file_location(f"fuzzed_{module.stem}", module)
            assert loaded is not None and loaded.loader is not None
            mod = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(mod)  # imports (the runtime, torch) and builds SPEC
            assert mod.SPEC_PATH == str(root / "s.shard")
            if spec.startswith('manifest "m.json"\n'):  # the names it embeds, as written
                doc = json.loads(manifest)
                keys = (doc.get("state_dict") or {}).get("keys", [])
                added = {k["fqn"] for k in keys if k["change"] == "added"}
                assert set(mod.SPEC.hook_keys) == added
                buffers = {e["fqn"] for e in doc["entries"] if e.get("kind") == "buffer"}
                assert set(mod.SPEC.buffers) == buffers
                event("compiled with buffers or hook keys" if added or buffers else "plain")


# ----------------------------------------------------------------- the command line, fuzzed

_SPEC = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
_SPEC += "param ** replicate\n"
# Pieces of command lines: commands, options, their values (good, odd and hostile), paths
# (filled in per example: a good spec, a broken one, a folder, a missing file). `manifest`
# runs only with factories that cannot be imported: a fuzzer must not call functions.
_ARGS = [
    "lint", "compile", "explain", "hf-manifest", "manifest", "--version", "--help", "-h",
    "-D", "-Dtp=2", "tp=2", "world=16", "world=0", "tp=", "=2", "dp_shard=4", "tpp=2",
    "tp=" + "9" * 5000, "world=" + str(2**63), "x" * 100_000, "--format", "json", "text",
    "--format=json", "--check", "-o", "--out", "--ranks", "0-3", "3-1", "-1", "9" * 60,
    "--arg", "n=1", "--output", "nope.module:f", ":", "a:b:c", "é", "\x00", "", " ", "--",
    "tok_embeddings.weight", "layers.0.attention.wqkv.weight", "{GOOD}", "{BAD}", "{DIR}",
    "{MISSING}", "{OUT}",
]  # fmt: skip


_DEFINES = st.one_of(  # a good one half the time
    st.sampled_from(["tp=2", "tp=4", "world=16", "dp_shard=4"]),
    st.sampled_from(
        ["world=0", "tp=", "=2", "tpp=2", "tp=x", "tp=" + "9" * 5000, "world=" + str(2**63),
         "world=1099511627776", "tp=" + "x" * 100_000]
    ),
)  # fmt: skip
# `manifest` runs these only: none can be imported and called (a fuzzer must call nothing)
_SAFE_FACTORIES = ("nope.module:f", ":", "a:b:c", "x", "os.path:nope")
_PATHS = st.one_of(  # the good spec half the time
    st.just("{GOOD}"), st.sampled_from(["{BAD}", "{DIR}", "{MISSING}", "{HUGE}", "x" * 5000])
)


@st.composite
def command_lines(draw) -> list[str]:
    """A command with options that fit it (values good or not), then sometimes a stray
    piece anywhere."""
    cmd = draw(st.sampled_from(["lint", "compile", "explain", "hf-manifest", "manifest"]))
    argv = [cmd]
    if cmd in ("lint", "compile", "explain"):
        for _ in range(draw(st.integers(0, 2))):
            argv += ["-D", draw(_DEFINES)]
    if cmd == "lint" and draw(st.booleans()):
        argv += ["--format", draw(st.sampled_from(["json", "text", "xml"]))]
    if cmd == "compile":
        argv += draw(st.sampled_from([[], ["--check"], ["-o", "{OUT}"], ["-o", "{GOOD}"]]))
    if cmd == "explain":
        if draw(st.booleans()):
            argv += ["--ranks", draw(st.sampled_from(["0-3", "3-1", "-1", "9" * 60, "x", "7"]))]
        fqn = st.sampled_from(["tok_embeddings.weight", "nope", "x" * 100_000, "", "é"])
        argv += [draw(_PATHS), draw(fqn)]
    elif cmd == "hf-manifest":
        argv += [draw(st.sampled_from(["{DIR}", "{MISSING}", "{GOOD}"]))]
        argv += draw(st.sampled_from([[], ["-o", "{OUT}"], ["-o", "{DIR}"]]))
    elif cmd == "manifest":  # only factories that cannot be imported: no function is called
        argv += [draw(st.sampled_from(_SAFE_FACTORIES))]
        argv += ["-o", "{OUT}", *draw(st.sampled_from([[], ["--arg", "n=1"], ["--arg", "n"]]))]
    else:
        argv += draw(st.lists(_PATHS, max_size=3))
    if draw(st.integers(0, 3)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(_ARGS)))
    return argv


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(command_lines(), command_lines(), st.lists(st.sampled_from(_ARGS), max_size=8)))
def test_any_command_line_gives_a_status_and_no_traceback(argv: list[str]) -> None:
    """Whatever the arguments, every command exits 0, 1 or 2 with findings or usage, never
    a traceback; what it prints is bounded (a 100,000-character argument is quoted in part)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "good.shard").write_text(_SPEC, encoding="utf-8")
        (root / "bad.shard").write_text(_SPEC + "param [x] {\n", encoding="utf-8")
        (root / "huge.shard").write_text(_SPEC + "fsdp " + "a" * 300_000, encoding="utf-8")
        shutil.copy(Path(__file__).parents[1] / "specs" / "llama.manifest.json", root / "m.json")
        where = {
            "{GOOD}": root / "good.shard",
            "{BAD}": root / "bad.shard",
            "{HUGE}": root / "huge.shard",
            "{DIR}": root,
            "{MISSING}": root / "missing.shard",
            "{OUT}": root / "out",
        }
        args = [str(where.get(a, a)) for a in argv]
        if args[:1] == ["manifest"]:  # only factories that cannot be imported
            args = [a if ":" not in a or a in _SAFE_FACTORIES else "x" for a in args]
        here = os.getcwd()
        os.chdir(root)  # `compile` without -o writes generated/ where it runs
        try:
            code, said = _run(*args)
        finally:
            os.chdir(here)
        assert code in (0, 1, 2) and "Traceback" not in said, said[-3000:]
        assert len(said) < 50_000, len(said)  # a 100,000-character argument is quoted in part
        command = args[0] if args and args[0] in COMMANDS else "other"
        event(f"{command} exit {code}")
