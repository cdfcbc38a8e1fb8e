"""``shardspec diff OLD NEW``: a spec change by its effect (README, "Commands").

Pairs of specs made from specs/llama.shard (4 ranks) by one edit each, run through the
command line: the exit status (0 no change, 1 changed but checkpoints load, 2 a
checkpoint-incompatible change, 3 errors), the text a reviewer reads, and the JSON a tool
reads. One multi-rank test saves a checkpoint under OLD and loads it under NEW on 4 gloo
ranks, and checks that the verdict says what happens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardspec.cli import main
from shardspec.diff.render import FORMAT, JSON_KEYS

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"


def _absolute(text: str) -> str:
    """A spec's text with the files it names made absolute (it is written elsewhere)."""
    for name in ("llama.manifest.json", "llama.hf.json"):
        text = text.replace(f'"{name}"', f'"{SPECS / name}"')
    return text


BASE = _absolute((SPECS / "llama.shard").read_text(encoding="utf-8")).replace(
    "mesh over 8 ranks", "mesh over 4 ranks"
)
NO_HF = BASE[: BASE.index("# How Hugging Face")]


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


def _drop_rule(text: str, pattern: str) -> str:
    i = text.index(f"param {pattern} ")
    return text[:i] + text[text.index("}\n", i) + 2 :]


TP1 = _edit(BASE, "tp: 2", "tp: 1")
EMBED_REPLICATED = _edit(
    BASE,
    "param tok_embeddings.weight [vocab, hidden] {\n    shard vocab over tp\n}",
    "param tok_embeddings.weight [vocab, hidden] {\n    replicate tp\n}",
)
FUSED, UNFUSED = NO_HF, _edit(NO_HF, "    fuse ffn as gate, up\n", "")
RENAMED = _edit(NO_HF, "fuse ffn as gate, up", "fuse ffn as w1, w3")
NO_ROPE_K = _edit(
    BASE,
    "k_proj.weight -> layers.{i}.attention.wqkv.weight.k rope 16",
    "k_proj.weight -> layers.{i}.attention.wqkv.weight.k",
)
IGNORE_OUTPUT = _drop_rule(
    _edit(
        _edit(
            _edit(BASE, "fsdp dp_shard\n", "fsdp dp_shard\nignore output.weight\n"),
            "    lm_head.weight -> output.weight\n",
            "",
        ),
        "tie lm_head.weight = model.embed_tokens.weight",
        "drop lm_head.weight",
    ),
    "output.weight",
)


def run(tmp_path: Path, old: str, new: str, *args: str, capsys) -> tuple[int, str, str]:
    """``shardspec diff old.shard new.shard ARGS``: exit status, stdout, stderr."""
    (tmp_path / "old.shard").write_text(old, encoding="utf-8")
    (tmp_path / "new.shard").write_text(new, encoding="utf-8")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        status = main(["diff", "old.shard", "new.shard", *args])
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    return status, out, err


def run_json(tmp_path: Path, old: str, new: str, capsys, *args: str) -> tuple[int, dict]:
    status, out, _ = run(tmp_path, old, new, "--format", "json", *args, capsys=capsys)
    return status, json.loads(out)


# ----------------------------------------------------------------------------- verdicts


def test_identical_specs_are_no_change(tmp_path, capsys):
    status, out, err = run(tmp_path, BASE, BASE, capsys=capsys)
    assert status == 0, err
    assert "layout: no change (15 parameter(s))" in out
    assert "checkpoints saved under OLD load under NEW" in out
    assert "verdict (exit 0): no change" in out


def test_comments_and_spacing_are_no_change(tmp_path, capsys):
    reformatted = BASE.replace("    shard vocab over tp\n", "  shard   vocab over tp   # cut\n")
    status, out, _ = run(tmp_path, BASE, "# a comment\n" + reformatted, capsys=capsys)
    assert status == 0, out


def test_tp_degree_change_is_a_compatible_layout_change(tmp_path, capsys):
    status, out, _ = run(tmp_path, BASE, TP1, capsys=capsys)
    assert status == 1
    assert "  axis dp_shard: 2 -> 4\n  axis tp: 2 -> 1\n" in out
    # per axis, the placement before and after, and the shard of a representative rank
    assert "    tp:           Shard(1) -> Replicate()\n" in out
    assert "local shape:  [32, 48] on rank 0 -> [16, 96] on rank 0" in out  # w2 [64, 96]
    assert "checkpoints saved under OLD load under NEW" in out


