"""Persistent buffers that are Hugging Face keys: transformers' own DeepseekV3ForCausalLM,
built from a tiny config and used as it is, whose router holds the persistent buffer
``mlp.gate.e_score_correction_bias``, which its checkpoint stores too.

``specs/deepseek_v3.shard`` maps the buffer like a parameter (its rule: whole on every
rank); a variant without that rule gets the same placement by default. On 1 rank and on 4
gloo ranks (dp_shard 2 x ep 2): ``load_hf`` equals transformers' own state dict (weights
*and* buffers) bitwise, ``export_hf`` writes every key of the original (41 of 41) bitwise,
and ``from_pretrained`` of the export gives the original's logits exactly. A DCP
checkpoint of the model keeps the buffer, loaded on the mesh that wrote it and resharded
(4 ranks to 1); one written by plain ``dcp.save`` (the buffer stored whole by DCP, as
saves stored buffers before they were storage units) loads too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardspec.testing import run_ranks
from tests import hf_buffer_scenarios
from tests.hf_buffer_scenarios import BUFFER, BufferCase
from tests.hf_scenarios import hf_state
from tests.test_hf import _randomize
from tests.test_hf_split import shardspec

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
RULE = "param model.layers.*.mlp.gate.e_score_correction_bias [experts] replicate\n"


def write_checkpoint(folder: Path, **overrides: Any) -> None:
    """transformers' tiny DeepseekV3 (its config updated by ``overrides``) with random
    parameters and random (non-zero) score-correction biases, as ``save_pretrained``
    writes it."""
    from examples.models import hf as hfm

    model = hfm.deepseek_v3_tiny(**overrides)
    _randomize(model, 5)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen))
    model.save_pretrained(folder)


def compile_default(gen: Path) -> None:
    """specs/deepseek_v3.shard without the buffer's rule: the buffer is placed by default."""
    text = (REPO / "specs" / "deepseek_v3.shard").read_text(encoding="utf-8")
    assert text.count(RULE) == 1, "specs/deepseek_v3.shard changed: the buffer's rule"
    gen.mkdir(parents=True, exist_ok=True)
    for name in ("deepseek_v3.manifest.json", "deepseek_v3.hf.json"):
        (gen / name).write_bytes((REPO / "specs" / name).read_bytes())
    (gen / "deepseek_v3_default.shard").write_text(text.replace(RULE, ""), encoding="utf-8")
    shardspec("lint", str(gen / "deepseek_v3_default.shard"))
    shardspec("compile", str(gen / "deepseek_v3_default.shard"), "-o", str(gen))


S1 = (("ep", 1),)
S4 = (("dp_shard", 2), ("ep", 2))
CASES4 = [
    BufferCase("generated.deepseek_v3", S4, save_as="ckpt-4", load_from="ckpt-4"),
    BufferCase("deepseek_v3_default", S4),
]
CASES1 = [
    # loads the 4-rank checkpoint: a reshard
    BufferCase("generated.deepseek_v3", S1, save_as="ckpt-1", load_from="ckpt-4"),
    BufferCase("deepseek_v3_default", S1, load_from="ckpt-1", plain=True),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hf_buffers")
    write_checkpoint(root / "deepseek_v3")
    compile_default(root / "gen")
    four = run_ranks(hf_buffer_scenarios.run_all, 4, str(root), CASES4, timeout=600)
    one = run_ranks(hf_buffer_scenarios.run_all, 1, str(root), CASES1, timeout=600)
    return {"root": root, "one": one, "four": four}


def test_the_checkpoint_stores_the_buffer(results: dict) -> None:
    """The checkpoint transformers wrote holds the buffer, not at its initial value (or the
    tests below would prove nothing), among 41 keys."""
    stored = hf_state(str(results["root"] / "deepseek_v3"))
    assert len(stored) == 41
    assert torch.count_nonzero(stored[BUFFER]) == stored[BUFFER].numel()


@pytest.mark.parametrize("case", CASES1, ids=lambda c: c.label)
def test_single_process(results: dict, case: BufferCase) -> None:
    (rank0,) = results["one"]
    item = rank0[case.label]
    assert not item.fail, "\n".join(item.fail)
    assert item.checked >= 31 + 41  # the state dict, then the export
    assert item.extra["logits equal"] is True


@pytest.mark.parametrize("case", CASES4, ids=lambda c: c.label)
def test_on_four_ranks(results: dict, case: BufferCase) -> None:
    fails = [f for r in results["four"] for f in r[case.label].fail]
    assert not fails, "\n".join(fails)
    assert results["four"][0][case.label].extra["logits equal"] is True
    written = [r[case.label].extra["written"] for r in results["four"]]
    assert sum(1 for w in written if w) >= 2, written  # the writing is spread
