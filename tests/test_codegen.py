"""Code generation: golden files, determinism, ruff style, and what a generated module needs.

Golden cases live in ``tests/cases/<name>/``: ``spec.shard``, usually a ``manifest.json``,
optionally ``defines.txt`` (one ``AXIS=N`` per line, as ``-D`` would pass them) and the
expected output ``expected.py``. Rewrite the expected files with
``pytest tests/test_codegen.py --update-golden`` and review the diff.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardspec import __version__
from shardspec.api import check, compile_specs, emit, parse, render_specs
from shardspec.codegen.render import LINE, Call, assign, comment, layout, py, py_str
from shardspec.inputs.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
CASES_DIR = REPO / "tests" / "cases"
CASES = sorted(p.name for p in CASES_DIR.iterdir() if (p / "spec.shard").is_file())
RUFF = [sys.executable, "-m", "ruff"]
RUFF_OPTS = ["--isolated", "--line-length", "100"]


def case_defines(name: str) -> tuple[dict[str, int], int | None]:
    """The case's ``-D`` values: axis overrides and the world size."""
    path = CASES_DIR / name / "defines.txt"
    sizes: dict[str, int] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").split():
            axis, _, size = line.partition("=")
            sizes[axis] = int(size)
    world = sizes.pop("world", None)
    return sizes, world


def render_case(name: str) -> str:
    """Render a case the way ``shardspec compile`` would (run from the repo root)."""
    sizes, world = case_defines(name)
    outcome, rendered = render_specs(
        [f"tests/cases/{name}/spec.shard"], "generated", overrides=sizes, world=world
    )
    assert not outcome.errors, [str(d) for d in outcome.diagnostics]
    ((_, text),) = rendered
    return text


# ----------------------------------------------------------------------------- golden files


def test_the_required_golden_cases_exist() -> None:
    assert {
        "dense",
        "moe_local",
        "no_manifest",
        "long_names",
        "overrides",
        "hf",
        "pipeline",
        "state_dict_hooks",
    } <= set(CASES)
    assert (CASES_DIR / "overrides" / "defines.txt").is_file()
    assert not (CASES_DIR / "no_manifest" / "manifest.json").exists()


@pytest.mark.parametrize("name", CASES)
def test_golden(name: str, in_repo: Path, update_golden: bool) -> None:
    text = render_case(name)
    expected = CASES_DIR / name / "expected.py"
    if update_golden:
        expected.write_text(text, encoding="utf-8", newline="\n")
    assert expected.is_file(), f"no {expected}; run pytest --update-golden"
    assert text == expected.read_bytes().decode("utf-8"), (
        f"{expected} differs from a fresh render; if the change is intended, run "
        "`pytest tests/test_codegen.py --update-golden` and review the diff"
    )


