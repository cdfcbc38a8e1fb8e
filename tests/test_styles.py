"""Tensor-parallel style derivation (shardspec/core/styles.py), and `style` lines fuzzed through
the whole checker with a manifest that records module kinds: never a traceback, every
finding coded, and the generated STYLES table always agrees with the checks."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardspec.api import check, emit
from shardspec.core.styles import EMBEDDING, LINEAR, derive, mp_dims
from shardspec.frontend.parse import parse_file
from shardspec.inputs.manifest import dump_manifest


@pytest.mark.parametrize(
    ("module", "leaf", "dim", "want"),
    [
        (LINEAR, "weight", 0, "colwise"),
        (LINEAR, "weight", 1, "rowwise"),
        (LINEAR, "bias", 0, "colwise"),
        (EMBEDDING, "weight", 0, "rowwise"),
        (EMBEDDING, "weight", 1, "colwise"),
        (LINEAR, "weight", None, None),
        ("RMSNorm", "weight", 0, "?"),
        (None, "weight", 0, "?"),
    ],
)
def test_derive(module, leaf, dim, want) -> None:
    assert derive(module, leaf, dim) == want


def test_mp_dims_skip_the_fsdp_axis_and_local_axes() -> None:
    shard = {"out": ("tp", "dp"), "hidden": ("dp",), "e": ("ep",)}
    assert mp_dims(shard, ["out", "hidden", "e"], "dp", set()) == [0, 2]
    assert mp_dims(shard, ["out", "hidden", "e"], "dp", {"tp"}) == [2]


MANIFEST = {
    "w.weight": ([16, 8], LINEAR),
    "w.bias": ([16], LINEAR),
    "e.weight": ([16, 8], EMBEDDING),
    "n.weight": ([8], "RMSNorm"),
}
KINDS = ["colwise", "rowwise", "sequence_parallel", "none", "colwyse", "local"]
LAYOUTS = ["replicate", "sequence", "features", "heads", "full", "tp"]


@st.composite
def style_line(draw) -> str:
    words = ["style", draw(st.sampled_from(KINDS))]
    for key in draw(st.lists(st.sampled_from(["input", "output", "dtensor"]), max_size=3)):
        words += [key] if key == "dtensor" else [key, draw(st.sampled_from(LAYOUTS))]
    return " ".join(words)


@st.composite
def specs(draw) -> str:
    lines = ['manifest "m.json"', "mesh over 8 ranks { dp: *  tp: 2 }", "fsdp dp"]
    for pattern, dims in (
        ("w.weight", "[out, in]"),
        ("w.bias", "[out]"),
        ("e.weight", "[vocab, hidden]"),
        ("n.weight", "[hidden]"),
    ):
        body = []
        first = dims.strip("[]").split(", ")
        if draw(st.booleans()):
            body.append(f"shard {draw(st.sampled_from(first))} over tp")
        body += draw(st.lists(style_line(), max_size=2))
        lines.append(f"param {pattern} {dims} {{ " + "\n".join(body) + " }")
    return "\n".join(lines) + "\n"  # fmt: skip


def _check(text: str, fields: dict[str, dict], root: Path) -> tuple[Any, list, dict | None]:
    """Check ``text`` against :data:`MANIFEST` (entries updated by ``fields``): the spec,
    its findings (each coded, with a line), and the generated STYLES table (None when an
    error stops compilation)."""
    entries = [
        {"fqn": f, "kind": "param", "shape": shape, "dtype": "float32", "module": kind}
        | fields.get(f, {})
        for f, (shape, kind) in MANIFEST.items()
    ]
    (root / "m.json").write_text(dump_manifest(entries, "tests:model"), encoding="utf-8")
    path = root / "s.shard"
    path.write_text(text, encoding="utf-8")
    spec, diags = parse_file(str(path))
    assert spec is not None, [d.message for d in diags]
    res, found = check(spec)
    for d in found:
        assert d.code.startswith("SS") and d.span.line >= 1
    if any(d.is_error for d in found):
        return spec, found, None
    module = emit(res, str(path), "s")
    table = module[module.index("STYLES:") :]
    return spec, found, ast.literal_eval(table[table.index("=") + 1 : table.index("\n\n")].strip())


@settings(max_examples=150, deadline=None)
@given(text=specs())
def test_style_lines_through_the_checker(text: str, tmp_path_factory) -> None:
    spec, _, styles = _check(text, {}, tmp_path_factory.mktemp("styles"))
    if styles is None:
        return
    for index, style in styles.items():
        rule = spec.rules[int(index)]
        if rule.style is None:  # derived: colwise or rowwise from the module and placement
            assert style["kind"] in ("colwise", "rowwise") and style["derived"]
        else:
            assert style["kind"] == rule.style.kind.text


CLASSES = {
    "w.weight": [
        {"class": "torch.nn.modules.linear.Linear"},
        {"class": "m.NamedLinear", "forward": "torch.nn.modules.linear.Linear"},
        {"class": "m.Fp8Linear"},
        {},  # an older manifest: no class recorded
    ],
    "e.weight": [
        {"class": "torch.nn.modules.sparse.Embedding"},
        {"class": "m.VocabParallelEmbedding"},
        {},
    ],
}


@settings(max_examples=150, deadline=None)
@given(
    text=specs(),
    w=st.sampled_from(CLASSES["w.weight"]),
    e=st.sampled_from(CLASSES["e.weight"]),
    tied=st.booleans(),
)
def test_classes_and_ties_through_the_checker(
    text: str, w: dict, e: dict, tied: bool, tmp_path_factory
) -> None:
    """Random style lines on a manifest with drawn module classes and a drawn tie: never a
    traceback; SS038 only where a class runs its own forward, SS037 only with the tie; and
    a spec that passes gives no custom class torch's colwise or rowwise style."""
    fields = {"w.weight": w, "w.bias": w, "e.weight": e | ({"tied_to": "w.weight"} if tied else {})}
    spec, found, styles = _check(text, fields, tmp_path_factory.mktemp("classes"))
    codes = {d.code for d in found}
    custom = {f for f, c in fields.items() if "class" in c and "forward" not in c}
    custom = {f for f in custom if not fields[f]["class"].startswith("torch.")}
    if not custom:
        assert "SS038" not in codes
    if not tied:
        assert "SS037" not in codes
    for index, style in (styles or {}).items():
        pattern = spec.rules[int(index)].pattern.text
        if pattern in custom and pattern.endswith(".weight"):
            assert style["kind"] not in ("colwise", "rowwise"), (pattern, style)


def test_heads_layout_is_torchs_sequence_parallel_on_the_heads_dim() -> None:
    """`style sequence_parallel input heads` (specs/qwen3.shard's q/k norms) is torch's
    SequenceParallel on dimension -2 of [..., heads, head_dim], handing on local tensors
    (`dtensor`: DTensors); plain `sequence_parallel` keeps torch's defaults."""
    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    import generated.qwen3 as qwen3
    from examples.models.hf import qwen3_tiny
    from shardspec.runtime.parallel import _style_kwargs

    with torch.device("meta"):
        model = qwen3_tiny()
    plan = qwen3.tp_plan({"dp_shard": 2, "tp": 2}, model)
    norms = {k: v for k, v in plan.items() if k.endswith(("q_norm", "k_norm"))}
    assert len(norms) == 4
    for style in norms.values():
        assert isinstance(style, SequenceParallel)
        assert style.sequence_sharding == (Shard(-2),) and style.use_local_output
    assert not any(k.endswith("layernorm") for k in plan)  # block norms: no style
    heads = {"input": "heads"}
    assert _style_kwargs(heads | {"local": False}, sequence=True)["use_local_output"] is False
    assert _style_kwargs({}, sequence=True) == {}