def test_rule_moving_a_parameter_from_tp_to_replicate(tmp_path, capsys):
    status, out, _ = run(tmp_path, BASE, EMBED_REPLICATED, capsys=capsys)
    assert status == 1
    assert "layout: 1 parameter(s) change in 1 group(s); 14 unchanged" in out
    group = out[out.index("  tok_embeddings.weight\n") :]
    assert "    dp_shard:     _StridedShard(0, sf=2) -> Shard(0)\n" in group
    assert "    tp:           Shard(0) -> Replicate()\n" in group
    assert "    local shape:  [64, 64] on rank 0 -> [128, 64] on rank 0\n" in group
    assert "    style:        rowwise (derived) -> none\n" in group


def test_fuse_rename_changes_checkpoint_keys(tmp_path, capsys):
    status, out, _ = run(tmp_path, FUSED, RENAMED, capsys=capsys)
    assert status == 2
    assert "a checkpoint saved under OLD does NOT load under NEW" in out
    assert "missing: layers.*.feed_forward.w13.weight.w1 (2 keys)" in out
    assert "unexpected: layers.*.feed_forward.w13.weight.gate (2 keys)" in out
    assert "stored as .gate, .up under OLD and as .w1, .w3 under NEW" in out
    assert "verdict (exit 2): checkpoint-incompatible" in out


def test_unfusing_is_incompatible_and_fusing_reads_the_whole_tensor(tmp_path, capsys):
    """load reads a fused parameter's components from a tensor stored whole (its
    fallback), not the other way round."""
    status, out, _ = run(tmp_path, FUSED, UNFUSED, capsys=capsys)
    assert status == 2
    assert "missing: layers.*.feed_forward.w13.weight (2 keys)" in out
    status, out, _ = run(tmp_path, UNFUSED, FUSED, capsys=capsys)
    assert status == 1, out
    assert "NEW reads these components from the whole tensor OLD stored:" in out
    assert "    layers.*.feed_forward.w13.weight.gate (2 keys)\n" in out


def test_ignored_parameters(tmp_path, capsys):
    """A parameter OLD ignores is not in its checkpoints: NEW placing it cannot load
    them. One NEW ignores is left unread: load allows that."""
    status, out, _ = run(tmp_path, IGNORE_OUTPUT, BASE, capsys=capsys)
    assert status == 2
    assert "    state:        ignored (ignore output.weight) -> placed\n" in out
    assert "missing: output.weight\n      why: OLD ignores its parameter" in out
    status, out, _ = run(tmp_path, BASE, IGNORE_OUTPUT, capsys=capsys)
    assert status == 1, out


def test_hf_map_change(tmp_path, capsys):
    status, out, _ = run(tmp_path, BASE, NO_ROPE_K, capsys=capsys)
    assert status == 1  # the same HF keys, read with another transform
    assert "layout: no change" in out
    assert (
        "  - model.layers.{i}.self_attn.k_proj.weight -> layers.{i}.attention.wqkv.weight.k rope 16"
        in out
    )
    assert (
        "  + model.layers.{i}.self_attn.k_proj.weight -> layers.{i}.attention.wqkv.weight.k\n"
        in out
    )
    assert "    OLD reads:    model.layers.*.self_attn.k_proj.weight [32, 64] rope 16\n" in out
    assert "    NEW reads:    model.layers.*.self_attn.k_proj.weight [32, 64]\n" in out
    assert "HF checkpoints that load under OLD load under NEW" in out


def test_hf_key_that_old_never_read_is_incompatible(tmp_path, capsys):
    """Without an HF manifest, an HF checkpoint that loads under OLD has the keys OLD
    reads: a key only NEW reads may be missing from it."""
    old = _edit(BASE, f'hf "{SPECS / "llama.hf.json"}" {{', "hf {")
    new = _edit(old, "mlp.down_proj.weight", "mlp.down.weight")
    status, out, _ = run(tmp_path, old, new, capsys=capsys)
    assert status == 2
    assert (
        "  HF keys only NEW reads (and export_hf writes):\n"
        "    model.layers.*.mlp.down.weight (2 keys)\n" in out
    )
    assert "an HF checkpoint that loads under OLD does NOT load under NEW" in out
    assert "missing: model.layers.*.mlp.down.weight (2 keys)" in out


