"""``parallelize`` and ``verify`` on 4 gloo ranks (scenarios in tests/parallel_scenarios.py).

The llama spec is also compiled without its manifest (and hf block) by the real CLI, so
the same layout parallelizes a llama of dim 512, whose shapes the manifest does not list.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardspec.cli import main as shardspec_main
from shardspec.testing import run_ranks
from tests import parallel_scenarios

ROOT = Path(__file__).resolve().parent.parent

# Checks each scenario must make on every rank (a scenario that checks nothing fails):
# per training, a gradient and a parameter per tensor, a loss per step, the verify.
_STEPS = parallel_scenarios.STEPS
MIN_CHECKS = {
    "train llama": 2 * 15 + _STEPS + 1,
    "train llama dim 512": 2 * 15 + _STEPS + 1,
    "train qwen2": 2 * 27 + _STEPS + 1,
    "train qwen3": 2 * 25 + _STEPS + 1,
    "train moe": 2 * 30 + _STEPS + 1,
    "train llama sequence parallel": 2 * 15 + _STEPS + 1,
    "meta qwen2": 1,
    "options": 14,
    "reshard": 30,
    "handmade": 15 * 4 + 4,
    "strided compute": 1 + 1 + 2 * 2,
}
# The same for the refusals (each refusal checks the message and every parameter).
MIN_CHECKS_REFUSALS = {"errors": 6 * 16, "styles": 8 * 16 + 2, "custom": 2 * 16 + 2}


def _spec_without_manifest(text: str) -> str:
    """specs/llama.shard for the dim-512 llama (head_dim 128): no manifest or hf block,
    and the fused q/k/v groups at that head size."""
    text = re.sub(r'(?m)^manifest "[^"]*"\n', "", text)
    text = re.sub(r'(?ms)^hf "[^"]*" \{.*?^\}\n?', "", text)
    old = "fuse qkv as 2 groups of q 32, k 16, v 16"
    assert old in text
    return text.replace(old, "fuse qkv as 2 groups of q 256, k 128, v 128")


# torchtitan's sequence parallelism for specs/llama.shard, stated in style lines: norms
# sequence-parallel, activations between blocks sharded on the sequence dimension.
SP_EDITS = (
    (
        "    shard vocab over tp\n}\nparam output",
        "    shard vocab over tp\n    style rowwise output sequence\n}\nparam output",
    ),
    ("style colwise output replicate", "style colwise input sequence output replicate"),
    ("    shard qkv over tp\n", "    shard qkv over tp\n    style colwise input sequence\n"),
    ("    shard heads over tp\n", "    shard heads over tp\n    style rowwise output sequence\n"),
    (
        "    shard hidden over dp_shard\n",
        "    shard hidden over dp_shard\n    style colwise input sequence\n",
    ),
    (
        "[hidden, ffn] {\n    shard ffn over tp\n",
        "[hidden, ffn] {\n    shard ffn over tp\n    style rowwise output sequence\n",
    ),
    (
        "param **.*norm.weight [hidden] {}",
        "param **.*norm.weight [hidden] {\n    style sequence_parallel\n}",
    ),
)


def _sequence_parallel(text: str) -> str:
    manifest = ROOT / "specs" / "llama.manifest.json"
    text = text.replace('manifest "llama.manifest.json"', f'manifest "{manifest}"')
    text = re.sub(r'(?ms)^hf "[^"]*" \{.*?^\}\n?', "", text)
    for old, new in SP_EDITS:
        assert text.count(old) == 1, f"specs/llama.shard changed: {old!r}"
        text = text.replace(old, new)
    return text


def _vocab_parallel(text: str) -> str:
    """specs/llama.shard with `style none` on the token embedding: the model's own
    vocab-parallel embedding does the lookup."""
    manifest = ROOT / "specs" / "llama.manifest.json"
    text = text.replace('manifest "llama.manifest.json"', f'manifest "{manifest}"')
    text = re.sub(r'(?ms)^hf "[^"]*" \{.*?^\}\n?', "", text)
    old = "param tok_embeddings.weight [vocab, hidden] {\n    shard vocab over tp\n"
    assert text.count(old) == 1, "specs/llama.shard changed"
    return text.replace(old, old + "    style none\n")


def _checked(results: list, least: dict[str, int]) -> None:
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, counts) in enumerate(results):
        for tag, n in least.items():
            assert counts.get(tag, 0) >= n, f"rank {rank}: {tag} made {counts.get(tag)}"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, tuple]]:
    """One spawn of 4 gloo ranks for both scenario lists (parallel_scenarios.run_both):
    the refusals on llama_vocab (`style none` on the token embedding), then training,
    options, reshard and hand-made parallelization on llama_big (no manifest) and llama_sp
    (sequence parallel)."""
    tmp_path = tmp_path_factory.mktemp("parallel")
    source = (ROOT / "specs" / "llama.shard").read_text()
    for name, text in (
        ("llama_vocab", _vocab_parallel(source)),
        ("llama_big", _spec_without_manifest(source)),
        ("llama_sp", _sequence_parallel(source)),
    ):
        spec = tmp_path / f"{name}.shard"
        spec.write_text(text)
        assert shardspec_main(["compile", str(spec), "-o", str(tmp_path)]) == 0
    sp = (tmp_path / "llama_sp.py").read_text()
    assert sp.count('"input": "sequence"') == 3 and sp.count('"output": "sequence"') == 3
    run = parallel_scenarios.run_both
    return run_ranks(run, 4, "llama_big", "llama_vocab", str(tmp_path), timeout=300)


@pytest.mark.dist
def test_parallelize_refuses_before_changing_the_model(results: list[dict[str, tuple]]) -> None:
    """parallelize checks everything (the caller's styles, module classes, ties) before the
    model changes: a refusal leaves every parameter, module class and hook as it was."""
    _checked([r["refusals"] for r in results], MIN_CHECKS_REFUSALS)


@pytest.mark.dist
def test_parallelize_and_verify_on_4_ranks(results: list[dict[str, tuple]]) -> None:
    _checked([r["all"] for r in results], MIN_CHECKS)
