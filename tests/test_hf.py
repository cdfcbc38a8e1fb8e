"""Hugging Face load and export through the example specs' ``hf`` blocks, on 4 gloo ranks.

The checkpoints are written by ``transformers`` itself (tiny models built from config
objects, random weights, ``save_pretrained``): Llama with GQA, untied (sharded into
several files with an index) and tied (one file), and Qwen3-MoE with per-expert weights.
Each is loaded into the example models under several meshes, DTensor and Megatron style
(scenarios in ``hf_scenarios.py``), and checked bitwise against hand-written conversions
(:mod:`examples.models.hf`), against transformers' logits, and exported back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardspec.testing import run_ranks
from tests import hf_scenarios
from tests.hf_scenarios import Case

transformers = pytest.importorskip("transformers")

WORLD = 4
REPO = Path(__file__).resolve().parents[1]


def shardspec(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shardspec", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"shardspec {args[0]}: {done.stdout}{done.stderr}"


def compile_tied(gen: Path, hf_dir: Path) -> None:
    """specs/llama.shard for the tied Llama (no ``output.weight``: its rule and its map
    line go), with the model and HF manifests of that model, compiled with the real CLI
    to ``gen/llama_tied.py``."""
    text = (REPO / "specs" / "llama.shard").read_text(encoding="utf-8")
    for old, new in (
        ('manifest "llama.manifest.json"', 'manifest "llama_tied.manifest.json"'),
        ('hf "llama.hf.json"', 'hf "llama_tied.hf.json"'),
        (
            "param output.weight [vocab, hidden] {\n    shard vocab over tp\n"
            "    style colwise output replicate   # full logits for the loss (parallelize's "
            "all-gather)\n}\n",
            "",
        ),
        ("    lm_head.weight -> output.weight\n", ""),
    ):
        assert text.count(old) == 1, f"specs/llama.shard changed: {old!r} not found once"
        text = text.replace(old, new)
    gen.mkdir(parents=True, exist_ok=True)
    (gen / "llama_tied.shard").write_text(text, encoding="utf-8")
    shardspec(
        "manifest", "examples.models.llama:tiny_tied", "-o", str(gen / "llama_tied.manifest.json")
    )
    shardspec("hf-manifest", str(hf_dir), "-o", str(gen / "llama_tied.hf.json"))
    shardspec("lint", str(gen / "llama_tied.shard"))
    shardspec("compile", str(gen / "llama_tied.shard"), "-o", str(gen))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere (norms too), so every transform is visible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.ndim == 1 else 0.0))


def write_checkpoints(root: Path) -> None:
    from examples.models import hf as hfm

    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(hfm.llama_config(tied=False))
    _randomize(m, 1)
    m.save_pretrained(root / "llama", max_shard_size="100KB")  # several files and an index
    m = transformers.LlamaForCausalLM(hfm.llama_config(tied=True))
    _randomize(m, 2)
    m.save_pretrained(root / "llama_tied")  # one model.safetensors, no lm_head
    m = transformers.LlamaForCausalLM(hfm.llama_config(tied=False))
    _randomize(m, 4)
    m.to(torch.bfloat16).save_pretrained(root / "llama_bf16")  # cast into the fp32 model
    m = transformers.Qwen3MoeForCausalLM(hfm.qwen3_moe_config())
    _randomize(m, 3)
    m.save_pretrained(root / "qwen3", max_shard_size="100KB")
    write_transposed(root / "llama", root / "llama_t")


def write_transposed(src: Path, dst: Path) -> None:
    """The untied Llama with every ``mlp.down_proj.weight`` stored transposed ([ffn, dim],
    as Conv1D-style checkpoints store weights), for the ``transpose`` transform."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(f))
        for k in tensors:
            if k.endswith("mlp.down_proj.weight"):
                tensors[k] = tensors[k].t().contiguous()
        save_file(tensors, str(f), metadata={"format": "pt"})


def compile_transposed(gen: Path, hf_dir: Path) -> None:
    """specs/llama.shard reading that checkpoint: its down_proj line gains ``transpose``."""
    text = (REPO / "specs" / "llama.shard").read_text(encoding="utf-8")
    line = "model.layers.{i}.mlp.down_proj.weight -> layers.{i}.feed_forward.w2.weight"
    for old, new in (
        ('hf "llama.hf.json"', 'hf "llama_t.hf.json"'),
        ('manifest "llama.manifest.json"', 'manifest "llama_t.manifest.json"'),
        (line + "\n", line + " transpose\n"),
    ):
        assert text.count(old) == 1, f"specs/llama.shard changed: {old!r} not found once"
        text = text.replace(old, new)
    gen.mkdir(parents=True, exist_ok=True)
    (gen / "llama_t.shard").write_text(text, encoding="utf-8")
    shutil.copy(REPO / "specs" / "llama.manifest.json", gen / "llama_t.manifest.json")
    shardspec("hf-manifest", str(hf_dir), "-o", str(gen / "llama_t.hf.json"))
    shardspec("lint", str(gen / "llama_t.shard"))
    shardspec("compile", str(gen / "llama_t.shard"), "-o", str(gen))