def test_parameters_with_the_same_change_are_grouped(tmp_path, capsys):
    _, out, _ = run(tmp_path, BASE, TP1, capsys=capsys)
    assert "layout: 15 parameter(s) change in 5 group(s); 0 unchanged" in out
    # parameters whose change reads the same print once, whatever else differs
    assert (
        "  layers.*.attention.wqkv.weight (2 params)\n"
        "  output.weight\n"
        "  tok_embeddings.weight\n"
        "    mesh:         dp_shard=2, tp=2 -> dp_shard=4, tp=1\n"
        "    dp_shard:     _StridedShard(0, sf=2) -> Shard(0)\n"
        "    tp:           Shard(0) -> Replicate()\n\n"
    ) in out
    # the three norms change alike: one group, its globs one per line with counts
    assert (
        "  layers.*.attention_norm.weight (2 params)\n"
        "  layers.*.ffn_norm.weight (2 params)\n"
        "  norm.weight\n" in out
    )
    assert out.count("layers.*.attention.wo.weight (2 params)") == 1
    # JSON groups parameters whose layouts are the same before and after
    _, doc = run_json(tmp_path, BASE, TP1, capsys)
    groups = doc["params"]["changed"]
    assert len(groups) == 7
    assert sum(g["count"] for g in groups) == 15
    norms = next(g for g in groups if g["params"][-1]["glob"] == "norm.weight")
    assert norms["params"] == [
        {"glob": "layers.*.attention_norm.weight", "count": 2},
        {"glob": "layers.*.ffn_norm.weight", "count": 2},
        {"glob": "norm.weight", "count": 1},
    ]
    assert norms["count"] == 5


# ----------------------------------------------------------------------------- JSON

SIDE_KEYS = [
    "state",
    "note",
    "mesh",
    "dims",
    "placements",
    "dtensor",
    "rank",
    "local_shape",
    "shapes",
    "stage",
    "style",
]


def test_json_output_has_stable_keys(tmp_path, capsys):
    status, doc = run_json(tmp_path, FUSED, RENAMED, capsys)
    assert status == 2
    assert tuple(doc) == JSON_KEYS
    assert doc["format"] == FORMAT == "shardspec-diff/1"
    assert (doc["status"], doc["verdict"]) == (2, "incompatible")
    assert list(doc["params"]) == ["changed", "unchanged"]
    change = doc["params"]["changed"][0]
    assert list(change) == ["params", "count", "old", "new", "axes"]
    assert list(change["old"]) == SIDE_KEYS == list(change["new"])
    assert list(doc["checkpoint"]) == ["compatible", "problems", "fallbacks", "keys"]
    assert doc["checkpoint"]["compatible"] is False
    problem = doc["checkpoint"]["problems"][0]
    assert list(problem) == ["kind", "keys", "count", "why"]
    assert {p["kind"] for p in doc["checkpoint"]["problems"]} == {"missing", "unexpected"}
    assert doc["hf"] is None  # neither spec has an hf block

    status, doc = run_json(tmp_path, BASE, TP1, capsys)
    assert status == 1 and doc["verdict"] == "changed"
    assert doc["mesh"][0] == {"subject": "axis dp_shard", "old": "2", "new": "4"}
    assert list(doc["hf"]) == [
        "removed_lines",
        "added_lines",
        "units",
        "keys_only_old",
        "keys_only_new",
        "compatible",
        "problems",
    ]
    wo = next(g for g in doc["params"]["changed"] if "wo" in g["params"][0]["glob"])
    assert wo["axes"] == [{"axis": "tp", "old": "Shard(1)", "new": "Replicate()"}]
    assert wo["old"]["shapes"] == [{"shape": [32, 32], "ranks": 4}]


def test_json_identical(tmp_path, capsys):
    status, doc = run_json(tmp_path, BASE, BASE, capsys)
    assert (status, doc["status"], doc["verdict"]) == (0, 0, "same")
    assert doc["params"] == {"changed": [], "unchanged": 15}


