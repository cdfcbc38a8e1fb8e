"""Views (named meshes, several factorizations of one world): the language, resolution per
view, and explain. The checks' own cases are tests/checks/SS100.py ... SS108.py; the
runtime side (build_mesh, distribute, checkpoints across folds) is tests/test_views_runtime.py
and tests/test_views_dist.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from shardspec.checks.run import check
from shardspec.core.layout import LayoutError, Mesh
from shardspec.core.views import Views, coordinates, view_sizes
from shardspec.explain import Explanation, explain_facts, render_text
from shardspec.frontend.parse import parse, parse_file

FOLDED = "specs/deepseek_moe_folded.shard"
VIEWS = Views((("dense", ("fsdp", "tp")), ("expert", ("ep", "efsdp"))), ())


def test_named_meshes_parse_to_views_with_both_readers() -> None:
    text = (
        "mesh dense over 8 ranks { pp: 2  fsdp: *  tp: 2 }\n"
        "mesh expert { pp: 2  efsdp: *  ep: 2 }\nfsdp fsdp\nfsdp efsdp\n"
        "param r [e, h] { view dense }\n"
        "param view [view] { shard view over ep }\n"  # `view` is a name where no item starts
    )
    for fast in (True, False):
        spec, diags = parse(text, fast=fast)
        assert spec is not None and diags == []
        assert [m.name.text for m in spec.views if m.name] == ["dense", "expert"]
        assert spec.mesh is spec.views[0]  # the default view
        assert [f.text for f in spec.fsdps] == ["fsdp", "efsdp"]
        assert spec.rules[0].view is not None and spec.rules[0].view.text == "dense"
        assert spec.rules[1].view is None and spec.rules[1].dims[0].text == "view"
    assert parse(text, fast=True) == parse(text, fast=False)


def test_one_unnamed_mesh_is_unchanged() -> None:
    """A spec without views parses as before: no views, one fsdp, a second one SS005."""
    spec, diags = parse("mesh { a: * }\nfsdp a\nfsdp a\n")
    assert spec is not None and spec.views == () and spec.mesh is not None
    assert spec.mesh.name is None
    assert [d.code for d in diags] == ["SS005"]


def test_each_rule_is_laid_out_on_its_view(in_repo: Path) -> None:
    """The experts on the expert view (FSDP over efsdp after ep), the router on the default
    view (FSDP over fsdp), attention over tp on the dense view."""
    spec, _ = parse_file(FOLDED)
    assert spec is not None
    res, diags = check(spec)
    assert diags == []
    assert res.view_meshes == {
        "dense": Mesh(("fsdp", "tp"), (4, 2)),
        "expert": Mesh(("ep", "efsdp"), (2, 4)),
    }
    w1 = res.matches["layers.0.moe.experts.w1"]
    assert res.mesh_for(w1) == res.view_meshes["expert"]
    assert w1.layout is not None and w1.layout.dims[0].axes == ("ep", "efsdp")
    router = res.matches["layers.0.moe.router.weight"]
    assert res.mesh_for(router) == res.view_meshes["dense"]
    assert router.layout is not None and router.layout.dims[0].axes == ("fsdp",)
    wq = res.matches["layers.0.attn.wq.weight"]
    assert wq.layout is not None and wq.layout.dims[0].axes == ("tp", "fsdp")


def test_overrides_by_axis_name_resize_every_view(in_repo: Path) -> None:
    spec, _ = parse_file(FOLDED)
    assert spec is not None
    res, diags = check(spec, overrides={"ep": 4, "tp": 1}, world=4)
    assert diags == []
    assert res.view_meshes["dense"].sizes == (4, 1)
    assert res.view_meshes["expert"].sizes == (4, 1)
    # ep 4 over tp 4: every EP group's ranks hold the same tokens (SS108)
    _, diags = check(spec, overrides={"ep": 4, "tp": 4}, world=4)
    assert "SS108" in [d.code for d in diags]  # (and SS034: tp 4 cuts the kv heads)
    _, diags = check(spec, overrides={"ep": 3})
    mesh = [d for d in diags if d.code in ("SS010", "SS101")]  # (the hf block's SS073 follow)
    assert [(d.code, d.span.line) for d in mesh] == [("SS101", 15)]
    assert "view 'expert'" in mesh[0].message


def test_explain_shows_every_view_and_the_ranks_coordinates(in_repo: Path) -> None:
    x = explain_facts(FOLDED, "layers.0.moe.experts.w1", {}, None)
    assert isinstance(x, Explanation) and x.views is not None
    assert x.views.view == "expert"
    assert [(v, m.names, m.sizes, f) for v, m, f in x.views.meshes] == [
        ("dense", ("fsdp", "tp"), (4, 2), "fsdp"),
        ("expert", ("ep", "efsdp"), (2, 4), "efsdp"),
    ]
    dense, expert = Mesh(("fsdp", "tp"), (4, 2)), Mesh(("ep", "efsdp"), (2, 4))
    assert x.views.coords == tuple((r, (dense.coord_of(r), expert.coord_of(r))) for r in range(8))
    text = render_text(x)
    assert "expert: ep=2, efsdp=4; fsdp efsdp   <- this parameter's view" in text
    assert "  mesh (view expert): ep=2, efsdp=4" in text
    assert "       5  (2,1)   (1,1)" in text
    router = explain_facts(FOLDED, "layers.0.moe.router.weight", {}, None)
    assert isinstance(router, Explanation) and router.views is not None
    assert router.views.view == "dense"


def test_a_single_mesh_explains_no_views(in_repo: Path) -> None:
    x = explain_facts("specs/deepseek_moe.shard", "layers.0.moe.experts.w1", {}, None)
    assert isinstance(x, Explanation) and x.views is None
    assert "views (" not in render_text(x)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.integers(0, 2),
)
def test_view_sizes_factor_one_world(a: list[int], b: list[int], rest: int) -> None:
    """Sizes that multiply to one world resolve, a rest axis per view from the other's
    world; sizes that do not are a LayoutError, never another exception."""
    views = Views(
        (
            ("a", tuple(f"a{i}" for i in range(len(a)))),
            ("b", tuple(f"b{i}" for i in range(len(b)))),
        )
    )
    sizes: dict[str, int | None] = {f"a{i}": n for i, n in enumerate(a)}
    sizes |= {f"b{i}": n for i, n in enumerate(b)}
    if rest:
        sizes["b0"] = None
    wa = 1
    for n in a:
        wa *= n
    wb = 1
    for n in b[1:] if rest else b:
        wb *= n
    ok = (wa % wb == 0) if rest else wa == wb
    if not ok:
        with pytest.raises(LayoutError):
            view_sizes(views, sizes, None)
        return
    got = view_sizes(views, sizes, None)
    meshes = views.meshes(got)
    assert meshes["a"].world == meshes["b"].world == wa
    for r in range(wa):
        c = coordinates(views, got, r)
        assert meshes["a"].rank_of(c["a"]) == r == meshes["b"].rank_of(c["b"])


def test_views_helpers() -> None:
    assert VIEWS.all_axes == ("fsdp", "tp", "ep", "efsdp")
    assert VIEWS.default == "dense"
    shared = Views((("d", ("pp", "dp", "tp")), ("e", ("pp", "ep"))))
    assert shared.shared == ("pp",) and shared.views_of("pp") == ("d", "e")
    with pytest.raises(LayoutError, match="shared axis 'pp'"):
        view_sizes(shared, {"pp": None, "dp": 2, "tp": 2, "ep": 2}, 8)


AXES = ["pp", "dp", "fsdp", "tp", "ep", "efsdp"]


@st.composite
def folded_specs(draw: st.DrawFn) -> str:
    """Specs with views, sound or not: names repeated, unnamed meshes, shared axes in any
    place and size, fsdp statements, rules naming axes and views of any kind."""
    lines = ['manifest "m.json"']
    names = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(["dense", "expert", "dense", "v", ""]))
        axes = draw(st.lists(st.sampled_from(AXES), min_size=1, max_size=3, unique=True))
        sizes = [draw(st.sampled_from(["*", "1", "2", "4"])) for _ in axes]
        over = draw(st.sampled_from(["", "", "over 8 ranks ", "over 4 ranks "]))
        body = "  ".join(f"{a}: {s}" for a, s in zip(axes, sizes, strict=True))
        lines.append(f"mesh {name + ' ' if name else ''}{over}{{ {body} }}")
        names.append(name or "dense")
    for a in draw(st.lists(st.sampled_from(AXES), max_size=3)):
        lines.append(f"fsdp {a}")
    for w in ("experts.w", "attn.wq.weight", "router.weight"):
        items = [f"shard a over {a}" for a in draw(st.lists(st.sampled_from(AXES), max_size=2))]
        if draw(st.booleans()):
            items.append(f"view {draw(st.sampled_from([*names, 'nope']))}")
        if draw(st.booleans()):
            items.append(f"style {draw(st.sampled_from(['expert_parallel', 'colwise']))}")
        lines.append(f"param {w} [a, b] {{ {'  '.join(items)} }}")
    if draw(st.booleans()):
        lines.append("pipeline pp {\n    split layers.{i}\n}")
    return "\n".join(lines) + "\n"


@st.composite
def sound_folded_specs(draw: st.DrawFn) -> str:
    """Specs with views that compile: a shared prefix of any size, each view's own axes
    in either order, the experts on the expert view, the router on either view."""
    shared = draw(st.sampled_from(["", "pp: 2  ", "dp_replicate: 2  "]))
    tp, ep = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    dense = f"fsdp: *  tp: {tp}"
    expert = draw(st.sampled_from([f"ep: {ep}  efsdp: *", f"efsdp: *  ep: {ep}"]))
    view = draw(st.sampled_from(["dense", "expert"]))
    return (
        f'manifest "m.json"\nmesh dense over {draw(st.sampled_from([8, 16]))} ranks '
        f"{{ {shared}{dense} }}\nmesh expert {{ {shared}{expert} }}\nfsdp fsdp\nfsdp efsdp\n"
        "param experts.w [e, b] { shard e over ep  style expert_parallel }\n"
        "param attn.wq.weight [a, b] { shard a over tp  style colwise output replicate }\n"
        f"param router.weight [a, b] {{ view {view} }}\n"
    )


MANIFEST = {"attn.wq.weight": [8, 8], "experts.w": [8, 8], "router.weight": [8, 8]}


@settings(max_examples=150, deadline=None)
@given(st.one_of(folded_specs(), sound_folded_specs()))
def test_any_views_spec_lints_and_compiles_without_a_traceback(text: str) -> None:
    """Lint and compile answer every spec with views by findings or a module, never a
    traceback; a module that compiles imports and lays out every parameter at its
    defaults, each on its view's mesh."""
    import contextlib
    import importlib.util
    import io
    import tempfile

    from shardspec.cli import main
    from shardspec.inputs.manifest import dump_manifest

    entries = [
        {"fqn": f, "kind": "param", "shape": s, "dtype": "float32"} for f, s in MANIFEST.items()
    ]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "s.shard").write_text(text, encoding="utf-8")
        (root / "m.json").write_text(dump_manifest(entries, "t:m", {}), encoding="utf-8")
        for argv in (["lint"], ["compile", "-o", str(root / "out")]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = main([*argv, str(root / "s.shard")])
            assert code in (0, 1, 2) and "Traceback" not in out.getvalue(), out.getvalue()
            event(f"{argv[0]} exit {code}")
        for module in sorted((root / "out").glob("*.py")) if (root / "out").exists() else []:
            loaded = importlib.util.spec_from_file_location(f"views_{module.stem}", module)
            assert loaded is not None and loaded.loader is not None
            mod = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(mod)
            sizes = mod.SPEC.sizes()
            for fqn in MANIFEST:
                layout = mod.SPEC.layout(fqn, sizes)
                mesh = mod.SPEC.mesh_of(fqn, sizes)
                assert set(layout.axes) <= set(mesh.names)


def test_explain_heads_take_the_views_fsdp_axis(tmp_path: Path, monkeypatch) -> None:
    """A rule on the expert view whose heads only that view's FSDP axis cuts: FSDP2
    gathers them before the forward, so explain (like lint) finds no head cut."""
    from shardspec.explain.facts import HeadsVerdict
    from shardspec.inputs.manifest import dump_manifest

    entries = [{"fqn": "proj.weight", "kind": "param", "shape": [8, 8], "dtype": "float32"}]
    (tmp_path / "m.json").write_text(dump_manifest(entries, "t:m", {}), encoding="utf-8")
    (tmp_path / "s.shard").write_text(
        'manifest "m.json"\nmesh dense over 8 ranks { fsdp: *  tp: 2 }\n'
        "mesh expert { ep: 2  efsdp: * }\nfsdp fsdp\nfsdp efsdp\n"
        "param proj.weight [out, hidden] {\n    view expert\n    heads out 4\n}\n",
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    x = explain_facts("s.shard", "proj.weight", {}, None)
    assert isinstance(x, Explanation) and x.layout is not None and not x.findings
    assert x.layout.layout.dims[0].axes == ("efsdp",)
    assert [h.verdict for h in x.layout.heads] == [HeadsVerdict.UNSPLIT]
