"""Persistent buffers in pipeline stages: transformers' own DeepseekV3ForCausalLM (4 layers,
from a tiny config, used as it is), whose routers in layers 1-3 hold the persistent buffer
``mlp.gate.e_score_correction_bias``, an HF key as well.

The spec is ``specs/deepseek_v3.shard`` with a ``pipeline`` block (``split model.layers.
{layer} local``: transformers' layers are a ModuleList, so stage models number theirs from
0), no ``ep`` axis, and its hf block as it is: the buffer's map line and its rule (a
second module drops the rule: the buffer is placed by default). Both lint clean and
compile; before buffers were stage units, lint refused the rule (SS041) and the map line
(SS073, SS078).

On 4 gloo ranks (pp x dp_shard), each rank's ``split_stage`` model holds exactly its
stage's buffers; ``load_hf`` fills every parameter and buffer with transformers' own
(``from_pretrained`` in one process, the owner), bitwise, reading only the stage's own;
the stages' ``export_hf`` writes the original checkpoint back bitwise (every key, the
buffers included) and ``from_pretrained`` of it gives the original's logits. A DCP
checkpoint saved at pp 2 stores the buffers under their global names and loads at pp 1
(the whole model on every rank) and pp 4 (one layer per stage), bitwise the owner's.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from shardspec.cli import main as shardspec_main
from shardspec.testing import run_ranks
from tests import pipeline_buffer_scenarios as scenarios
from tests.pipeline_buffer_scenarios import BUFFER, HF, N_LAYERS, StageCase
from tests.test_hf_buffers import write_checkpoint

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
RULE = "param model.layers.*.mlp.gate.e_score_correction_bias [experts] replicate\n"
PIPELINE = """
pipeline pp {
    first model.embed_tokens
    split model.layers.{layer} local
    last model.norm, lm_head
}
"""


def shardspec(*args: str) -> str:
    """Run the CLI in-process; fail with its output unless it succeeds."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = shardspec_main(list(args))
    said = out.getvalue() + err.getvalue()
    assert code == 0, said
    return said


def pipeline_spec() -> str:
    """specs/deepseek_v3.shard on pp x dp_shard (no ep), with a pipeline block."""
    text = (REPO / "specs" / "deepseek_v3.shard").read_text(encoding="utf-8")
    replace = [
        ('manifest "deepseek_v3.manifest.json"', 'manifest "dsv3_4.manifest.json"'),
        ('hf "deepseek_v3.hf.json"', 'hf "dsv3_4.hf.json"'),
        (
            "mesh over 4 ranks {\n    dp_shard: *\n    ep: 2\n}",
            "mesh over 4 ranks {\n    pp: 2\n    dp_shard: *\n}",
        ),
        ("    shard experts over ep\n", ""),
    ]
    for old, new in replace:
        assert old in text, f"specs/deepseek_v3.shard changed: {old!r}"
        text = text.replace(old, new)
    assert RULE in text, "specs/deepseek_v3.shard changed: the buffer's rule"
    assert "model.layers.{i}.mlp.gate.e_score_correction_bias ->" in text
    return text + PIPELINE


def compile_specs(gen: Path, hf_dir: Path) -> dict[str, str]:
    """``dsv3_pp`` (the spec) and ``dsv3_pp_default`` (without the buffer's rule), linted
    and compiled by the CLI; returns what lint said of each."""
    gen.mkdir(parents=True)
    shardspec(
        "manifest",
        "examples.models.hf:deepseek_v3_tiny",
        "--arg",
        f"num_hidden_layers={N_LAYERS}",
        "-o",
        str(gen / "dsv3_4.manifest.json"),
    )
    shardspec("hf-manifest", str(hf_dir), "-o", str(gen / "dsv3_4.hf.json"))
    text = pipeline_spec()
    said = {}
    for name, spec in (("dsv3_pp", text), ("dsv3_pp_default", text.replace(RULE, ""))):
        (gen / f"{name}.shard").write_text(spec, encoding="utf-8")
        said[name] = shardspec("lint", str(gen / f"{name}.shard"))
        shardspec("compile", str(gen / f"{name}.shard"), "-o", str(gen))
    return said


CASES = [
    StageCase("dsv3_pp", pp=2, hf=True, save_as="ckpt-pp2"),
    StageCase("dsv3_pp", pp=1, load_from="ckpt-pp2"),
    StageCase("dsv3_pp", pp=4, load_from="ckpt-pp2"),
    StageCase("dsv3_pp_default", pp=4, hf=True),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("pipeline_buffers")
    write_checkpoint(root / HF, num_hidden_layers=N_LAYERS)
    lint = compile_specs(root / "gen", root / HF)
    ranks = run_ranks(scenarios.run_all, 4, str(root), CASES, timeout=600)
    return {"root": root, "lint": lint, "ranks": ranks}


@pytest.mark.dist
def test_both_specs_lint_clean(results: dict) -> None:
    for name, said in results["lint"].items():
        assert said.strip() == "shardspec lint: 1 spec(s) checked, no findings", (name, said)


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_stage_models_hold_the_owners_state(results: dict, case: StageCase) -> None:
    items = [r[case.label] for r in results["ranks"]]
    fails = [f for item in items for f in item.fail]
    assert not fails, "\n".join(fails[:20])
    # Every rank compared its whole stage model (load and export on rank 0 compared more).
    assert all(item.checked >= 10 for item in items), [item.checked for item in items]
    # Each stage holds its layers' buffers: together all three, each once per stage.
    held: dict[int, list[str]] = {}
    for item in items:
        for stage, names in item.extra["buffers"].items():
            assert held.setdefault(stage, names) == names
    assert len(held) == case.pp
    every = sorted(b for names in held.values() for b in names)
    assert every == [BUFFER.format(i) for i in range(1, N_LAYERS)], held
    if case.pp == 4:  # one layer a stage: stage 0 holds the dense layer 0, no buffer
        assert held == {0: [], **{i: [BUFFER.format(i)] for i in range(1, N_LAYERS)}}


@pytest.mark.dist
@pytest.mark.parametrize("case", [c for c in CASES if c.hf], ids=lambda c: c.label)
def test_the_stages_export_the_checkpoint_back(results: dict, case: StageCase) -> None:
    rank0 = results["ranks"][0][case.label]
    assert rank0.extra.get("logits equal") is True
    written = [r[case.label].extra["written"] for r in results["ranks"]]
    assert sum(1 for w in written if w) >= 2, written  # the stages write their own parts
