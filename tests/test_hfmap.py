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
    dtype_kind,
    fused_of,
    hf_shape,
    model_indices,
    rope_row,
    runs,
    source_indices,
    strided_runs,
    template_captures,
    transform_problem,
    unit_names,
)
from shardspec.core.layout import Dim, Fusion
from shardspec.runtime.hf.export import _place_part, _to_hf, _written_twice
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


QKV: Fused = Fused(0, (("q", 8), ("k", 4), ("v", 4)))


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
    fused: Fused = Fused(1, (("gate", 2), ("up", 2)))
    [src] = m.sources("m.0.w13.up", (3, 2, 5), fused)
    assert src.stacked and src.keys == tuple(f"x.0.e.{e}.gate_up" for e in range(3))
    assert src.shape == (4, 5) and src.split == Split(0, 2, 2, 4)
    # the stack index cannot run over the fused dimension
    assert m.sources("m.0.w13.up", (2, 5), Fused(0, (("gate", 1), ("up", 1)))) == []


def test_fused_of_positions_the_dimension_without_name_indexed_dims() -> None:
    dims = (
        Dim("expert", 4, ("ep",), name_indexed=True),
        Dim("hidden", 6),
        Dim("ffn", 8, ("tp",), Fusion((("gate", 2), ("up", 2)), groups=2)),
    )
    assert fused_of(dims) == Fused(1, (("gate", 4), ("up", 4)), 2)
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
    fused: Fused = Fused(0, (("q", 16), ("k", 8), ("v", 8)))
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


# ------------------------------------------------------------------- grouped splits


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 60), max_size=25))
def test_strided_runs_cover_exactly_the_indices(indices: set[int]) -> None:
    got = strided_runs(tuple(indices))
    assert [i for a, b, step in got for i in range(a, b, step)] == sorted(indices)
    assert all(step >= 1 and b > a for a, b, step in got)
    assert strided_runs(tuple(range(0, 64, 2))) == [(0, 63, 2)]  # gate of gate/up: one slice
    assert strided_runs(range(3, 9)) == [(3, 9, 1)]


# gpt-oss: 4 groups of gate 1, up 1; Megatron GQA: 2 groups of q 4, k 2, v 2.
GATE_UP = Fused(0, (("gate", 4), ("up", 4)), 4)
MEGATRON = Fused(0, (("q", 8), ("k", 4), ("v", 4)), 2)


def test_a_grouped_line_reads_each_group_s_rows() -> None:
    m = HFMap((MapRule("a.gate_up", "w", grouped=True),))
    [gate] = m.sources("w.gate", (4, 6), GATE_UP)
    [up] = m.sources("w.up", (4, 6), GATE_UP)
    assert gate.split == Split(0, 0, 4, 8, 4) and up.split == Split(0, 1, 4, 8, 4)
    assert [up.split.hf_index(i) for i in range(4)] == [1, 3, 5, 7]
    m = HFMap((MapRule("a.qkv", "w", grouped=True),))
    [k] = m.sources("w.k", (4, 6), MEGATRON)
    assert k.split == Split(0, 4, 4, 16, 2)
    assert [k.split.hf_index(i) for i in range(4)] == [4, 5, 12, 13]
    # an `as` list orders the parts within each group
    m = HFMap((MapRule("a.kqv", "w", (), (), 0, (Part("k"), Part("q"), Part("v")), True),))
    [q] = m.sources("w.q", (8, 6), MEGATRON)
    assert [q.split.hf_index(i) for i in range(8)] == [2, 3, 4, 5, 10, 11, 12, 13]  # type: ignore[union-attr]
    # not grouped: the declared order, contiguous (what issue 20's gpt-oss load did)
    [up] = HFMap((MapRule("a.gate_up", "w"),)).sources("w.up", (4, 6), GATE_UP)
    assert up.split == Split(0, 4, 4, 8) and up.split.hf_index(0) == 4
    # `grouped` names no unit of its own: only the parts of a fused parameter
    assert HFMap((MapRule("a.w", "w", grouped=True),)).sources("w", (2, 2)) == []