def test_golden_cases_cover_what_they_claim(in_repo: Path) -> None:
    dense = render_case("dense")
    assert "PARAMS: ParamTable[Param] | None = ParamTable(\n    {\n" in dense
    assert '"head.bias": Param(' in dense and "any_rank=True," in dense
    # Names that differ only in their layer number share a row.
    assert '"layers.{0..1}.attn.wqkv.weight": Param(1, (128, 64), "float32"),' in dense
    assert "# 16 parameters in 10 rows." in dense
    # A buffer: no parameter, but known (save does not refuse it).
    assert '"rope.cache"' not in dense.split("PARAMS:")[1].split("BUFFERS")[0]
    assert '"rope.cache": Buffer(None, (16, 8), "float32"),' in dense
    assert "_extra_state" not in dense.split("IGNORE")[1].split("\n", 1)[1]  # ignored
    assert 'fuse=(("qkv", (("q", 32), ("k", 16), ("v", 16)), 2),),' in dense

    moe = render_case("moe_local")
    assert (
        'NAME_INDEXED_COUNTS: dict[int, dict[str, int]] = {0: {"expert": 4}, 1: {"expert": 4}}'
        in moe
    )
    assert 'name_indexed=("expert",),' in moe and 'local=("ep",),' in moe
    assert 'FACTORY_ARGS: dict[str, int | float | str | bool] = {"ep": 2}' in moe

    bare = render_case("no_manifest")
    assert "PARAMS: ParamTable[Param] | None = None" in bare
    assert "NAME_INDEXED_COUNTS: dict[int, dict[str, int]] = {}" in bare

    long = render_case("long_names")
    assert "FACTORY: str | None = (\n" in long  # a long string is parenthesized
    assert "DEFAULT_SIZES: dict[str, int | None] = {\n" in long  # a long dict is exploded
    assert '.weight": Param(\n            3, (128, 256), "float32"\n        ),' in long  # hugged
    # A row's name too long for its line goes in parentheses, split after a dot if need be.
    assert '_projection.weight"\n        ): Param(0, (384, 128), "float32"),' in long
    assert '_projection_gated."\n            "weight"\n        ): Param(' in long
    assert "\n    #     " in long  # a long rule comment continues on a second line
    assert max(len(line) for line in long.splitlines()) <= LINE

    hooks = render_case("state_dict_hooks")  # keys state-dict hooks write, from the manifest
    # Every layer's hook keys share a row, their names relative to the key's.
    assert '"layers.{0..1}.attention.wv.weight": Hook(\n' in hooks
    assert '"layers.*.attention", ("layers.*.attention.qkv_linear.wqkv.weight",)' in hooks
    assert '"layers.{0..1}.attention.qkv_linear.wqkv.weight": Param(' in hooks
    assert '.attention.wq.weight": Param(' not in hooks

    over = render_case("overrides")
    assert "# Compiled with -D tp=4 -D world=16:" in over
    assert "#     shardspec compile -D tp=4 -D world=16 tests/cases/overrides/spec.shard" in over
    assert 'DEFAULT_SIZES: dict[str, int | None] = {"dp_shard": None, "tp": 4}' in over
    assert "DEFAULT_WORLD: int | None = 16" in over
    assert "# sizes: dp_shard=rest, tp=4" in over


def _load(path: Path, name: str):
    import importlib.util

    mod_spec = importlib.util.spec_from_file_location(name, path)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _modules_and_specs() -> list[tuple[Path, str, dict[str, int], int | None]]:
    """Every generated module with a manifest: (module file, its spec, -D sizes, world)."""
    out = [
        (CASES_DIR / n / "expected.py", f"tests/cases/{n}/spec.shard", *case_defines(n))
        for n in CASES
        if (CASES_DIR / n / "manifest.json").is_file()
    ]
    for spec in sorted((REPO / "specs").glob("*.shard")):
        out.append((REPO / "generated" / f"{spec.stem}.py", f"specs/{spec.name}", {}, None))
    return out


def test_params_table_holds_every_parameter_as_the_compiler_placed_it(in_repo: Path) -> None:
    """The folded PARAMS rows read back, name for name and in the manifest's order, as the
    per-parameter table the compiler resolved: rule, module shape, dtype."""
    from shardspec.api import lint_specs
    from shardspec.runtime import Param, ParamTable

    checked = 0
    for path, spec_path, sizes, world in _modules_and_specs():
        mod = _load(path, f"params_{path.parent.name}_{path.stem}")
        ((_, res),) = lint_specs([spec_path], sizes, world)[0]
        assert res is not None and res.manifest is not None, spec_path
        expected = {
            fqn: Param(m.winner, tuple(m.entry.shape), m.entry.dtype)  # type: ignore[arg-type]
            for fqn, m in res.params
        }
        assert isinstance(mod.PARAMS, ParamTable) and mod.SPEC.params is mod.PARAMS
        assert list(mod.PARAMS.items()) == list(expected.items()), spec_path
        assert len(mod.PARAMS) == len(expected) and len(mod.PARAMS.rows) < len(expected)
        assert all(mod.PARAMS[f] == p for f, p in expected.items())
        checked += 1
    assert checked >= 12


