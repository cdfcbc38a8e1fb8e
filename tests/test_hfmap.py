"""The hf mapping model (:mod:`shardspec.core.hfmap`) and the runtime's slice reads, in one
process: templates, sources and consumers, transforms against plain torch, and every box
of a tensor read through safetensors slicing against the whole tensor converted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.models import hf as hfm
from shardspec.core.hfmap import (
    Fused,
    HFMap,
    MapRule,
    Part,
    Split,
    Transform,
    fused_of,
    hf_shape,
    model_indices,
    rope_row,
    runs,
    source_indices,
    template_captures,
    transform_problem,
    unit_names,
)
from shardspec.core.layout import Dim, Fusion
from shardspec.runtime.hf.export import _to_hf, _written_twice
from shardspec.runtime.hf.load import _progress, _read_box

ROPE8 = Transform("rope", 8)
T = Transform("transpose")


def forward(hf: torch.Tensor, transforms: tuple[Transform, ...]) -> torch.Tensor:
    """The model's tensor from the HF one, with plain torch (the oracle)."""
    for t in transforms:
        hf = hf.t() if t.kind == "transpose" else hfm.hf_rope_to_meta(hf, t.head_dim)
    return hf.contiguous()


def test_rope_row_is_the_meta_hf_permutation() -> None:
    meta = torch.arange(3 * 8 * 2).reshape(3 * 8, 2)
    hf = hfm.meta_rope_to_hf(meta, 8)
    for m in range(24):
        assert torch.equal(meta[m], hf[rope_row(m, 8)])


def test_templates_sources_and_consumers() -> None:
    rules = (
        MapRule("model.layers.{i}.q_proj.weight", "layers.{i}.wqkv.weight.q", None, (ROPE8,), 3),
        MapRule("model.layers.{i}.experts.{e}.up.weight", "layers.{i}.experts.w3", "e", (), 4),
        MapRule("a.{x}.b", "c.{x}", None, (T,), 5),
    )
    m = HFMap(rules, drops=("model.rotary_emb.*",), ties=(("lm_head.weight", "embed.weight"),))
    assert template_captures(rules[1].hf) == ("i", "e")
    [src] = m.sources("layers.3.wqkv.weight.q", (16, 4))
    assert src.keys == ("model.layers.3.q_proj.weight",) and src.shape == (16, 4)
    [src] = m.sources("layers.0.experts.w3", (3, 5, 7))
    assert src.stacked and src.shape == (5, 7)
    assert src.keys == tuple(f"model.layers.0.experts.{e}.up.weight" for e in range(3))
    [src] = m.sources("c.zz", (2, 9))
    assert src.shape == (9, 2)
    assert m.sources("layers.3.wqkv.weight.k", (16, 4)) == []
    assert m.consumers("model.layers.1.experts.2.up.weight") == [(1, "layers.1.experts.w3", 2)]
    # a stack index must be a number
    assert m.consumers("model.layers.1.experts.x.up.weight") == []
    assert m.dropped("model.rotary_emb.inv_freq") and not m.dropped("model.norm.weight")
    assert m.tie_of("lm_head.weight") == "embed.weight" and m.tie_of("embed.weight") is None
    assert list(m.problems()) == []
    assert bool(m) and not HFMap()


def test_problems_name_what_cannot_be_inverted() -> None:
    bad = HFMap(
        (
            MapRule("x.{i}.{j}", "y.{i}"),  # {j} only on the HF side
            MapRule("x.{i}", "y.{i}.{k}"),  # {k} only on the model side
            MapRule("x.w", "y.w", "e"),  # the stack index is not a capture of the HF name
            MapRule("x.{e}", "y.{e}", "e"),  # and a capture of the target too
            MapRule("x.r", "y.r", None, (Transform("rope", 7),)),
        )
    )
    found: dict[int, str] = {}
    for i, why in bad.problems():
        found[i] = found.get(i, "") + why + "; "
    assert set(found) == {0, 1, 2, 3, 4}
    assert "{j}" in found[0] and "{k}" in found[1] and "[e]" in found[2]
    assert "both a capture" in found[3] and "even head size" in found[4]
    with pytest.raises(ValueError, match=r"capture \{j\}"):
        bad.sources("y.1", (2,))


