"""Heads: :func:`shardspec.core.layout.head_cut` against a walk over every rank's shard, and
``heads`` items end to end (a Mistral-like spec linted at tp=2, 3 and 4).

The property test draws dimensions (plain, fused, grouped), head sizes per component and
meshes of up to three axes on the dimension, walks every rank's indices with
:func:`shardspec.core.layout.rank_table` (the per-rank table the compiler and the runtime use)
and checks each shard's ends against the heads, independently of ``head_cut``'s own
segment arithmetic.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardspec import cli
from shardspec.core.layout import Dim, Fusion, HeadCut, Mesh, ParamLayout, head_cut, rank_table

AXES = ("a", "b", "c")


def _on_head_boundary(dim: Dim, heads: dict[str | None, int], index: int) -> bool:
    """Whether ``index`` starts a head (or ends the dimension), read from the fusion."""
    whole = heads.get(None, 1)
    f = dim.fusion
    if f is None or index == dim.size:
        return index % whole == 0
    offset = index % f.group_size
    for name, size in f.components:
        if offset < size:
            return offset % heads.get(name, whole) == 0
        offset -= size
    raise AssertionError(index)  # pragma: no cover


def _brute_cuts(
    dim: Dim, axes: tuple[str, ...], sizes: tuple[int, ...], heads: dict[str | None, int]
) -> list[tuple[tuple[int, ...], int]]:
    """Every (rank coordinate, index) where a rank's shard starts or ends inside a head."""
    mesh = Mesh(axes, sizes)
    layout = ParamLayout((Dim(dim.name, dim.size, axes, dim.fusion),))
    out = []
    for shard in rank_table(layout, mesh):
        for a, b in shard.indices[0]:
            out += [(shard.coord, i) for i in (a, b) if not _on_head_boundary(dim, heads, i)]
    return out


def _component_of(dim: Dim, index: int) -> str | None:
    if dim.fusion is None:
        return None
    offset = index % dim.fusion.group_size
    for name, size in dim.fusion.components:
        if offset < size:
            return name
        offset -= size
    raise AssertionError(index)  # pragma: no cover


def _assert_real(
    dim: Dim, axes: tuple[str, ...], sizes: tuple[int, ...], heads: dict, cut: HeadCut
) -> None:
    """The reported cut is one: a shard at its coordinates starts at its index, which lies
    inside the head it names."""
    assert not _on_head_boundary(dim, heads, cut.index)
    assert cut.head_start < cut.index < cut.head_start + cut.head_size
    assert cut.component == _component_of(dim, cut.index)
    fixed = dict(cut.outer) | {cut.axis: cut.coord}
    mesh = Mesh(axes, sizes)
    layout = ParamLayout((Dim(dim.name, dim.size, axes, dim.fusion),))
    starts = {
        a
        for shard in rank_table(layout, mesh)
        if all(shard.coord[axes.index(k)] == v for k, v in fixed.items())
        for a, _ in shard.indices[0]
    }
    assert cut.index in starts


@st.composite
def headed_dims(draw: st.DrawFn) -> tuple[Dim, dict[str | None, int]]:
    """A dimension and its head sizes: plain, or fused (equal-size or sized components,
    optionally in groups), heads per component, for all components, or for some."""
    if draw(st.booleans()):
        head = draw(st.integers(1, 8))
        return Dim("d", head * draw(st.integers(1, 12))), {None: head}
    names = ["q", "k", "v"][: draw(st.integers(1, 3))]
    heads: dict[str | None, int] = {}
    shared = draw(st.sampled_from([None, *range(1, 6)]))
    comps = []
    for name in names:
        head = shared or draw(st.integers(1, 5))
        if shared is None and draw(st.booleans()):
            heads[name] = head
        comps.append((name, head * draw(st.integers(1, 6))))
    if shared is not None:
        heads[None] = shared
    fusion = Fusion(tuple(comps), draw(st.integers(1, 3)))
    return Dim("d", fusion.size, fusion=fusion), heads


@settings(max_examples=400, deadline=None)
@given(headed_dims(), st.lists(st.integers(1, 7), min_size=1, max_size=3))
@example((Dim("kv", 256), {None: 128}), [4])  # Mistral's 2 KV heads at tp=4
@example((Dim("q", 4096), {None: 128}), [3])  # 32 query heads at tp=3, uneven
@example((Dim("q", 10), {None: 2}), [3])  # uneven, on head boundaries
@example((Dim("q", 64), {None: 16}), [2, 4])  # the inner axis cuts
def test_head_cut_agrees_with_every_rank(
    headed: tuple[Dim, dict[str | None, int]], sizes: list[int]
) -> None:
    dim, heads = headed
    axes = AXES[: len(sizes)]
    cuts = _brute_cuts(dim, axes, tuple(sizes), heads)
    cut = head_cut(dim, axes, dict(zip(axes, sizes, strict=True)), heads)
    assert (cut is None) == (not cuts), (cut, cuts[:4])
    if cut is not None:
        _assert_real(dim, axes, tuple(sizes), heads, cut)


