"""export_hf's ``dtype`` and ``keep_dtype``.

The rule: ``dtype`` casts every floating tensor, parameters and persistent buffers alike,
as ``model.to(dtype)`` does; integer and bool tensors keep theirs; ``keep_dtype`` (globs of
Hugging Face keys) keeps the model's own dtype for the keys it matches, which is how
transformers keeps a model's ``_keep_in_fp32_modules_strict`` in fp32 when it loads it in
bf16. Checked against the model's owner: transformers' tiny DeepseekV3ForCausalLM, whose
router holds the persistent buffer ``mlp.gate.e_score_correction_bias``, loaded from its
fp32 checkpoint on 2 gloo ranks (dp_shard 2) and exported in bf16, equals, key for key,
dtype for dtype and bit for bit, what ``model.to(torch.bfloat16).save_pretrained`` writes
(every tensor bf16, the buffer too), and with ``keep_dtype`` made from the model class's
``_keep_in_fp32_modules_strict`` what ``from_pretrained(dtype=torch.bfloat16)
.save_pretrained`` writes (the buffer and the router's weight in fp32). The rule's edges
(integer tensors, patterns that match nothing, arguments of the wrong kind) run in one
process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.bench_checkpoint import FakeMesh
from shardspec.runtime import hf as hfmod
from shardspec.runtime.hf.export import _cast
from shardspec.testing import run_ranks
from tests import hf_export_dtype_scenarios
from tests.hf_buffer_scenarios import BUFFER
from tests.hf_scenarios import hf_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ----------------------------------------------------------------------- the rule, alone


def test_dtype_casts_floating_tensors_only() -> None:
    cast = _cast(torch.bfloat16, ())
    assert cast.of("a.weight", torch.float32) == torch.bfloat16
    assert cast.of("a.bias", torch.float16) == torch.bfloat16
    assert cast.of("counter", torch.int64) == torch.int64
    assert cast.of("mask", torch.bool) == torch.bool
    assert _cast(None, ()).of("a.weight", torch.float32) == torch.float32


def test_keep_dtype_keeps_the_models_dtype_for_matching_keys() -> None:
    cast = _cast(torch.bfloat16, ["*.mlp.gate.weight", "*e_score_correction_bias"])
    assert cast.of("model.layers.1.mlp.gate.weight", torch.float32) == torch.float32
    assert cast.of(BUFFER, torch.float32) == torch.float32
    assert cast.of("model.layers.1.mlp.gate_proj.weight", torch.float32) == torch.bfloat16
    assert _cast(torch.bfloat16, "lm_head.weight").keep == ("lm_head.weight",)


@pytest.mark.parametrize(
    ("dtype", "keep", "says"),
    [
        ("bfloat16", (), "dtype must be a torch.dtype"),
        (torch.bfloat16, [3], "keep_dtype must be glob patterns"),
    ],
)
def test_arguments_of_the_wrong_kind_are_refused(dtype: Any, keep: Any, says: str) -> None:
    with pytest.raises(hfmod.HFError, match=says):
        _cast(dtype, keep)


# ----------------------------------------------------------- one process, the example llama


@pytest.fixture(scope="module")
def layout() -> Any:
    import generated.llama as layout

    return layout


MESH = FakeMesh(("dp_shard", "tp"), (1, 1), (0, 0))


def _llama() -> torch.nn.Module:
    from examples.models import llama

    model = llama.tiny()
    llama.init_weights(model, 1)
    return model


def test_keep_dtype_in_an_export(layout: Any, tmp_path: Path) -> None:
    """The kept keys stay fp32, the others are bf16, and the index counts each in its own
    dtype."""
    import json

    out = tmp_path / "out"
    layout.export_hf(_llama(), str(out), MESH, dtype=torch.bfloat16, keep_dtype="*norm.weight")
    state = hf_state(str(out))
    kept = {k for k, t in state.items() if t.dtype == torch.float32}
    assert kept and kept == {k for k in state if k.endswith("norm.weight")}
    assert all(t.dtype == torch.bfloat16 for k, t in state.items() if k not in kept)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )


def test_a_keep_pattern_that_matches_no_key_is_refused(layout: Any, tmp_path: Path) -> None:
    """A typo would write in bf16 what was meant to stay: refused before anything."""
    out = tmp_path / "out"
    with pytest.raises(hfmod.HFError, match=r"'\*norm\.wieght' matches no Hugging Face key"):
        layout.export_hf(
            _llama(), str(out), MESH, dtype=torch.bfloat16, keep_dtype=["*norm.wieght"]
        )
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------- the owner's bf16 saves (2 gloo ranks)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fp32 checkpoint, transformers' two bf16 saves of it, and the exports."""
    from tests.test_hf_buffers import write_checkpoint

    root = tmp_path_factory.mktemp("hf_export_dtype")
    write_checkpoint(root / "deepseek_v3")
    cls = transformers.DeepseekV3ForCausalLM
    fp32 = cls.from_pretrained(root / "deepseek_v3", dtype=torch.float32)
    fp32.to(torch.bfloat16).save_pretrained(root / "to-bf16")
    cls.from_pretrained(root / "deepseek_v3", dtype=torch.bfloat16).save_pretrained(
        root / "from-bf16"
    )
    # transformers' own list, as globs (the runtime never imports transformers).
    keep = [f"*{name}" for name in sorted(cls._keep_in_fp32_modules_strict)]
    (rank0, rank1) = run_ranks(hf_export_dtype_scenarios.run, 2, str(root), keep, timeout=600)
    return {"root": root, "ranks": (rank0, rank1)}


def test_the_owners_saves_differ_on_the_buffer(results: dict) -> None:
    """The two references disagree on the buffer (or the tests below would not tell the
    rules apart), and the checkpoint's buffer is not its initial zeros."""
    root = results["root"]
    to, frm = hf_state(str(root / "to-bf16")), hf_state(str(root / "from-bf16"))
    assert to[BUFFER].dtype == torch.bfloat16 and frm[BUFFER].dtype == torch.float32
    assert torch.count_nonzero(hf_state(str(root / "deepseek_v3"))[BUFFER]) > 0


def test_dtype_equals_the_owners_cast(results: dict) -> None:
    """``dtype=torch.bfloat16``: what ``model.to(torch.bfloat16).save_pretrained`` writes,
    the buffer included."""
    (item,) = results["ranks"][0].values()
    assert not item.fail, "\n".join(item.fail)
    assert item.checked == 2 * 41
    assert item.extra["bf16 dtypes"] == []


def test_keep_dtype_equals_the_owners_bf16_model(results: dict) -> None:
    """``keep_dtype`` from ``_keep_in_fp32_modules_strict``: what transformers' bf16 model
    saves, the buffer and the router's weight in fp32."""
    (item,) = results["ranks"][0].values()
    assert item.extra["bf16-keep dtypes"] == [
        ("model.layers.1.mlp.gate.e_score_correction_bias", "torch.float32"),
        ("model.layers.1.mlp.gate.weight", "torch.float32"),
    ]


def test_the_writing_is_spread(results: dict) -> None:
    files = [next(iter(r.values())).extra["bf16 file"] for r in results["ranks"]]
    assert all(files) and len(set(files)) == 2, files