def test_transform_problems_and_shapes() -> None:
    assert hf_shape((4, 6), (T, ROPE8)) == (6, 4)
    assert transform_problem((16, 4), (ROPE8,)) is None
    assert "whole number of heads" in (transform_problem((12, 4), (ROPE8,)) or "")
    assert "2-D" in (transform_problem((2, 3, 4), (T,)) or "")
    assert "unknown transform" in (transform_problem((2, 2), (Transform("flip"),)) or "")


def test_runs() -> None:
    assert runs(range(3, 7)) == [(3, 7)]
    assert runs(range(0)) == []
    assert runs((5, 1, 2, 9, 3)) == [(1, 4), (5, 6), (9, 10)]


def test_unit_names_cover_components_and_global_expert_indices() -> None:
    fused = (Dim("ffn", 8, ("tp",), Fusion((("gate", 4), ("up", 4)))), Dim("hidden", 6))
    assert unit_names("w13", fused, ()) == [("w13.gate", (4, 6)), ("w13.up", (4, 6))]
    grouped = (Dim("qkv", 16, ("tp",), Fusion((("q", 4), ("k", 2), ("v", 2)), groups=2)),)
    assert unit_names("wqkv", grouped, ()) == [("wqkv.q", (8,)), ("wqkv.k", (4,)), ("wqkv.v", (4,))]
    fqn = "layers.0.local_experts.1.w1.weight"
    dims = (Dim("expert", 4, ("ep",), name_indexed=True), Dim("ffn", 3), Dim("hidden", 2))
    start = fqn.index("1.w1")
    names = unit_names(fqn, dims, [(start, start + 1)])
    assert names == [(f"layers.0.local_experts.{e}.w1.weight", (3, 2)) for e in range(4)]


