"""Tensor parallelism for transformers' ``Conv1D`` (weight ``[in, out]``): styles derive
from its placements as a Linear's do, the manifest records the module, lint and the
generated plan choose the Conv1D styles, and GPT-2 trains under TP as a single process
does (tests/conv1d_tp_scenarios.py, 4 gloo ranks, one spawn)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardspec.core import layout as core
from shardspec.core.styles import CONV1D, derive, why_not
from shardspec.inputs.manifest_build import model_entries
from shardspec.runtime.spec import SpecError
from shardspec.testing import run_ranks
from tests import conv1d_tp_scenarios

REPO = Path(__file__).resolve().parents[1]


def test_derive_conv1d_styles() -> None:
    """Conv1D's weight is [in, out]: out (dim 1) is colwise, in (dim 0) rowwise; a bias
    is cut colwise only; the transpose of a Linear's."""
    assert derive(CONV1D, "weight", 1) == "colwise"
    assert derive(CONV1D, "weight", 0) == "rowwise"
    assert derive(CONV1D, "bias", 0) == "colwise"
    assert derive(CONV1D, "weight", None) is None
    assert derive("linear", "weight", 1) == "rowwise"  # (the Linear's, unchanged)
    assert derive("Conv1D", "weight", 1) == "?"  # a class name only: an older manifest
    assert "rebuild it with `shardspec manifest`" in why_not("Conv1D")


class OwnForwardConv1D(nn.Module):
    """A module of another class that happens to be named Conv1D."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_manifest_records_transformers_conv1d() -> None:
    """GPT-2's Conv1D modules are kind conv1d; a Conv1D of another class (its own
    forward) keeps its class name; specs/gpt2.manifest.json is up to date."""
    from transformers.pytorch_utils import Conv1D

    from examples.models import hf

    class Sub(Conv1D):  # inherits transformers' forward: still conv1d
        pass

    model = nn.ModuleDict({"a": Conv1D(8, 4), "b": Sub(8, 4), "c": OwnForwardConv1D()})
    kinds = {e["fqn"]: e["module"] for e in model_entries(model)}
    assert kinds == {
        "a.bias": "conv1d",
        "a.weight": "conv1d",
        "b.bias": "conv1d",
        "b.weight": "conv1d",
        "c.weight": "OwnForwardConv1D",
    }
    with torch.device("meta"):
        gpt2 = hf.gpt2_tiny()
    disk = json.loads((REPO / "specs" / "gpt2.manifest.json").read_text())
    on_disk = {e["fqn"]: e.get("module") for e in disk["entries"]}
    assert {e["fqn"]: e.get("module") for e in model_entries(gpt2)} == on_disk
    assert on_disk["transformer.h.0.attn.c_attn.weight"] == "conv1d"


def test_gpt2_spec_lints_clean_and_records_conv1d_styles(capsys: pytest.CaptureFixture) -> None:
    """specs/gpt2.shard (tp 2) lints clean: SS033 fired once per Conv1D rule before. The
    generated module records each Conv1D rule's derived style with its module kind, from
    which tp_plan without a model picks the Conv1D style, cut as the spec says."""
    import generated.gpt2 as mod
    from shardspec.cli import main
    from shardspec.runtime.conv1d import Conv1DColwise, Conv1DRowwise
    from shardspec.runtime.parallel import _colwise_rowwise

    assert main(["lint", str(REPO / "specs" / "gpt2.shard")]) == 0
    assert "SS0" not in capsys.readouterr().err
    conv = {
        mod.SPEC.rules[i].pattern: s["kind"]
        for i, s in mod.STYLES.items()
        if s.get("module") == CONV1D
    }
    assert conv == {
        "transformer.h.*.attn.c_attn.weight": "colwise",
        "transformer.h.*.attn.c_attn.bias": "colwise",
        "transformer.h.*.{attn,mlp}.c_proj.weight": "rowwise",
        "transformer.h.*.mlp.c_fc.weight": "colwise",
        "transformer.h.*.mlp.c_fc.bias": "colwise",
    }
    qkv = {"weight": core.StridedShard(1, 3), "bias": core.StridedShard(0, 3)}
    colwise = _colwise_rowwise("colwise", CONV1D, qkv, {})
    assert type(colwise) is Conv1DColwise and colwise.param_placements == qkv
    rowwise = _colwise_rowwise("rowwise", CONV1D, {"weight": core.Shard(0)}, {})
    assert type(rowwise) is Conv1DRowwise


def test_conv1d_styles_refuse_a_linears_placements() -> None:
    """A Conv1D style given a Linear's cut (colwise on dim 0, rowwise on dim 1) says so."""
    from shardspec.runtime.conv1d import Conv1DColwise, Conv1DRowwise, LocalWidth

    with pytest.raises(SpecError, match="on out \\(dim 1\\)"):
        Conv1DColwise({"weight": core.Shard(0)})
    with pytest.raises(SpecError, match="on in \\(dim 0\\)"):
        Conv1DRowwise({"weight": core.Shard(1)})
    with pytest.raises(SpecError, match="keeps its bias whole"):
        Conv1DRowwise({"weight": core.Shard(0), "bias": core.Shard(0)})
    with pytest.raises(SpecError, match="names of the attributes"):
        LocalWidth()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One spawn of 4 gloo ranks for every scenario; a GPT-2 checkpoint written by
    transformers itself (save_pretrained) for load_hf."""
    root = tmp_path_factory.mktemp("conv1d")
    conv1d_tp_scenarios.gpt2(seed=3).save_pretrained(str(root / "hf"))
    return {"ranks": run_ranks(conv1d_tp_scenarios.run_all, 4, str(root), timeout=600)}


SCENARIOS = [
    f"{what} {mesh}" for mesh in conv1d_tp_scenarios.MESHES for what in ("train", "load_hf")
]


@pytest.mark.parametrize("label", SCENARIOS)
def test_gpt2_tensor_parallel(results: dict[str, Any], label: str) -> None:
    """GPT-2 parallelized by specs/gpt2.shard with the Conv1D styles: ``train``, the
    logits, losses, first gradients and parameters after AdamW steps equal a single
    process's (within the fp32 tolerance the scenarios explain); ``load_hf``, a GPT-2
    checkpoint loads into the TP model bitwise transformers' own parameters and buffers,
    and its logits equal transformers'."""
    failures = []
    for rank, items in enumerate(results["ranks"]):
        item = items[label]
        failures += [f"rank {rank}: {f}" for f in item.fail]
        assert item.extra, f"rank {rank}: {label} checked nothing"
    assert not failures, "\n".join(failures)
    extra = results["ranks"][0][label].extra
    if label.startswith("train"):
        assert extra["styles"] == ["Conv1DColwise", "Conv1DRowwise"]
    else:
        assert extra["checked"] == 28