def test_module_size_does_not_grow_with_the_parameter_count(tmp_path: Path) -> None:
    """Issue 20.11: a generated module held one line per parameter (7.1 MB at 100k). Now a
    synthetic MoE of 30x the parameters gives a module of the same size: one row per kind."""
    from bench import synth

    sizes = {}
    for n in (1_000, 30_000):
        cfg = synth.config_for(n)
        shard = synth.write(cfg, tmp_path / str(n))
        outcome, rendered = render_specs([str(shard)], str(tmp_path / "out"))
        assert not outcome.errors, [str(d) for d in outcome.diagnostics]
        ((_, text),) = rendered
        table = text.split("\nPARAMS: ")[1].split("\n)\n")[0]
        sizes[n] = (cfg.n_params, len(text.encode()), len(table), table.count(": Param("))
    (small, small_bytes, small_table, small_rows) = sizes[1_000]
    (big, big_bytes, big_table, big_rows) = sizes[30_000]
    assert big > 25 * small
    assert small_rows == big_rows < 30
    assert abs(big_table - small_table) < 100  # only the numbers in the rows differ
    # The rest grows by the buffers' names (one per MoE layer), not by the parameters'.
    assert small_bytes < 25_000 and big_bytes < 30_000


_ROW_KEYS = [
    "a",
    "layers.{0..60}.mlp.experts.{0..255}.w1",
    "x" * 80,
    "x" * 81,
    "x" * 86,
    "x" * 87,
    "y" * 140,
    "model.vision_tower.vision_model.encoder.layers.{0..26}.self_attn.k_proj.weight.more",
    ".".join(["segment_" + str(i) for i in range(20)]),
    ".".join(["s" * 40, "t" * 95, "u" * 10]),
    'quo"te.back\\slash.{0..3}.tab\t.' + "z" * 70,
]


