"""parallelize and verify on a spec with views, trained with all-to-all token dispatch
(issue 21 points 3, 4, the training half of 5, and 6's training proofs).

Four gloo ranks, one spawn (tests/ep_train_scenarios.py): the example MoE and
transformers' Qwen3-MoE trained at expert ep 4 (dense fsdp 4) and at ep 2 x efsdp 2 with
dense tp 2 x fsdp 2 against a single process, routing skewed so that some experts get no
token; checkpoints saved at one fold, loaded at others and trained on; load_hf into a
parallelized folded model; verify of a trainer's own folded parallelization, accepted and
refused with each mismatch named; refusals that leave the model unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardspec.cli import main as shardspec_main
from shardspec.testing import run_ranks
from tests import ep_train_scenarios
from tests.ep_sp_specs import SP_EDITS
from tests.test_views_dist import _qwen3 as qwen3_checkpoint

WORLD = 4
REPO = Path(__file__).resolve().parents[1]


def compile_variants(gen: Path) -> None:
    """Lint-clean variants of the example MoE's specs: the single mesh with `style
    expert_parallel` (moe_one_mesh_ep, which parallelize refuses); the folded one with
    sequence-parallel norms (moe_folded_sp, where parallelize refuses a caller's style on
    the MoE block; tests/test_ep_sp.py trains expert parallelism under sequence
    parallelism), and the folded one with expert tensor
    parallelism (moe_folded_etp: expert view ep x etp x efsdp); the folded and the
    single-view spec of the example MoE with 4 kv heads (moe_folded_kv4, moe_kv4)."""
    gen.mkdir(parents=True)
    manifest = str(REPO / "specs" / "deepseek_moe.manifest.json")
    hf = str(REPO / "specs" / "deepseek_moe.hf.json")
    expert_rules = (
        "    shard expert over ep\n    style expert_parallel\n",
        "    shard expert over ep\n    shard ffn over etp\n    style expert_parallel\n",
    )
    variants: dict[str, tuple[str, list[tuple[str, str]]]] = {
        "moe_one_mesh_ep": (
            "deepseek_moe.shard",
            [("    style none\n", "    style expert_parallel\n")],
        ),
        # sequence parallel as lint requires (SS115): the embedding and attention's output
        # projection leave the residual stream cut by tokens (tests/ep_sp_specs.py's edits)
        "moe_folded_sp": ("deepseek_moe_folded.shard", list(SP_EDITS[1:5])),
        # expert tensor parallelism: each expert's ffn dimension over etp
        "moe_folded_etp": (
            "deepseek_moe_folded.shard",
            [("    ep: 2\n    efsdp: *\n", "    ep: 2\n    etp: 2\n    efsdp: *\n"), expert_rules],
        ),
        # ... and over etp the hidden dimension, which ExpertTensorParallel does not cut
        "moe_folded_etp_hidden": (
            "deepseek_moe_folded.shard",
            [
                ("    ep: 2\n    efsdp: *\n", "    ep: 2\n    etp: 2\n    efsdp: *\n"),
                (expert_rules[0], expert_rules[1].replace("ffn over", "hidden over")),
            ],
        ),
    }
    # the example MoE with 4 kv heads (its 2 cannot split over tp 4): the checkpoint
    # scenario's model, on the folded and the single-view spec, with its own manifest and
    # HF manifest (k and v projections of 4 heads)
    kv4 = str(gen / "moe_kv4.manifest.json")
    args = [f"--arg={k}={v}" for k, v in ep_train_scenarios.KV4_ARGS.items()]
    assert shardspec_main(["manifest", "examples.models.moe:tiny", *args, "-o", kv4]) == 0
    kv4_hf = str(gen / "moe_kv4.hf.json")
    doc = json.loads(Path(hf).read_text(encoding="utf-8"))
    kv_heads = ep_train_scenarios.KV4_ARGS["n_kv_heads"]
    doc["config"]["num_key_value_heads"] = kv_heads
    for key, entry in doc["tensors"].items():
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            entry["shape"][0] = kv_heads * doc["config"]["head_dim"]
    Path(kv4_hf).write_text(json.dumps(doc), encoding="utf-8")
    variants["moe_folded_kv4"] = ("deepseek_moe_folded.shard", [])
    variants["moe_kv4"] = ("deepseek_moe.shard", [])
    for name, (source, edits) in variants.items():
        text = (REPO / "specs" / source).read_text(encoding="utf-8")
        for old, new in edits:
            assert old in text, f"specs/{source} changed"
            text = text.replace(old, new)
        own = (kv4, kv4_hf) if name.endswith("_kv4") else (manifest, hf)
        text = text.replace('"deepseek_moe.manifest.json"', json.dumps(own[0]))
        text = text.replace('"deepseek_moe.hf.json"', json.dumps(own[1]))
        (gen / f"{name}.shard").write_text(text, encoding="utf-8")
        assert shardspec_main(["lint", str(gen / f"{name}.shard")]) == 0, name
        assert shardspec_main(["compile", str(gen / f"{name}.shard"), "-o", str(gen)]) == 0, name


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("ep_train")
    hf_dir = root / "qwen3"
    qwen3_checkpoint(hf_dir)
    compile_variants(root / "gen")
    return run_ranks(ep_train_scenarios.run_all, WORLD, str(root), str(hf_dir), timeout=600)


def _counts(results: list[dict[str, Any]], prefix: str) -> dict[str, int]:
    return {t: n for t, n in results[0]["count"].items() if t.startswith(prefix)}


pytestmark = pytest.mark.dist


def test_no_scenario_failed(results: list[dict[str, Any]]) -> None:
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fail"]]
    assert not fails, "\n".join(fails[:40])


def test_training_against_one_process(results: list[dict[str, Any]]) -> None:
    tags = _counts(results, "train ")
    # example MoE and Qwen3-MoE at two folds each, the example MoE with expert tensor
    # parallelism; per run: experts styled, a gradient and a parameter per tensor, STEPS
    # losses, the skew
    assert len(tags) == 5, tags
    assert all(n >= 2 * 20 + ep_train_scenarios.STEPS + 2 for n in tags.values()), tags


def test_checkpoints_move_between_folds_and_training_goes_on(
    results: list[dict[str, Any]],
) -> None:
    tags = _counts(results, "ckpt ")
    loads = {"ckpt at ep 4", "ckpt at the single view", "ckpt at tp 4"}
    assert set(tags) == {"ckpt fold a", *loads}, tags
    # loaded bitwise, losses, parameters: one of each per tensor at least
    assert all(tags[t] >= 2 * 30 for t in loads), tags


def test_load_hf_and_export_hf_on_a_parallelized_folded_model(
    results: list[dict[str, Any]],
) -> None:
    tags = _counts(results, "load_hf parallelized")
    assert len(tags) == 2 and all(n >= 25 for n in tags.values()), tags
    tags = _counts(results, "export_hf parallelized")
    assert len(tags) == 2 and all(n >= 25 for n in tags.values()), tags


def test_verify_accepts_a_trainers_own_fold_and_names_mismatches(
    results: list[dict[str, Any]],
) -> None:
    tags = _counts(results, "verify ")
    assert set(tags) == {
        "verify by hand",
        "verify experts on efsdp",
        "verify no dispatch",
        "verify dense fsdp on expert",
        "verify a style of its own",
    }, tags


def test_refusals_leave_the_model_unchanged(results: list[dict[str, Any]]) -> None:
    tags = _counts(results, "refuse ")
    assert len(tags) == 6 and all(n == 2 for n in tags.values()), tags