class _Mesh:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_local_width_divides_the_widths_or_says_why() -> None:
    """LocalWidth makes a stored width the rank's (GPT-2's split_size over tp 2), and
    refuses a width the TP size does not divide, or no width at all, changing nothing."""
    from shardspec.runtime.conv1d import LocalWidth

    attn = nn.Module()
    attn.split_size = 64  # type: ignore[assignment]
    attn.name = "x"  # type: ignore[assignment]
    LocalWidth("split_size")._apply(attn, _Mesh(2))  # type: ignore[arg-type]
    assert attn.split_size == 32
    with pytest.raises(SpecError, match="split_size=32, name='x' are not widths divisible"):
        LocalWidth("split_size", "name")._apply(attn, _Mesh(3))  # type: ignore[arg-type]
    assert attn.split_size == 32
    with pytest.raises(SpecError, match="missing=None"):
        LocalWidth("missing")._apply(attn, _Mesh(2))  # type: ignore[arg-type]


def test_parallelize_names_gpt2s_attention_without_local_width() -> None:
    """GPT-2's attention splits c_attn's output by split_size, a global width: without
    LocalWidth its forward failed inside transformers ("not enough values to unpack").
    The plan's check names each such module and the style to pass; with the styles, or
    at tp size 1, nothing."""
    import generated.gpt2 as mod
    from shardspec.runtime.conv1d import global_splits
    from shardspec.runtime.parallel import build_tp_plan, plan_params

    with torch.device("meta"):
        model = conv1d_tp_scenarios.gpt2(seed=0)
    lmesh = core.Mesh(("dp_shard", "tp"), (2, 2))
    plans, _ = plan_params(mod.SPEC, model, lmesh)
    _, plan = build_tp_plan(mod.SPEC, model, lmesh, plans)
    said = global_splits(model, plan, 2)
    assert [s.split(":")[0] for s in said] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert "split_size=64" in said[0] and "LocalWidth('split_size')" in said[0]
    styles = conv1d_tp_scenarios.tp_styles(model)
    _, plan = build_tp_plan(mod.SPEC, model, lmesh, plans, styles)
    assert global_splits(model, plan, 2) == []
    assert global_splits(model, build_tp_plan(mod.SPEC, model, lmesh, plans)[1], 1) == []