CHAINS = [(), (ROPE8,), (T,), (T, ROPE8), (ROPE8, T)]


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """One safetensors file with a tensor per chain, HF side (so that the chain applies)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for k, chain in enumerate(CHAINS):
        # model shape (24, 16): rope 8 on the model's dim 0 needs rows of whole heads
        model = torch.randn(24, 16, generator=gen)
        hf = model
        for t in reversed(chain):  # invert the chain by hand
            hf = hf.t() if t.kind == "transpose" else hfm.meta_rope_to_hf(hf, t.head_dim)
        tensors[f"t{k}"] = hf.contiguous()
        if chain == (ROPE8, T):
            # rope applies to the HF tensor's dim 0 before the transpose: rows of 8 there
            tensors[f"t{k}"] = torch.randn(16, 24, generator=gen)
    path = tmp_path_factory.mktemp("hfmap") / "x.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(0, len(CHAINS) - 1),
    r0=st.integers(0, 23),
    c0=st.integers(0, 15),
    data=st.data(),
)
def test_read_box_equals_the_whole_tensor_converted(
    hf_file: tuple[Path, dict[str, torch.Tensor]], k: int, r0: int, c0: int, data: st.DataObject
) -> None:
    from safetensors import safe_open

    path, tensors = hf_file
    chain = CHAINS[k]
    model = forward(tensors[f"t{k}"], chain)
    rows, cols = model.shape
    r0, c0 = min(r0, rows - 1), min(c0, cols - 1)
    nr = data.draw(st.integers(0, rows - r0))
    nc = data.draw(st.integers(0, cols - c0))
    with safe_open(str(path), framework="pt") as f:
        box = _read_box(f, f"t{k}", chain, (r0, c0), (nr, nc))
    assert torch.equal(box, model[r0 : r0 + nr, c0 : c0 + nc])


@pytest.mark.parametrize("chain", CHAINS, ids=str)
def test_to_hf_inverts_the_chain(chain: tuple[Transform, ...]) -> None:
    hf = torch.randn(16, 24) if chain and chain[0] == T else torch.randn(24, 16)
    if chain == (ROPE8, T):
        hf = torch.randn(16, 24)
    model = forward(hf, chain)
    assert torch.equal(_to_hf(model, chain), hf)
    per_dim, dims = model_indices(chain, tuple(model.shape))
    assert sorted(dims) == [0, 1]
    per_hf, model_dims = source_indices(chain, (0, 0), tuple(model.shape))
    assert sorted(model_dims) == [0, 1] and len(per_hf) == 2 and len(per_dim) == 2


def test_progress_bar_only_on_rank_0() -> None:
    assert _progress(10, True, 1) is None
    assert _progress(10, None, 0) is None  # small loads show none unless asked
    assert _progress(10, False, 0) is None
    bar = _progress(10, True, 0)
    assert bar is not None
    bar.close()


def test_export_refuses_two_units_under_one_key() -> None:
    m = HFMap((MapRule("emb.weight", "a.weight"), MapRule("emb.weight", "b.weight")))
    sources = {n: m.sources(n, (4, 4))[0] for n in ("a.weight", "b.weight")}
    assert _written_twice(sources) == [
        "emb.weight: both a.weight and b.weight would be written under it"
    ]
    assert _written_twice({"a.weight": sources["a.weight"]}) == []


# ------------------------------------------------------------------- split lines


QKV: Fused = (0, (("q", 8), ("k", 4), ("v", 4)))


def test_a_line_to_the_fused_parameter_splits_in_declared_order() -> None:
    m = HFMap((MapRule("a.{i}.qkv", "m.{i}.w", line=3),))
    [src] = m.sources("m.0.w.k", (4, 6), QKV)
    assert src.keys == ("a.0.qkv",) and src.shape == (16, 6)
    assert src.split == Split(0, 8, 4, 16) and src.transforms == ()
    assert m.sources("m.0.w.k", (4, 6)) == []  # not a component: no split
    assert m.consumers("a.0.qkv") == [(0, "m.0.w", None)]
    # Conv1D: the fused dimension is the HF tensor's last one
    m = HFMap((MapRule("a.{i}.c_attn", "m.{i}.w", transforms=(T,)),))
    [src] = m.sources("m.0.w.v", (4, 6), QKV)
    assert src.shape == (6, 16) and src.split == Split(1, 12, 4, 16)


def test_an_as_list_orders_the_parts_with_transforms_of_their_own() -> None:
    parts = (Part("k"), Part("q", (ROPE8,)), Part("v"))
    m = HFMap((MapRule("a.qkv", "m.w", transforms=(T,), parts=parts),))
    [src] = m.sources("m.w.q", (8, 6), QKV)
    assert src.split == Split(1, 4, 8, 16) and src.transforms == (T, ROPE8)
    [src] = m.sources("m.w.k", (4, 6), QKV)
    assert src.split == Split(1, 0, 4, 16) and src.transforms == (T,)
    # a subset: the HF tensor is k then v only; q comes from elsewhere
    m = HFMap((MapRule("a.kv", "m.w", parts=(Part("k"), Part("v"))),))
    assert m.sources("m.w.q", (8, 6), QKV) == []
    [src] = m.sources("m.w.v", (4, 6), QKV)
    assert src.split == Split(0, 4, 4, 8) and src.shape == (8, 6)
    # an as list on a plain parameter produces nothing (lint: SS081)
    assert HFMap((MapRule("a.w", "m.w", parts=(Part("x"),)),)).sources("m.w", (2, 2)) == []
    assert list(HFMap((MapRule("a", "b", parts=(Part("q"), Part("q"))),)).problems()) == [
        (0, "component 'q' is named twice in the `as` list")
    ]


def test_stacked_experts_split_each_slice() -> None:
    m = HFMap((MapRule("x.{i}.e.{e}.gate_up", "m.{i}.w13", "e"),))
    fused: Fused = (1, (("gate", 2), ("up", 2)))
    [src] = m.sources("m.0.w13.up", (3, 2, 5), fused)
    assert src.stacked and src.keys == tuple(f"x.0.e.{e}.gate_up" for e in range(3))
    assert src.shape == (4, 5) and src.split == Split(0, 2, 2, 4)
    # the stack index cannot run over the fused dimension
    assert m.sources("m.0.w13.up", (2, 5), (0, (("gate", 1), ("up", 1)))) == []


def test_fused_of_positions_the_dimension_without_name_indexed_dims() -> None:
    dims = (
        Dim("expert", 4, ("ep",), name_indexed=True),
        Dim("hidden", 6),
        Dim("ffn", 8, ("tp",), Fusion((("gate", 2), ("up", 2)), groups=2)),
    )
    assert fused_of(dims) == (1, (("gate", 4), ("up", 4)))
    assert fused_of((Dim("hidden", 6),)) is None


SPLIT_CHAINS = [((), ()), ((T,), ()), ((), (ROPE8,)), ((T,), (ROPE8,))]


@settings(max_examples=60, deadline=None)
@given(k=st.integers(0, len(SPLIT_CHAINS) - 1), comp=st.integers(0, 2), data=st.data())
def test_read_box_of_a_part_equals_the_part_converted(
    tmp_path_factory: pytest.TempPathFactory, k: int, comp: int, data: st.DataObject
) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    line, own = SPLIT_CHAINS[k]
    parts = (Part("k", own), Part("q", own), Part("v"))  # q and k 8 rows each: rope 8 fits
    fused: Fused = (0, (("q", 16), ("k", 8), ("v", 8)))
    m = HFMap((MapRule("qkv", "w", transforms=line, parts=parts),))
    name, rows = ("w.k", 8) if comp == 0 else ("w.q", 16) if comp == 1 else ("w.v", 8)
    [src] = m.sources(name, (rows, 6), fused)
    assert src.split is not None
    gen = torch.Generator().manual_seed(k)
    hf = torch.randn(src.shape, generator=gen)
    path = tmp_path_factory.mktemp("split") / "x.safetensors"
    save_file({"qkv": hf}, str(path))
    model = forward(hf.narrow(src.split.dim, src.split.start, src.split.size), src.transforms)
    r0 = data.draw(st.integers(0, rows - 1))
    nr = data.draw(st.integers(0, rows - r0))
    c0 = data.draw(st.integers(0, 5))
    nc = data.draw(st.integers(0, 6 - c0))
    with safe_open(str(path), framework="pt") as f:
        box = _read_box(f, "qkv", src.transforms, (r0, c0), (nr, nc), src.split)
    assert torch.equal(box, model[r0 : r0 + nr, c0 : c0 + nc])
    assert torch.equal(
        _to_hf(model, src.transforms), hf.narrow(src.split.dim, src.split.start, src.split.size)
    )


def test_export_takes_the_parts_of_one_split_tensor_and_nothing_less() -> None:
    m = HFMap((MapRule("a.qkv", "w"),))
    sources = {f"w.{c}": m.sources(f"w.{c}", (n, 6), QKV)[0] for c, n in QKV[1]}
    assert _written_twice(sources) == []
    del sources["w.k"]  # a gap where k was
    assert _written_twice(sources) == [
        "a.qkv: both w.q and w.v would be written under it, not as parts that tile it"
    ]
    plain = HFMap((MapRule("a.qkv", "x"),)).sources("x", (16, 6))[0]
    assert _written_twice({"w.q": sources["w.q"], "x": plain}) != []


def test_load_and_export_refuse_a_part_that_is_no_component() -> None:
    """Lint reports it (SS081); the runtime, which may run without lint, refuses it."""
    from shardspec.runtime.hf.common import GlobalUnit, resolve_sources

    m = HFMap((MapRule("a.qkv", "w", line=7, parts=(Part("q"), Part("x"))),))
    units = {f"w.{c}": GlobalUnit(f"w.{c}", (n, 6), torch.float32, QKV) for c, n in QKV[1]}
    sources, problems = resolve_sources(m, units, strict=False)
    assert set(sources) == {"w.q"}
    assert problems == [
        "w.q: line 7 splits its Hugging Face tensor into 'x', which is no component of w (q, k, v)"
    ]