def test_params_rows_are_laid_out_as_ruff_formats_them(tmp_path: Path) -> None:
    """Rows of every length (short, hugging the call, a key in parentheses, a key split
    after dots, a segment longer than a line) are left unchanged by ``ruff format``, pass
    ``ruff check`` (line length included) and mean the keys they were given; ``Buffer``
    rows (the rule None) as well."""
    from shardspec.codegen.render import _row_line

    shapes = [(4, 4), tuple(range(1, 30)), ()]
    rows = [
        _row_line(key, Call("Param", (i, shapes[i % 3], "float32")))
        if i % 3
        else _row_line(key, Call("Buffer", (None, shapes[i % 3], "float32")))
        for i, key in enumerate(_ROW_KEYS)
    ]
    lines = [f"        {row}" for row in rows]
    text = (
        "from __future__ import annotations\n\n\ndef Param(*a):\n    return a\n\n\n"
        "def Buffer(*a):\n    return a\n\n\n"
        "def ParamTable(rows):\n    return rows\n\n\n"
        "PARAMS = ParamTable(\n    {\n" + "\n".join(lines) + "\n    }\n)\n"
    )
    path = tmp_path / "rows.py"
    path.write_text(text, encoding="utf-8")
    fmt = subprocess.run(
        [*RUFF, "format", "--diff", *RUFF_OPTS, str(path)], capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout[:4000]
    lint = subprocess.run(
        [*RUFF, "check", *RUFF_OPTS, "--select", "E,F,W", str(path)], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout[:4000]
    ns: dict[str, object] = {}
    exec(compile(text, str(path), "exec"), ns)
    table = ns["PARAMS"]
    assert isinstance(table, dict)
    assert list(table) == _ROW_KEYS
    assert [v[0] for v in table.values()] == [i if i % 3 else None for i in range(len(_ROW_KEYS))]


def test_hf_golden_case_has_the_table_and_the_wrappers(in_repo: Path) -> None:
    text = render_case("hf")
    assert "from typing import TYPE_CHECKING, Any\n" in text
    assert (
        "from shardspec.runtime import (\n    BlockQuant,\n    Buffer,\n    CompiledSpec,\n"
        "    HFMap,\n    Hook,\n"
        "    MapRule,\n    Param,\n    ParamTable,\n    RuleSpec,\n    RuntimeModule,\n"
        "    Transform,\n    require,\n)\n"
    ) in text
    assert "HF = HFMap(\n    rules=(\n" in text
    assert 'MapRule("model.embed_tokens.weight", "embed.weight", None, (), 29),' in text
    assert '"layers.{i}.moe.experts.w1",\n            "e",' in text
    assert '(Transform("rope", 16),),' in text and '(Transform("transpose"),),' in text
    assert 'drops=("model.rotary_emb.inv_freq", "**.attn.bias"),' in text
    assert 'ties=(("lm_head.weight", "model.embed_tokens.weight"),),' in text
    assert 'keeps=("hc_head.*",),' in text
    # fp8 lines: every field written out, defaults included (a table to read line by line)
    assert (
        '        BlockQuant(\n            "model.layers.*.self_attn.*_proj.weight",\n'
        '            "{key}_scale",\n            (128, 64),\n            "ue8m0",\n'
        '            "float8_e4m3fn",\n            50,\n        ),\n'
    ) in text
    assert "def load_hf(\n" in text and "def export_hf(\n" in text
    assert "return _hf.load_hf(SPEC, HF, model, path, mesh, **options)" in text
    assert "return _hf.export_hf(SPEC, HF, model, path, mesh, **options)" in text
    # The runtime is imported when the wrappers run, not when the module is imported.
    assert text.count("from shardspec.runtime import hf as _hf") == 2
    assert "\nfrom shardspec.runtime import hf" not in text


def test_specs_without_hf_get_no_hf_code(in_repo: Path) -> None:
    for name in CASES:
        if name == "hf":
            continue
        text = render_case(name)
        assert "hfmap" not in text and "load_hf" not in text


def test_generated_hf_table_is_the_compiled_map(
    in_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module's HF table equals the map the compiler builds from the spec, and the
    wrappers hand SPEC, HF and every argument to shardspec.runtime.hf."""
    import importlib.util
    import types

    import shardspec.runtime
    from shardspec.resolve.hf import build_hfmap

    path = CASES_DIR / "hf" / "expected.py"
    mod_spec = importlib.util.spec_from_file_location("golden_hf", path)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    spec, diags = parse((CASES_DIR / "hf" / "spec.shard").read_text(encoding="utf-8"), "x")
    assert spec is not None and spec.hf is not None and not diags
    assert mod.HF == build_hfmap(spec.hf)
    assert [r.line for r in mod.HF.rules] == [m.span.line for m in spec.hf.maps]

    calls = []
    fake = types.ModuleType("shardspec.runtime.hf")
    fake.load_hf = lambda *a, **k: calls.append(("load", a, k)) or "loaded"  # type: ignore[attr-defined]
    fake.export_hf = lambda *a, **k: calls.append(("export", a, k)) or "exported"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "shardspec.runtime.hf", fake)
    monkeypatch.setattr(shardspec.runtime, "hf", fake, raising=False)
    model = object()
    assert mod.load_hf(model, "ckpt", None, strict=False) == "loaded"
    assert mod.export_hf(model, "out", "mesh", config={"a": 1}) == "exported"
    assert calls == [
        ("load", (mod.SPEC, mod.HF, model, "ckpt", None), {"strict": False}),
        ("export", (mod.SPEC, mod.HF, model, "out", "mesh"), {"config": {"a": 1}}),
    ]


def test_without_overrides_the_header_records_none(in_repo: Path) -> None:
    outcome, rendered = render_specs(["tests/cases/overrides/spec.shard"], "generated")
    assert not outcome.errors
    text = rendered[0][1]
    assert "Compiled with" not in text
    assert "# DO NOT EDIT: change the spec and run `shardspec compile " in text
    assert 'DEFAULT_SIZES: dict[str, int | None] = {"dp_shard": None, "tp": 2}' in text


def test_an_override_equal_to_the_spec_is_not_recorded(in_repo: Path) -> None:
    spec_path = "tests/cases/overrides/spec.shard"
    _, plain = render_specs([spec_path], "generated")
    _, same = render_specs([spec_path], "generated", overrides={"tp": 2}, world=8)
    assert plain[0][1] == same[0][1]


# ----------------------------------------------------------------------------- determinism


def _render_with_manifest_order(name: str, tmp_path: Path, seed: int) -> str:
    case = CASES_DIR / name
    raw = json.loads((case / "manifest.json").read_text(encoding="utf-8"))
    random.Random(seed).shuffle(raw["entries"])
    raw["factory_args"] = dict(reversed(list(raw["factory_args"].items())))
    shuffled = tmp_path / f"shuffled{seed}.json"
    shuffled.write_text(json.dumps(raw, indent=1), encoding="utf-8")
    spec, diags = parse(
        (case / "spec.shard").read_text(encoding="utf-8"), f"tests/cases/{name}/spec.shard"
    )
    assert spec is not None and not diags
    sizes, world = case_defines(name)
    res, found = check(spec, manifest=load_manifest(shuffled), overrides=sizes, world=world)
    assert not [d for d in found if d.is_error]
    return emit(res, spec.path, "generated.spec", overrides=sizes, world=world)


@pytest.mark.parametrize("name", ["dense", "moe_local", "long_names"])
def test_manifest_entry_order_does_not_matter(name: str, tmp_path: Path, in_repo: Path) -> None:
    expected = (CASES_DIR / name / "expected.py").read_text(encoding="utf-8")
    first = _render_with_manifest_order(name, tmp_path, 1)
    assert first == _render_with_manifest_order(name, tmp_path, 2)
    assert first == expected


def test_rendering_twice_gives_the_same_bytes(in_repo: Path) -> None:
    for name in CASES:
        assert render_case(name) == render_case(name)


def test_rendering_does_not_depend_on_hash_seeds() -> None:
    """Set and dict orders of strings vary with PYTHONHASHSEED; the output must not."""
    code = (
        "import hashlib, os, sys\n"
        "from shardspec.api import render_specs\n"
        "specs = sorted(os.path.join('tests', 'cases', n, 'spec.shard') "
        "for n in os.listdir('tests/cases') if n != 'overrides')\n"
        "specs = [s for s in specs if os.path.exists(s)]\n"
        "texts = []\n"
        "for spec in specs:\n"
        "    out, rendered = render_specs([spec], 'generated')\n"
        "    assert not out.errors, spec\n"
        "    texts.append(rendered[0][1])\n"
        "print(len(texts), hashlib.sha256(''.join(texts).encode()).hexdigest())\n"
    )
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        digests.add(run.stdout.strip())
    assert len(digests) == 1
    assert digests.pop().startswith(f"{len(CASES) - 1} ")


# ----------------------------------------------------------------------------- the header


@pytest.mark.parametrize("name", CASES)
def test_header_names_spec_hash_and_version_and_no_time(name: str) -> None:
    text = (CASES_DIR / name / "expected.py").read_text(encoding="utf-8")
    spec_text = (CASES_DIR / name / "spec.shard").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert lines[0] == f"# Generated by shardspec {__version__} from tests/cases/{name}/spec.shard"
    assert lines[1] == f"# sha256 {hashlib.sha256(spec_text.encode()).hexdigest()}"
    assert f'SPEC_PATH = "tests/cases/{name}/spec.shard"' in text
    assert f'COMPILER_VERSION = "{__version__}"' in text
    assert not re.search(r"\b(19|20)\d\d-\d\d-\d\d\b|\d\d:\d\d:\d\d", text)
    assert "timestamp" not in text.lower() and "generated at" not in text.lower()


# ----------------------------------------------------------------------------- ruff style


def _generated_files() -> list[Path]:
    golden = [CASES_DIR / n / "expected.py" for n in CASES]
    return golden + sorted((REPO / "generated").glob("*.py"))


def test_output_is_ruff_formatted_and_clean() -> None:
    files = [str(p) for p in _generated_files()]
    fmt = subprocess.run(
        [*RUFF, "format", "--check", "--diff", *RUFF_OPTS, *files], capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    lint = subprocess.run([*RUFF, "check", *RUFF_OPTS, *files], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice(["str", "int", "none", "tuple", "dict", "call"] if depth < 3 else ["str"])
    if kind == "str":
        return "".join(rng.choice("abcdefghij_.*{},") for _ in range(rng.randint(0, 40)))
    if kind == "int":
        return rng.randint(0, 10 ** rng.randint(0, 9))
    if kind == "none":
        return None
    n = rng.randint(0, 6)
    if kind == "tuple":
        return tuple(_random_value(rng, depth + 1) for _ in range(n))
    if kind == "dict":
        return {f"k{i}_{'x' * rng.randint(0, 30)}": _random_value(rng, depth + 1) for i in range(n)}
    return Call("Param", tuple(_random_value(rng, depth + 1) for _ in range(rng.randint(1, 4))))


def test_layout_splits_literals_as_ruff_does(tmp_path: Path) -> None:
    """Random nested literals at several indents, laid out by ``layout``/``assign``, are
    left unchanged by ``ruff format``."""
    rng = random.Random(7)
    chunks = ["from __future__ import annotations\n\n\ndef Param(*a):\n    return a\n\n\n"]
    for i in range(300):
        value = _random_value(rng)
        if i % 3 == 0:
            chunks.append(assign(f"X{i}: object", value) + "\n")
        else:
            head = f"{py('k' * rng.randint(1, 90))}: "
            body = "\n".join(layout(value, 4, head, ","))
            chunks.append(f"Y{i} = {{\n{body}\n}}\n")
    chunks.append(assign("LONG_STRING", "s" * 95) + "\n")
    chunks.append(assign("TOO_LONG_STRING", "s" * 120) + "\n")
    path = tmp_path / "literals.py"
    text = "".join(chunks)
    path.write_text(text, encoding="utf-8")
    run = subprocess.run(
        [*RUFF, "format", "--diff", *RUFF_OPTS, str(path)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[:4000]
    ns: dict[str, object] = {}
    exec(compile(text, str(path), "exec"), ns)  # the literals mean what they say
    assert ns["LONG_STRING"] == "s" * 95


@pytest.mark.parametrize(
    "value",
    ["plain", 'a"b', "a'b", "back\\slash", "new\nline", "tab\tx", "é", "\x00", '\'"\'""', ""],
)
def test_string_literals_round_trip(value: str) -> None:
    assert eval(py_str(value)) == value
    assert "\n" not in py_str(value)


def test_comment_wraps_between_words() -> None:
    words = ["0:", "x" * 30] + [f"axis_{i}=S(0)," for i in range(12)]
    text = comment(words, 4)
    lines = text.splitlines()
    assert len(lines) > 1
    assert all(len(line) <= LINE for line in lines)
    assert lines[0].startswith("    # 0: ") and lines[1].startswith("    #     axis_")
    assert " ".join(line.split("#", 1)[1].strip() for line in lines) == " ".join(words)
    assert comment(["short", "one"], 4) == "    # short one"


# ----------------------------------------------------------------------------- generated modules


_IMPORT_CHECK = r"""
import importlib.abc
import importlib.util
import sys

BLOCKED = ("lark", "jinja2", "pydantic")


class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"a generated module imported {name}")
        return None


sys.meta_path.insert(0, Block())
for i, path in enumerate(sys.argv[1:]):
    spec = importlib.util.spec_from_file_location(f"gen{i}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sizes = mod.SPEC.sizes(world=mod.DEFAULT_WORLD or 16)
    if mod.PARAMS:
        fqn = sorted(mod.PARAMS)[0]
        layout = mod.SPEC.layout(fqn, sizes)
    else:
        layout = mod.SPEC.layout("layers.0.attention.wq.weight", sizes, shape=(64, 64))
    print(path, sizes, [d.size for d in layout.dims])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not loaded, loaded
print("OK")
"""


def test_generated_modules_import_without_compiler_dependencies() -> None:
    files = [str(p) for p in _generated_files()]
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK, *files], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("OK")
    assert run.stdout.count("\n") == len(files) + 1
    # The overrides case's defaults are the -D values: tp=4 on 16 ranks.
    assert "'dp_shard': 4, 'tp': 4" in run.stdout


_LAZY_CHECK = r"""
import importlib.util
import sys

import torch
import shardspec.runtime

before = set(sys.modules)
for i, path in enumerate(sys.argv[1:]):
    spec = importlib.util.spec_from_file_location(f"gen{i}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    assert mod.SPEC.params is mod.PARAMS
heavy = sorted(
    m
    for m in set(sys.modules) - before
    if m.startswith(("torch", "shardspec.runtime.")) and m != "shardspec.runtime.spec"
)
print("imported:", heavy)
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

for i in range(len(sys.argv) - 1):
    mod = sys.modules[f"gen{i}"]
    save, load = mod.SavePlanner, mod.LoadPlanner
    assert issubclass(save, DefaultSavePlanner) and issubclass(load, DefaultLoadPlanner)
    assert (save.__qualname__, save.__module__) == ("SavePlanner", f"gen{i}")
    assert mod.SavePlanner is save and mod._planners() == (save, load)
    assert load().spec is mod.SPEC and save(strict=False).spec is mod.SPEC
    try:
        mod.NoSuchName
    except AttributeError as e:
        assert "NoSuchName" in str(e)
    else:
        raise AssertionError("a missing attribute was found")
print("OK")
"""


def test_importing_a_generated_module_leaves_torch_distributed_to_its_first_call() -> None:
    """Issue 20.11: a module's import costs its tables. The runtime's torch.distributed parts
    (DTensor, FSDP2, DCP: most of a second, and 50 MB) load on the first call; the DCP
    planner classes are defined on first use, as subclasses of torch's, under their names."""
    files = [str(p) for p in _generated_files()]
    run = subprocess.run(
        [sys.executable, "-c", _LAZY_CHECK, *files], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "imported: []\n" in run.stdout and run.stdout.strip().endswith("OK")


def test_a_runtime_module_is_imported_on_first_use() -> None:
    from shardspec.runtime import RuntimeModule

    code = (
        "import sys\n"
        "from shardspec.runtime import RuntimeModule\n"
        "m = RuntimeModule('canonical')\n"
        "assert 'shardspec.runtime.canonical' not in sys.modules, 'imported early'\n"
        "from shardspec.runtime import canonical\n"
        "assert m.chunk_table is canonical.chunk_table\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert repr(RuntimeModule("parallel")) == "RuntimeModule('shardspec.runtime.parallel')"
    with pytest.raises(AttributeError):
        RuntimeModule("canonical").no_such_function  # noqa: B018


def test_repo_generated_files_are_fresh(in_repo: Path) -> None:
    specs = sorted(str(p.relative_to(REPO)) for p in (REPO / "specs").glob("*.shard"))
    assert specs
    outcome = compile_specs(specs, "generated", check_only=True)
    assert not outcome.errors, [str(d) for d in outcome.diagnostics]
    assert not outcome.stale, "\n".join(diff for _, diff in outcome.stale)


def test_generated_modules_import_only_torch_and_the_runtime(in_repo: Path) -> None:
    """README: a generated module imports torch and ``shardspec.runtime``, nothing else of
    shardspec (the compiler's packages need lark, jinja2 and pydantic)."""
    import ast

    files = sorted((in_repo / "generated").glob("*.py"))
    files += sorted((in_repo / "tests" / "cases").glob("*/expected.py"))
    assert len(files) > 10
    stdlib = {"__future__", "collections.abc", "typing", "importlib", "os", "sys"}
    for path in files:
        modules = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                modules.add(node.module or "")
            elif isinstance(node, ast.Import):
                modules.update(a.name for a in node.names)
        assert modules, path
        for m in modules:
            ok = m in stdlib or m == "torch" or m.startswith("torch.") or m == "shardspec.runtime"
            assert ok or m.startswith("shardspec.runtime."), f"{path}: imports {m}"


def test_a_module_generated_for_an_older_runtime_says_recompile(
    in_repo: Path, tmp_path: Path
) -> None:
    """A module rendered for an older runtime API (e.g. one passing ``virtual_counts=``,
    before API 3 named it ``name_indexed_counts=``) fails at import, before it calls
    anything, with a message that says what to do."""
    import importlib.util

    from shardspec import RUNTIME_API

    text = (in_repo / "generated" / "llama.py").read_text(encoding="utf-8")
    assert f"require(api={RUNTIME_API}," in text
    old = tmp_path / "old_llama.py"
    old.write_text(text.replace(f"require(api={RUNTIME_API},", "require(api=2,"), "utf-8")
    spec = importlib.util.spec_from_file_location("old_llama", old)
    assert spec is not None and spec.loader is not None
    with pytest.raises(ImportError) as e:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    message = str(e.value)
    assert "needs shardspec runtime API 2" in message and f"provides API {RUNTIME_API}" in message
    assert "recompile the spec with `shardspec compile`" in message