def test_head_cut_does_not_walk_ranks() -> None:
    """A tp of 2**40 is answered from the shard boundaries, not by visiting its ranks."""
    q = Dim("q", 1 << 50)
    assert head_cut(q, ("tp",), {"tp": 1 << 40}, {None: 128}) is None
    cut = head_cut(q, ("tp", "cp"), {"tp": 1 << 40, "cp": 3}, {None: 128})
    assert cut is not None and cut.axis == "cp"
    fused = Dim("qkv", 3 << 40, fusion=Fusion((("q", 1 << 41), ("k", 1 << 40)), 1))
    assert head_cut(fused, ("tp",), {"tp": 3 << 30}, {None: 64}) is not None
    grouped = Dim("qkv", 96 << 30, fusion=Fusion((("q", 64), ("k", 32)), 1 << 30))
    sizes = {"tp": 1 << 20, "cp": 3}  # 1024 groups per tp rank: 3072 heads over cp
    assert head_cut(grouped, ("tp", "cp"), sizes, {None: 32}) is None
    assert head_cut(grouped, ("tp", "cp"), {**sizes, "cp": 5}, {None: 32}) is not None
    # Mixed head sizes across a group's components: bounded by the group's size.
    mixed = {"q": 64, "k": 32}
    assert head_cut(grouped, ("tp", "cp"), {**sizes, "cp": 2}, mixed) is None
    cut = head_cut(grouped, ("tp", "cp"), sizes, mixed)  # 32768: group 341's q, row 32
    assert cut is not None and (cut.index, cut.component, cut.head) == (32768, "q", 341)


# ------------------------------------------------------------------------- end to end

MISTRAL = """\
# Mistral-like attention: 32 query heads and 2 KV heads of 128 (tiny hidden size).
manifest "mistral.manifest.json"

mesh over 8 ranks {
    dp_shard: *
    tp: 2
}
fsdp dp_shard

param model.layers.*.self_attn.q_proj.weight [q, hidden] {
    heads q head_dim
    shard q over tp
}
param model.layers.*.self_attn.{k,v}_proj.weight [kv, hidden] {
    heads kv head_dim
    shard kv over tp
}
param model.layers.*.self_attn.o_proj.weight [hidden, attn] {
    heads attn head_dim
    shard attn over tp
}
"""


def _mistral(tmp_path: Path) -> Path:
    entries = []
    for i in range(2):
        for proj, shape in (("q", [4096, 64]), ("k", [256, 64]), ("v", [256, 64])):
            entries.append((f"model.layers.{i}.self_attn.{proj}_proj.weight", shape))
        entries.append((f"model.layers.{i}.self_attn.o_proj.weight", [64, 4096]))
    manifest = {
        "format": "shardspec-manifest/1",
        "factory": "mistral:tiny",
        "factory_args": {"head_dim": 128},
        "entries": [
            {"fqn": f, "kind": "param", "shape": s, "dtype": "float32", "module": "linear"}
            for f, s in sorted(entries)
        ],
    }
    (tmp_path / "mistral.manifest.json").write_text(json.dumps(manifest))
    spec = tmp_path / "mistral.shard"
    spec.write_text(MISTRAL)
    return spec