def _by_hand(hf: torch.Tensor, dim: int, split: Split) -> torch.Tensor:
    """A unit's part of its HF tensor, with plain torch: every group's block, the part's
    rows of each."""
    g = split.groups
    blocks = hf.unflatten(dim, (g, split.total // g))
    return blocks.narrow(dim + 1, split.start, split.size // g).flatten(dim, dim + 1)


GROUPED_CASES = [
    ("gpt-oss gate_up [expert, hidden, 2F]", Fused(2, (("gate", 8), ("up", 8)), 8), (3, 5, 16), ()),
    ("Megatron qkv", Fused(0, (("q", 8), ("k", 4), ("v", 4)), 2), (16, 6), ()),
    ("Megatron qkv, Conv1D", Fused(0, (("q", 8), ("k", 4), ("v", 4)), 2), (6, 16), (T,)),
    ("one group", Fused(1, (("gate", 3), ("up", 3)), 1), (4, 6), ()),
    ("Megatron qkv, rope", Fused(0, (("q", 16), ("k", 8), ("v", 8)), 2), (32, 6), (ROPE8,)),
]


@settings(max_examples=80, deadline=None)
@given(k=st.integers(0, len(GROUPED_CASES) - 1), data=st.data())
def test_read_box_of_a_grouped_part_equals_the_part_by_hand(
    tmp_path_factory: pytest.TempPathFactory, k: int, data: st.DataObject
) -> None:
    """Every box of every part, read through safetensors slicing, equals the part cut
    from the whole HF tensor by hand; export's placement writes the parts back bitwise."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, fused, hf_shape_, line = GROUPED_CASES[k]
    comps = [c for c, _ in fused.components]
    order = data.draw(st.permutations(comps))
    m = HFMap((MapRule("x", "w", None, line, 0, tuple(Part(c) for c in order), True),))
    gen = torch.Generator().manual_seed(k)
    hf = torch.randn(hf_shape_, generator=gen)
    path = tmp_path_factory.mktemp("grouped") / "x.safetensors"
    save_file({"x": hf}, str(path))
    rebuilt = torch.full_like(hf, float("nan"))
    for comp, size in fused.components:
        shape = list(hf_shape(hf_shape_, line))  # the model's shape of the whole parameter
        shape[fused.at] = size
        [src] = m.sources(f"w.{comp}", tuple(shape), fused)
        assert src.split is not None and src.split.groups == fused.groups
        model = forward(_by_hand(hf, src.split.dim, src.split), src.transforms)
        assert tuple(model.shape) == tuple(shape)
        offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
        sizes = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, offsets, strict=True))
        with safe_open(str(path), framework="pt") as f:
            box = _read_box(f, "x", src.transforms, offsets, sizes, src.split)
        want = model[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        assert torch.equal(box, want), (comp, offsets, sizes)
        _place_part(rebuilt, _to_hf(model, src.transforms), src.split)
    assert torch.equal(rebuilt, hf)


class _CountingHandle:
    """A safetensors handle whose slices count the reads made through them."""

    def __init__(self, handle: object) -> None:
        self.handle, self.reads = handle, 0

    def get_slice(self, key: str) -> object:
        outer, sl = self, self.handle.get_slice(key)  # type: ignore[attr-defined]

        class Slice:
            def __getitem__(self, index: object) -> object:
                outer.reads += 1
                return sl[index]

        return Slice()


def test_an_interleaved_part_is_read_in_one_strided_slice(tmp_path: Path) -> None:
    """gpt-oss's gate of [expert, hidden, 2F] (every second column): one read per box,
    whatever F, not one per column."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    fused = Fused(2, (("gate", 64), ("up", 64)), 64)
    m = HFMap((MapRule("x", "w", grouped=True),))
    [src] = m.sources("w.up", (4, 8, 64), fused)
    hf = torch.randn(4, 8, 128)
    save_file({"x": hf}, str(tmp_path / "x.safetensors"))
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        counting = _CountingHandle(f)
        box = _read_box(counting, "x", (), (1, 0, 16), (2, 8, 32), src.split)
    assert counting.reads == 1
    assert torch.equal(box, hf[1:3, :, 33:97:2])


def test_export_tiles_grouped_parts_per_group() -> None:
    m = HFMap((MapRule("a.qkv", "w", grouped=True),))
    sources = {f"w.{c}": m.sources(f"w.{c}", (n, 6), MEGATRON)[0] for c, n in MEGATRON[1]}
    assert _written_twice(sources) == []
    del sources["w.v"]
    assert _written_twice(sources) == [
        "a.qkv: both w.k and w.q would be written under it, not as parts that tile it"
    ]
    # a grouped and a plain line under one key do not tile it either
    plain = HFMap((MapRule("a.qkv", "w"),)).sources("w.v", (4, 6), MEGATRON)[0]
    assert _written_twice({**sources, "w.v": plain}) != []


def test_dtype_kinds() -> None:
    for name, kind in [
        ("F32", "float"),
        ("BF16", "float"),
        ("F8_E4M3", "float"),
        ("I32", "int"),
        ("U8", "int"),
        ("BOOL", "bool"),
        ("float32", "float"),
        ("torch.bfloat16", "float"),
        ("float8_e4m3fn", "float"),
        ("int64", "int"),
        ("uint8", "int"),
        ("bool", "bool"),
        ("complex64", "complex"),
        ("not_a_dtype", None),
        ("f32", None),
    ]:
        assert dtype_kind(name) == kind, name