# ----------------------------------------------------------------------------- errors


def test_syntax_error_in_new_is_located_without_traceback(tmp_path, capsys):
    broken = _edit(BASE, "    shard vocab over tp\n}", "    shard vocab ovr tp\n}")
    status, out, err = run(tmp_path, BASE, broken, capsys=capsys)
    assert status == 3
    assert out == ""
    line = broken.splitlines().index("    shard vocab ovr tp") + 1
    assert f"new.shard:{line}:" in err and "error SS0" in err
    assert "^" in err and "Traceback" not in err + out


def test_errors_in_json_are_lint_diagnostics(tmp_path, capsys):
    status, out, _ = run(
        tmp_path, BASE, _edit(BASE, "tp: 2", "tp: 3"), "--format", "json", capsys=capsys
    )
    assert status == 3
    diags = json.loads(out)
    assert diags and all(d["severity"] == "error" for d in diags)
    assert all(d["file"] == "new.shard" for d in diags if d["file"].endswith(".shard"))


def test_spec_without_manifest_and_manifest_override(tmp_path, capsys):
    line = f'manifest "{SPECS / "llama.manifest.json"}"\n'
    bare = _edit(NO_HF, line, "")
    status, _, err = run(tmp_path, bare, bare, capsys=capsys)
    assert status == 3 and "SS004" in err and "diff needs a manifest" in err
    # -m gives both specs the manifest
    status, out, err = run(
        tmp_path,
        bare,
        _edit(bare, "tp: 2", "tp: 1"),
        "-m",
        str(SPECS / "llama.manifest.json"),
        capsys=capsys,
    )
    assert status == 1, err
    assert "layout: 15 parameter(s) change" in out
    status, _, err = run(tmp_path, bare, bare, "-m", "missing.json", capsys=capsys)
    assert status == 3 and "SS002" in err and "Traceback" not in err


def test_defines_apply_to_both_specs(tmp_path, capsys):
    status, out, _ = run(tmp_path, BASE, TP1, "-D", "tp=1", capsys=capsys)
    assert status == 0, out
    status, _, err = run(tmp_path, BASE, TP1, "-D", "pp=2", capsys=capsys)
    assert status == 3 and "SS004" in err


def test_bad_command_line_is_an_error_not_a_verdict(tmp_path, capsys):
    assert main(["diff", "only-one.shard"]) == 3
    assert main(["diff", "a.shard", "b.shard", "--format", "xml"]) == 3
    capsys.readouterr()


# ----------------------------------------------------------------------------- fuzz

EXAMPLES = sorted(p for p in SPECS.glob("*.shard"))