def _lint(*args: str) -> tuple[int, list[dict]]:
    """``shardspec lint --format json``: the exit status and the findings."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["lint", "--format", "json", *args])
    assert "Traceback" not in err.getvalue()
    return code, json.loads(out.getvalue())


def test_mistral_lint_at_tp_2_3_4(tmp_path: Path) -> None:
    spec = str(_mistral(tmp_path))
    code, found = _lint(spec)
    assert code == 0 and found == []

    code, found = _lint(spec, "-D", "tp=4")
    assert code == 1
    assert [(f["code"], f["severity"]) for f in found] == [("SS034", "error")]
    assert "tp=4 cuts a head of 'kv' (2 heads of 128)" in found[0]["message"]
    assert "self_attn.k_proj.weight (and 3 more)" in found[0]["message"]
    assert "tp=1 or 2 keep them whole" in found[0]["hint"]

    code, found = _lint(spec, "-D", "tp=3", "-D", "world=6")
    assert code == 1
    cut = sorted(f["message"].split(": ", 1)[1] for f in found if f["code"] == "SS034")
    assert cut == [
        "tp=3 cuts a head of 'attn' (32 heads of 128): the shards of tp=0 and tp=1 (ranks 0 "
        "and 1, among others) meet at index 1366, inside head 10 (indices 1280-1407)",
        "tp=3 cuts a head of 'kv' (2 heads of 128): the shards of tp=0 and tp=1 (ranks 0 and "
        "1, among others) meet at index 86, inside head 0 (indices 0-127)",
        "tp=3 cuts a head of 'q' (32 heads of 128): the shards of tp=0 and tp=1 (ranks 0 and "
        "1, among others) meet at index 1366, inside head 10 (indices 1280-1407)",
    ]
    uneven = [f for f in found if f["code"] == "SS023"]
    assert uneven and all("cut heads (SS034)" in f["hint"] for f in uneven)
    assert not any("fine for DTensor" in f["hint"] for f in uneven)


def test_uneven_without_heads_suggests_declaring_them(tmp_path: Path) -> None:
    spec = _mistral(tmp_path)
    spec.write_text("\n".join(x for x in MISTRAL.splitlines() if "heads " not in x) + "\n")
    code, found = _lint(str(spec), "-D", "tp=3", "-D", "world=6")
    assert code == 0 and found and {f["code"] for f in found} == {"SS023"}
    assert all("declare them (`heads " in f["hint"] for f in found)


@st.composite
def headed_specs(draw: st.DrawFn) -> tuple[str, dict, list[str]]:
    """A rule with `heads` lines of any target and size (literal, factory argument, a
    config.json key, or nothing), on shapes and meshes that may not fit."""
    fused = draw(st.booleans())
    fuse = ""
    if fused:
        groups = draw(st.sampled_from(["", "2 groups of ", "3 groups of "]))
        sizes = draw(st.sampled_from(["q, k, v", "q 8, k 4, v 4", "q 16, k 8, v 8"]))
        fuse = f"    fuse d as {groups}{sizes}\n"
    items = []
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(["d", "d", "h", "q", "k", "v", "e", "x"]))
        size = draw(st.sampled_from(["0", "1", "2", "3", "4", "8", "128", "head_dim", "nope"]))
        items.append(f"{target} {size}")
    axes = draw(st.sampled_from(["tp", "(tp, cp)", "(cp, tp)", "dp", "(tp, dp)"]))
    spec = (
        'manifest "m.json"\nhf "hf.json" { w -> w }\n'
        f"mesh over {draw(st.sampled_from([1, 2, 4, 6, 8, 12]))} ranks "
        "{ dp: *  tp: 2  cp: 1 }\nfsdp dp\n"
        f"param {draw(st.sampled_from(['w', 'w', 'w', '{e}']))} [e, d, h] {{\n{fuse}"
        f"    heads {', '.join(items)}\n    shard d over {axes}\n}}\n"
    )
    manifest = {
        "format": "shardspec-manifest/1",
        "factory_args": draw(st.dictionaries(st.just("head_dim"), st.sampled_from([0, 4, "x"]))),
        "entries": [
            {
                "fqn": "w",
                "kind": "param",
                "shape": [
                    draw(st.integers(1, 4)),
                    draw(st.one_of(st.integers(0, 48), st.sampled_from([16, 32, 48, 96]))),
                    8,
                ],
                "dtype": "float32",
            }
        ],
    }
    args = []
    for axis in ("tp", "cp"):
        if draw(st.booleans()):
            args += ["-D", f"{axis}={draw(st.integers(1, 7))}", "-D", "world=84"]
    return spec, manifest, args


@settings(max_examples=150, deadline=None)
@given(headed_specs())
def test_heads_lines_never_raise(case: tuple[str, dict, list[str]]) -> None:
    spec, manifest, args = case
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "s.shard").write_text(spec)
        (root / "m.json").write_text(json.dumps(manifest))
        hf = {"format": "shardspec-hf-manifest/1", "config": {"head_dim": 8}, "tensors": {}}
        (root / "hf.json").write_text(json.dumps(hf))
        code, found = _lint(str(root / "s.shard"), *args)
    assert code in (0, 1)
    assert all(f["code"] != "SS001" for f in found)


def test_explain_says_whether_heads_stay_whole(tmp_path: Path) -> None:
    spec = str(_mistral(tmp_path))
    fqn = "model.layers.0.self_attn.k_proj.weight"
    for args, want in (
        ((), "  heads: kv 128: every shard over tp holds whole heads\n"),
        (("-D", "tp=4"), "  heads: kv 128: tp=4 cuts head 0 at index 64 (SS034)\n"),
    ):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            cli.main(["explain", spec, fqn, *args])
        assert want in out.getvalue()