def write_bad(root: Path) -> list[tuple[str, str, str]]:
    """Broken copies of the untied Llama checkpoint: (folder, what, a needle the error names)."""
    src = root / "llama"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    bad = []

    def copy(name: str) -> Path:
        dst = root / name
        shutil.copytree(src, dst)
        return dst

    def edit(dst: Path, fn) -> None:
        data = json.loads((dst / "model.safetensors.index.json").read_text())
        fn(data["weight_map"])
        (dst / "model.safetensors.index.json").write_text(json.dumps(data))

    dst = copy("missing_key")
    edit(dst, lambda wm: wm.pop("model.layers.1.mlp.up_proj.weight"))
    bad.append(("missing_key", "a missing HF key", "model.layers.1.mlp.up_proj.weight"))

    dst = copy("unexpected_key")
    edit(dst, lambda wm: wm.__setitem__("model.layers.9.mlp.up_proj.weight", files[0]))
    bad.append(("unexpected_key", "an unexpected HF key", "model.layers.9.mlp.up_proj.weight"))

    dst = copy("traversal")
    edit(dst, lambda wm: wm.__setitem__("model.norm.weight", "../llama/" + files[0]))
    bad.append(("traversal", "a weight_map path outside the folder", "model.norm.weight"))

    dst = copy("missing_file")
    edit(dst, lambda wm: wm.__setitem__("model.norm.weight", "model-99999.safetensors"))
    bad.append(("missing_file", "a weight_map file that does not exist", "model-99999"))

    dst = copy("truncated")
    last = dst / files[-1]
    os.truncate(last, last.stat().st_size - 64)
    bad.append(("truncated", "a truncated safetensors file", files[-1]))

    # A shape that disagrees with the config: a checkpoint of a wider FFN.
    from examples.models import hf as hfm
    from examples.models import llama

    m = transformers.LlamaForCausalLM(hfm.llama_config(llama.LlamaConfig(ffn_dim=128)))
    m.save_pretrained(root / "wrong_shape")
    bad.append(("wrong_shape", "a shape that disagrees with the model", "gate_proj.weight"))

    (root / "empty").mkdir()
    bad.append(("empty", "a folder without safetensors", "model.safetensors"))
    return bad


CASES = [
    Case("generated.llama", (("tp", 2),), "llama", "llama"),
    Case("generated.llama", (("tp", 1),), "llama", "llama"),
    Case("llama_tied", (("tp", 2),), "llama_tied", "llama_tied"),
    Case("generated.llama", (("tp", 1),), "llama", "llama_tied"),  # a tied checkpoint, untied model
    Case("generated.llama", (("tp", 2),), "llama", "llama_bf16"),  # bf16 files, fp32 model
    Case("llama_t", (("tp", 2),), "llama", "llama_t"),  # down_proj stored transposed
    Case("generated.llama_local", (("tp", 2),), "llama_local", "llama"),
    Case("generated.deepseek_moe", (("ep", 2),), "moe", "qwen3"),
    Case("generated.deepseek_moe", (("ep", 4),), "moe", "qwen3"),
    Case("generated.deepseek_moe", (("ep", 1),), "moe", "qwen3"),
    Case("generated.deepseek_moe_local", (("ep", 2),), "moe_local", "qwen3"),
]


# 3 ranks: FSDP chunks that cut through RoPE heads, even through a rotation pair (k's
# head of 16 rows as 11 + 5, q's last head as 6 + 10), and uneven experts and vocabulary
# (8 experts as 3 + 3 + 2; 256 rows as 86 + 86 + 84): torchtitan's RoPE permute failed on
# such uneven DTensors.
CASES3 = [
    Case("generated.llama", (("tp", 1),), "llama", "llama"),
    Case("generated.deepseek_moe", (("ep", 1),), "moe", "qwen3"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    write_checkpoints(root)
    compile_tied(root / "gen", root / "llama_tied")
    compile_transposed(root / "gen", root / "llama_t")
    bad = write_bad(root)
    per_rank = run_ranks(hf_scenarios.run_all, WORLD, str(root), CASES, bad, timeout=600)
    return {"ranks": per_rank, "root": str(root)}


@pytest.fixture(scope="module")
def results3(results: dict) -> dict:
    """The same checkpoints on 3 ranks (after ``results``, which writes them)."""
    root = results["root"]
    return {"ranks": run_ranks(hf_scenarios.run_all, 3, root, CASES3, [], timeout=600)}


@pytest.mark.parametrize("case", CASES3, ids=lambda c: c.label)
def test_uneven_chunks_through_heads_and_experts(results3: dict, case: Case) -> None:
    test_load_and_export(results3, case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_load_and_export(results: dict, case: Case) -> None:
    fails = [f for r in results["ranks"] for f in r[case.label].fail]
    assert not fails, "\n".join(fails)
    checked = [r[case.label].checked for r in results["ranks"]]
    assert all(n > 0 for n in checked), checked
    rank0 = results["ranks"][0][case.label].extra
    if case.logits:
        assert rank0["logits after load"] <= 1e-5
    # Export spreads the writing: several ranks write, none writes (gathers) everything.
    written = [r[case.label].extra["written"] for r in results["ranks"]]
    assert sum(1 for w in written if w) >= 2 and max(written) < sum(written), written


def test_the_collective_counters_see_communication(results: dict) -> None:
    fails = [f for r in results["ranks"] for f in r["counters"].fail]
    assert not fails, "\n".join(fails)
    assert all(r["counters"].checked == 2 for r in results["ranks"])


def test_export_writes_a_tie_alias_only_when_untied(results: dict) -> None:
    fails = [f for r in results["ranks"] for f in r["export ties"].fail]
    assert not fails, "\n".join(fails)
    assert all(r["export ties"].checked == 5 for r in results["ranks"])


def test_failed_exports_raise_on_every_rank_and_leave_nothing(results: dict) -> None:
    fails = [f for r in results["ranks"] for f in r["export faults"].fail]
    assert not fails, "\n".join(fails)
    assert all(r["export faults"].checked == 2 for r in results["ranks"])


def test_bad_input_is_refused_before_the_model_changes(results: dict) -> None:
    fails = [f for r in results["ranks"] for f in r["bad input"].fail]
    assert not fails, "\n".join(fails)
    assert all(r["bad input"].checked == 7 for r in results["ranks"])