def _example(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    for name in {p.name for p in SPECS.glob("*.json")}:
        text = text.replace(f'"{name}"', f'"{SPECS / name}"')
    return text


NUMBER = st.sampled_from(["1", "2", "3", "4", "8", "16", "0", "*"])


@st.composite
def _pair(draw) -> tuple[str, str]:
    """Two specs: mostly one example spec edited twice (each edit may be none), else two
    example specs, each edited."""
    base = _example(draw(st.sampled_from(EXAMPLES)))
    other = base if draw(st.booleans()) else _example(draw(st.sampled_from(EXAMPLES)))
    return draw(_perturbed(base)), draw(_perturbed(other))


@st.composite
def _perturbed(draw, text: str) -> str:
    """``text`` with a few edits: a number changed, a line dropped or repeated, a word
    swapped for another of the spec's, a character deleted."""
    for _ in range(draw(st.integers(0, 3))):
        lines = text.splitlines(keepends=True)
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        kind = draw(st.sampled_from(["number", "drop", "repeat", "word", "char"]))
        line = lines[i] if lines else ""
        if kind == "number":
            digits = [j for j, ch in enumerate(line) if ch.isdigit()]
            if digits:
                j = draw(st.sampled_from(digits))
                line = line[:j] + draw(NUMBER) + line[j + 1 :]
        elif kind == "drop":
            line = ""
        elif kind == "repeat":
            line = line * 2
        elif kind == "word":
            words = text.split()
            if words and line.split():
                line = line.replace(
                    draw(st.sampled_from(line.split())), draw(st.sampled_from(words)), 1
                )
        elif line:
            j = draw(st.integers(0, len(line) - 1))
            line = line[:j] + line[j + 1 :]
        lines[i : i + 1] = [line] if lines else []
        text = "".join(lines)
    return text


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(pair=_pair(), fmt=st.sampled_from(["text", "json"]))
def test_fuzz_pairs_of_example_specs_never_traceback(tmp_path, capsys, pair, fmt):
    status, out, err = run(tmp_path, *pair, "--format", fmt, capsys=capsys)
    assert status in (0, 1, 2, 3)
    assert "Traceback" not in out + err
    if fmt == "json" and out:
        json.loads(out)
    if status != 3:
        assert f"verdict (exit {status})" in out or json.loads(out)["status"] == status


# ----------------------------------------------------------------------------- multi-rank

# name, OLD, NEW, the verdict diff gives
PAIRS = [
    ("tp2-to-tp1", FUSED, _edit(FUSED, "tp: 2", "tp: 1"), 1),
    ("unfused-to-fused", UNFUSED, FUSED, 1),
    ("components-renamed", FUSED, RENAMED, 2),
    ("fused-to-unfused", FUSED, UNFUSED, 2),
]


@pytest.mark.dist
def test_verdict_matches_a_real_save_and_load_on_4_ranks(tmp_path, capsys):
    """Save under OLD and load under NEW on 4 gloo ranks (one spawn): a pair diff calls
    compatible loads every parameter bitwise; an incompatible one is refused by load,
    the model unchanged."""
    from shardspec.api import render_specs
    from shardspec.testing import run_ranks
    from tests.diff_scenarios import save_then_load

    pairs = []
    for name, old, new, verdict in PAIRS:
        folder = tmp_path / name
        folder.mkdir()
        assert run(folder, old, new, capsys=capsys)[0] == verdict, name
        files = []
        for side in ("old", "new"):
            spec = folder / f"{side}.shard"
            outcome, rendered = render_specs([str(spec)], str(folder / "gen"))
            assert not outcome.errors and len(rendered) == 1
            target = folder / f"{name.replace('-', '_')}_{side}.py"
            target.write_text(rendered[0][1], encoding="utf-8")
            files.append(str(target))
        pairs.append((name, *files))
    (tmp_path / "ckpt").mkdir()
    results = run_ranks(save_then_load, 4, pairs, str(tmp_path / "ckpt"))
    for rank, found in enumerate(results):
        for name, _old, _new, verdict in PAIRS:
            outcome, wrong, error = found[name]
            assert outcome == ("loaded" if verdict == 1 else "refused"), (rank, name, error)
            assert wrong == [], (rank, name, wrong)
            if verdict == 2:
                assert "missing: " in error and "unexpected: " in error, error


def test_one_spec_twice_reports_each_error_once(tmp_path, capsys):
    broken = _edit(BASE, "tp: 2", "tp: 3")
    (tmp_path / "a.shard").write_text(broken, encoding="utf-8")
    status = main(["diff", str(tmp_path / "a.shard"), str(tmp_path / "a.shard")])
    err = capsys.readouterr().err
    assert status == 3
    messages = [line for line in err.splitlines() if ": error SS" in line]
    assert messages and len(messages) == len(set(messages))


def test_dtype_and_global_shape_changes_are_incompatible(tmp_path, capsys):
    """A model whose manifest changes a parameter's dtype or shape: the checkpoint's
    tensors no longer fit (load refuses a dtype or global shape mismatch)."""
    manifest = json.loads((SPECS / "llama.manifest.json").read_text(encoding="utf-8"))
    for entry in manifest["entries"]:
        if entry["fqn"] == "norm.weight":
            entry["dtype"] = "bfloat16"
        if entry["fqn"] == "output.weight":
            entry["shape"] = [512, 64]
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(manifest), encoding="utf-8")
    new = _edit(NO_HF, str(SPECS / "llama.manifest.json"), str(changed))
    status, out, _ = run(tmp_path, NO_HF, new, capsys=capsys)
    assert status == 2
    assert "    dtype: norm.weight\n      why: dtype float32 under OLD, bfloat16 under NEW\n" in out
    assert "    shape: output.weight\n      why: global shape [256, 64] under OLD, [512, 64]" in out
