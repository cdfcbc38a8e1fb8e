"""``shardspec transfer``: the plan between a trainer spec and an engine spec.

The plan is checked by executing it with torch on id tensors: every element of every HF
tensor carries its own id; each side's local tensors are cut from the model's tensors that
torch builds from the HF tensors (``.t()`` for transpose, a view/transpose for the RoPE
permutation, ``cat`` for fused components: not the planner's own index arithmetic); the
plan's moves copy from the trainer's local tensors into empty engine tensors. Every
engine element must be written exactly once, with the id the engine's own layout puts
there.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shardspec import cli
from shardspec.core.hfmap import Source, Transform, fused_of, unit_names
from shardspec.core.layout import local_indices
from shardspec.core.transfer import runs_of
from shardspec.transfer import plan_json, plan_transfer
from shardspec.transfer.plan import Plan, Side
from shardspec.transfer.report import balance
from tests.mutations import mutated

REPO = Path(__file__).resolve().parents[1]
LLAMA = str(REPO / "specs" / "llama.shard")
TRAIN = {"world": 4, "tp": 2}  # dp_shard 2 x tp 2


# ----------------------------------------------------------------------- the owner's tensors


def _rope(x: torch.Tensor, n: int) -> torch.Tensor:
    """HF rotate-half rows -> interleaved rows, per head of ``n`` (torchtitan's permute)."""
    rest = x.shape[1:]
    return x.reshape(-1, 2, n // 2, *rest).transpose(1, 2).reshape(x.shape)


# What an engine's padding rows hold in the owner's tensors (a unit the hf block keeps,
# and so no plan sends, holds -1): ids are >= 0, so neither is ever an element's id.
PADDING = -2


def _pad(t: torch.Tensor, pad: Transform, sizes: Mapping[str, int]) -> torch.Tensor:
    """``t`` grown along ``pad.dim`` to the multiple (times its axes' sizes) with
    :data:`PADDING` rows, as the engine pads its vocabulary (vLLM's ``pad_vocab_size``)."""
    multiple = pad.multiple * math.prod(sizes[a] for a in pad.axes)
    shape = list(t.shape)
    shape[pad.dim] = -(-t.shape[pad.dim] // multiple) * multiple - t.shape[pad.dim]
    return torch.cat([t, torch.full(shape, PADDING, dtype=t.dtype)], dim=pad.dim)


def _transformed(t: torch.Tensor, tr: Transform, sizes: Mapping[str, int]) -> torch.Tensor:
    """One HF -> model transform applied with torch, by kind."""
    if tr.kind == "transpose":
        return t.t()
    if tr.kind == "rope":
        return _rope(t, tr.head_dim)
    assert tr.kind == "pad", tr
    return _pad(t, tr, sizes)


def _unit(
    ids: dict[str, torch.Tensor], src: Source, sizes: Mapping[str, int] | None = None
) -> torch.Tensor:
    """A storage unit built from the HF id tensors with torch (``sizes``: the mesh's, for
    pads whose multiple names axes)."""
    parts = [ids[k] for k in src.keys]
    if src.split is not None:
        sp = src.split
        cut = []
        for t in parts:
            g = t.movedim(sp.dim, 0)
            g = g.reshape(sp.groups, sp.total // sp.groups, *g.shape[1:])
            g = g[:, sp.start : sp.start + sp.size // sp.groups].reshape(sp.size, *g.shape[2:])
            cut.append(g.movedim(0, sp.dim))
        parts = cut
    out = []
    for t in parts:
        for tr in src.transforms:
            t = _transformed(t, tr, sizes or {})
        out.append(t)
    return torch.stack(out) if src.stacked else out[0]


def _locals(side: Side, ids: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's local tensors (id values), by parameter."""
    res, hfmap = side.res, side.hfmap
    out: dict[int, dict[str, torch.Tensor]] = {}
    for fqn, m in res.stored:
        layout, mesh = m.layout, res.mesh_for(m)
        assert layout is not None and mesh is not None
        fused = fused_of(layout.dims)
        full = torch.full(layout.shape, -1, dtype=torch.int64)
        for name, shape in unit_names(fqn, layout.dims, ()):
            if hfmap.kept(name):  # not in the HF checkpoint: not transferred (stays -1)
                continue
            (src,) = hfmap.sources(name, shape, fused)
            unit = _unit(ids, src, dict(zip(mesh.names, mesh.sizes, strict=True)))
            assert tuple(unit.shape) == tuple(shape), (name, unit.shape, shape)
            if fused is None:
                full.copy_(unit)
                continue
            fusion = layout.dims[fused.at].fusion
            assert fusion is not None
            comp = name.rpartition(".")[2]
            chunks = unit.movedim(fused.at, 0).chunk(fusion.groups)
            for (a, b), c in zip(fusion.component_ranges(comp), chunks, strict=True):
                full.movedim(fused.at, 0)[a:b] = c
        for rank in range(mesh.world):
            held = local_indices(layout, mesh, mesh.coord_of(rank))
            idx = [
                torch.tensor([i for a, b in r for i in range(a, b)], dtype=torch.long) for r in held
            ]
            out.setdefault(rank, {})[fqn] = full[torch.meshgrid(*idx, indexing="ij")]
    return out


def _ids(side: Side) -> dict[str, torch.Tensor]:
    ids, start = {}, 0
    for key in sorted(side.tensors):
        shape = side.tensors[key].shape
        n = int(torch.tensor(shape).prod()) if shape else 1
        ids[key] = torch.arange(start, start + n).reshape(shape)
        start += n
    return ids


def _positions(runs: list[list[int]], src: bool) -> list[int]:
    out = []
    for s, d, n, ss, ds in runs:
        a, step = (s, ss) if src else (d, ds)
        out += [a + i * step for i in range(n)]
    return out


def _index(ndim: int, fixed: list[list[int]], dims: list[tuple[int, list[int]]]) -> tuple:
    """Advanced indices selecting ``fixed`` positions and the product of ``dims`` (local
    dim, positions), the result in the order of ``dims``."""
    k = len(dims)
    idx: list[Any] = [None] * ndim
    for d, p in fixed:
        idx[d] = torch.tensor([p]).reshape([1] * k)
    for j, (d, pos) in enumerate(dims):
        shape = [1] * k
        shape[j] = -1
        idx[d] = torch.tensor(pos, dtype=torch.long).reshape(shape)
    return tuple(idx)


Moved = tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict[str, torch.Tensor]], list[int]]


def apply_moves(doc: dict[str, Any], src: dict[int, dict[str, torch.Tensor]], want: Any) -> Moved:
    """A plan's moves (``doc``, as the runtime reads it) applied with torch from the trainer
    ranks' local tensors ``src`` to -1 tensors shaped like ``want``'s (engine rank ->
    parameter -> tensor): (the values written, how many times each element was written,
    the bytes each engine rank received)."""
    got = {r: {f: torch.full_like(t, -1) for f, t in ts.items()} for r, ts in want.items()}
    times = {r: {f: torch.zeros_like(t) for f, t in ts.items()} for r, ts in want.items()}
    received = [0] * len(want)
    for t in doc["tensors"]:
        for m in t["moves"]:
            s = src[m["src"]][m["src_param"]]
            sidx = _index(
                s.dim(),
                m["src_fixed"],
                [(d["src_dim"], _positions(d["runs"], True)) for d in m["dims"]],
            )
            data = s[sidx]
            assert data.numel() == m["count"]
            g, n = got[m["dst"]][m["dst_param"]], times[m["dst"]][m["dst_param"]]
            didx = _index(
                g.dim(),
                m["dst_fixed"],
                [(d["dst_dim"], _positions(d["runs"], False)) for d in m["dims"]],
            )
            g[didx] = data
            n.index_put_(didx, torch.ones_like(data), accumulate=True)
            received[m["dst"]] += m["count"] * t["itemsize"]
    return got, times, received


def execute(plan: Plan, doc: dict[str, Any] | None = None) -> int:
    """Run the plan (or ``doc``, its moves as the runtime reads them, changed by a test) on
    id tensors; assert every engine element is written once, rightly, and no padding
    element at all. Returns the number of padding elements (over every engine rank) the
    plan left alone."""
    assert plan.trainer is not None and plan.engine is not None
    if doc is None:
        doc = json.loads(json.dumps(plan_json(plan)))  # what the runtime reads
    ids = _ids(plan.trainer)
    want = _locals(plan.engine, ids)
    assert len(want) == plan.engine.mesh.world
    got, times, received = apply_moves(doc, _locals(plan.trainer, ids), want)
    padding = 0
    elements = 0
    owned = [0] * plan.engine.mesh.world
    dtypes = {f: m.entry.dtype for f, m in plan.engine.res.stored}
    for r, ts in want.items():
        for f, t in ts.items():
            mapped = t >= 0  # (a unit the hf block keeps is not in the plan)
            pad = t == PADDING  # the engine's padding: no plan reads or writes it
            assert not times[r][f][pad].any(), f"rank {r} {f}: padding written"
            padding += int(pad.sum())
            assert torch.equal(times[r][f], mapped.long()), f"rank {r} {f}: written {times[r][f]}"
            assert torch.equal(got[r][f], t.masked_fill(pad, -1)), f"rank {r} {f}"
            elements += int(mapped.sum())
            owned[r] += int(mapped.sum()) * getattr(torch, dtypes[f]).itemsize
    assert sum(m["count"] for t in doc["tensors"] for m in t["moves"]) == elements
    assert received == plan.received == plan.owned == owned
    assert plan.wire_bytes == plan.engine_bytes == sum(received)
    return padding


# ------------------------------------------------------------------------------ llama


@pytest.mark.parametrize(
    "engine",
    [{"world": 1, "tp": 1}, {"world": 2, "tp": 2}, {"world": 8, "tp": 2}],
    ids=["one-rank", "tp2", "dp4-tp2"],
)
def test_llama_to_engine_every_element_once(engine: dict[str, int]) -> None:
    """The llama spec (fused wqkv with RoPE, fused w13) at dp_shard 2 x tp 2 to itself on
    other meshes: every engine element arrives once, from the right HF element."""
    plan = _plan(LLAMA, LLAMA, TRAIN, engine)
    assert plan.status == 0, plan.diagnostics
    execute(plan)


def test_replicated_trainer_balances_senders(tmp_path: Path) -> None:
    """dp_replicate 2 x dp_shard 2 x tp 2: every element has two replicas or more (norms
    four); the greedy least-loaded choice spreads the bytes over all eight senders, where
    always taking the first replica would leave half of them idle (balance 2.0)."""
    for name in ("llama.manifest.json", "llama.hf.json"):
        (tmp_path / name).write_bytes((REPO / "specs" / name).read_bytes())
    text = (REPO / "specs" / "llama.shard").read_text(encoding="utf-8")
    assert "    dp_shard: *" in text
    text = text.replace("    dp_shard: *", "    dp_replicate: 2\n    dp_shard: *", 1)
    (tmp_path / "llama.shard").write_text(text, encoding="utf-8")
    plan = _plan(str(tmp_path / "llama.shard"), LLAMA, {}, {"world": 2, "tp": 2})
    assert plan.status == 0, plan.diagnostics
    assert plan.trainer is not None and plan.trainer.mesh.sizes == (2, 2, 2)
    execute(plan)
    assert all(n > 0 for n in plan.sent) and len(plan.sent) == 8
    assert balance(plan.sent) <= 1.05, plan.sent


def test_pipeline_trainer_each_stage_sends_its_layers(tmp_path: Path) -> None:
    """The llama pipeline spec (pp 2 x dp_shard 2 x tp 2) given the llama hf block, to a
    tp 2 engine: every rank of both stages sends (its stage's layers), and every engine
    element arrives once."""
    (tmp_path / "llama_pp.manifest.json").write_bytes(
        (REPO / "specs" / "llama_pp.manifest.json").read_bytes()
    )
    llama = (REPO / "specs" / "llama.shard").read_text(encoding="utf-8")
    hf = llama[llama.index('hf "llama.hf.json" {') :].replace('hf "llama.hf.json" {', "hf {")
    hf = "\n".join(ln for ln in hf.splitlines() if not ln.strip().startswith("config "))
    text = (REPO / "specs" / "llama_pp.shard").read_text(encoding="utf-8") + "\n" + hf + "\n"
    spec = tmp_path / "llama_pp.shard"
    spec.write_text(text, encoding="utf-8")
    plan = _plan(str(spec), str(spec), {}, {"world": 2, "pp": 1})
    assert plan.status == 0, plan.diagnostics
    assert plan.trainer is not None and plan.trainer.mesh.sizes == (2, 2, 2)
    execute(plan)
    assert all(n > 0 for n in plan.sent), plan.sent
    layers = {int(t.key.split(".")[2]) for t in plan.tensors if t.key.startswith("model.layers.")}
    assert layers == {0, 1, 2, 3}


def _plan(train: str, infer: str, ts: dict[str, int], es: dict[str, int]) -> Plan:
    ts, es = dict(ts), dict(es)
    return plan_transfer(train, infer, ts, es, ts.pop("world", None), es.pop("world", None))


# ------------------------------------------------------------------------------ findings

SPEC = """
manifest "m.json"
mesh over {world} ranks {{ dp: *  tp: {tp} }}
{fsdp}
param w.weight [rows, cols] {{
    {fuse}
    {shard}
}}
param n.weight [cols] {{}}
hf {{
{lines}
}}
"""


def _write(folder: Path, manifest: dict[str, list[int]], **fmt: Any) -> str:
    from shardspec.inputs.manifest import dump_manifest

    folder.mkdir(parents=True, exist_ok=True)
    entries = [
        {"fqn": f, "kind": "param", "shape": s, "dtype": fmt.pop(f"dtype_{f}", "float32")}
        for f, s in manifest.items()
    ]
    (folder / "m.json").write_text(dump_manifest(entries, "tests:model"), encoding="utf-8")
    fmt.setdefault("fuse", "")
    fmt.setdefault("fsdp", "")
    fmt.setdefault("shard", "shard rows over tp")
    fmt.setdefault("world", 2)
    fmt.setdefault("tp", 2)
    (folder / "spec.shard").write_text(SPEC.format(**fmt).lstrip(), encoding="utf-8")
    return str(folder / "spec.shard")


PLAIN = "    w.proj -> w.weight\n    n.proj -> n.weight"


def test_mismatched_pair_is_refused_with_located_findings(tmp_path: Path) -> None:
    train = _write(tmp_path / "t", {"w.weight": [8, 4], "n.weight": [4]}, lines=PLAIN)
    lines = "    w.proj -> w.weight\n    n.proj2 -> n.weight"
    infer = _write(tmp_path / "e", {"w.weight": [8, 6], "n.weight": [4]}, lines=lines)
    plan = _plan(train, infer, {}, {})
    assert plan.status == 1 and not plan.tensors
    got = sorted((d.code, Path(d.span.file).parent.name, d.span.line) for d in plan.diagnostics)
    # the engine's lines: w.proj (line 10) another shape, n.proj2 (11) not produced; the
    # trainer's n.proj (11) unread (a warning)
    assert got == [("SS124", "e", 11), ("SS125", "e", 10), ("SS129", "t", 11)], got
    hints = {d.code: d.hint for d in plan.diagnostics}
    assert "n.proj" in hints["SS124"]


def test_dtype_that_cannot_be_cast(tmp_path: Path) -> None:
    manifest = {"w.weight": [8, 4], "n.weight": [4]}
    train = _write(tmp_path / "t", manifest, lines=PLAIN)
    infer = _write(tmp_path / "e", manifest, lines=PLAIN, **{"dtype_n.weight": "int8"})
    plan = _plan(train, infer, {}, {})
    assert [(d.code, d.span.line) for d in plan.diagnostics] == [("SS126", 11)]
    ok = _write(tmp_path / "b", manifest, lines=PLAIN, **{"dtype_n.weight": "bfloat16"})
    plan = _plan(train, ok, {}, {})
    assert plan.status == 0 and plan.diagnostics == []
    # bytes per element from the engine's dtype: norm at 2 bytes on both engine ranks
    assert plan.owned == [8 * 4 * 4 // 2 + 4 * 2, 8 * 4 * 4 // 2 + 4 * 2]
    execute_ok = next(t for t in plan.tensors if t.key == "n.proj")
    assert execute_ok.itemsize == 2 and execute_ok.src_dtype == "float32"


def test_spec_without_hf_block(tmp_path: Path) -> None:
    train = _write(tmp_path / "t", {"w.weight": [8, 4], "n.weight": [4]}, lines=PLAIN)
    spec = Path(train).read_text(encoding="utf-8")
    other = tmp_path / "e"
    other.mkdir()
    (other / "m.json").write_text((tmp_path / "t" / "m.json").read_text(), encoding="utf-8")
    (other / "spec.shard").write_text(spec.split("hf {")[0], encoding="utf-8")
    plan = _plan(train, str(other / "spec.shard"), {}, {})
    assert [d.code for d in plan.diagnostics] == ["SS128"] and plan.status == 1


STACKED = """
manifest "m.json"
mesh over {world} ranks {{ a: *  b: {b} }}
param e.weight [x, rows, cols] {{
    {shard}
}}
hf {{
    experts.{{x}}.proj -> e.weight[x]{tail}
}}
"""


@pytest.mark.parametrize(
    ("train", "engine"),
    [
        ({"world": 2, "b": 2, "shard": "shard x over b"}, {"world": 1, "b": 1, "shard": ""}),
        (
            {"world": 4, "b": 2, "shard": "shard x over a\n    shard rows over b"},
            {"world": 2, "b": 2, "shard": "shard cols over b", "tail": " transpose"},
        ),
    ],
    ids=["ep2-to-one", "ep-tp-to-transposed-tp"],
)
def test_stacked_experts(train: dict[str, Any], engine: dict[str, Any], tmp_path: Path) -> None:
    """Experts stacked in one parameter (a `[x]` map line: one HF tensor per expert), moved
    between expert and tensor parallel layouts; the engine stores them transposed."""
    from shardspec.inputs.manifest import dump_manifest

    paths = []
    for name, fields in (("t", train), ("e", engine)):
        folder = tmp_path / name
        folder.mkdir()
        shape = [4, 6, 4] if "tail" not in fields else [4, 4, 6]
        entries = [{"fqn": "e.weight", "kind": "param", "shape": shape, "dtype": "float32"}]
        (folder / "m.json").write_text(dump_manifest(entries, "tests:model"), encoding="utf-8")
        text = STACKED.format(**{"tail": "", **fields}).lstrip()
        (folder / "spec.shard").write_text(text, encoding="utf-8")
        paths.append(str(folder / "spec.shard"))
    plan = _plan(paths[0], paths[1], {}, {})
    assert plan.status == 0, plan.diagnostics
    assert len(plan.tensors) == 4
    execute(plan)


# ------------------------------------------------------------------------------ property


@st.composite
def _pairs(draw: Any) -> dict[str, Any]:
    """A 2-D weight and a norm, each side with its own mesh (tp 1-4, with or without FSDP
    over dp), its own dimension over tp, and its own way of holding the weight: fused
    (components x and y) or not, with RoPE, transposes and split lines, under HF names
    the pair shares: ``separate`` (x.proj and y.proj; an unfused side has only x),
    ``joined`` (xy.proj, x then y) or ``grouped`` (xy.proj in 2 groups of x then y)."""
    heads = draw(st.sampled_from([2, 4]))
    rows = heads * draw(st.integers(1, 3)) * 2
    cols = draw(st.integers(1, 6))
    naming = draw(st.sampled_from(["separate", "joined", "grouped"]))

    def side() -> dict[str, Any]:
        tp = draw(st.integers(1, 4))
        fused = draw(st.booleans())
        rope = f" rope {heads}" if draw(st.booleans()) else ""
        t = draw(st.booleans()) and naming == "separate"
        groups = draw(st.booleans())
        if naming == "separate":
            x = "x.proj -> w.weight" + (".x" if fused else "") + rope
            lines = [x] + ([f"y.proj -> w.weight.y{' transpose' if t else ''}"] if fused else [])
        elif not fused:
            lines = [f"xy.proj -> w.weight{rope}"]
        else:
            grouped = " grouped" if naming == "grouped" else ""
            parts = f" as x{rope}, y" if rope or draw(st.booleans()) else ""
            lines = [f"xy.proj -> w.weight{grouped}{parts}"]
            groups = groups or naming == "grouped"
        fuse = ""
        if fused:
            fuse = (
                f"fuse rows as 2 groups of x {rows // 2}, y {rows // 2}"
                if groups
                else ("fuse rows as x, y")
            )
        shape = [2 * rows if fused or naming != "separate" else rows, cols]
        return {
            "tp": tp,
            "world": tp * draw(st.integers(1, 2)),
            "fused": fused,
            "t": t,
            "fuse": fuse,
            "fsdp": "fsdp dp" if draw(st.booleans()) else "",
            "shard": f"shard {draw(st.sampled_from(['rows', 'cols']))} over tp",
            "lines": "\n".join("    " + ln for ln in [*lines, "n.proj -> n.weight"]),
            "shape": shape,
        }

    return {"rows": rows, "cols": cols, "naming": naming, "a": side(), "b": side()}


def pair_plan(pair: dict[str, Any], tmp_path_factory: Any) -> Plan:
    """The plan of a :func:`_pairs` pair, its two specs written to fresh folders."""
    paths = []
    for n, s in enumerate((pair["a"], pair["b"])):
        fields = {k: s[k] for k in ("lines", "fuse", "world", "tp", "fsdp", "shard")}
        manifest = {"w.weight": s["shape"], "n.weight": [pair["cols"]]}
        paths.append(_write(tmp_path_factory.mktemp(f"s{n}"), manifest, **fields))
    return _plan(paths[0], paths[1], {}, {})


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pair=_pairs())
def test_property_every_element_exactly_once(pair: Any, tmp_path_factory: Any) -> None:
    """Random pairs: the plan executes to every engine element once, with the element the
    engine's own layout holds there (or the pair is refused where the names or shapes
    disagree)."""
    a, b = pair["a"], pair["b"]
    plan = pair_plan(pair, tmp_path_factory)
    if any(not d.code.startswith("SS12") for d in plan.diagnostics):
        assert plan.status == 1  # a spec lint refuses on its own (a fused dim over tp 3)
        return
    separate = pair["naming"] == "separate"
    a_f, b_f = a["fused"] and separate, b["fused"] and separate
    square = pair["rows"] == pair["cols"]
    if (b_f and not a_f) or (a_f and b_f and a["t"] != b["t"] and not square):
        # the engine reads y, which the trainer lacks, or y's HF shape differs: refused
        assert plan.status == 1 and {d.code for d in plan.diagnostics} & {"SS124", "SS125"}
        return
    # (a trainer with y and an engine without: y is not sent, a warning)
    assert [d.code for d in plan.diagnostics] == (["SS129"] if a_f and not b_f else [])
    assert plan.status == 0, [str(d.message) for d in plan.diagnostics]
    execute(plan)


# ------------------------------------------------------------------------------ runs


def test_runs_of_strides() -> None:
    assert runs_of([(0, 0), (1, 1), (2, 2)]) == ((0, 0, 3, 1, 1),)
    assert runs_of([(0, 0), (2, 1), (4, 2), (1, 3)]) == ((0, 0, 3, 2, 1), (1, 3, 1, 1, 1))
    assert runs_of([]) == ()


# ------------------------------------------------------------------------------ CLI


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_cli_text_json_and_plan_file(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    rc, stdout, err = _cli(
        [
            "transfer",
            LLAMA,
            LLAMA,
            "--train-D",
            "world=4",
            "--infer-D",
            "world=2",
            "--infer-D",
            "tp=2",
            "--plan",
            str(out),
        ]
    )
    assert rc == 0, err
    assert "balance (max/mean bytes sent per trainer rank)" in stdout
    assert "1.00x" in stdout and f"wrote {out}" in stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "shardspec-transfer-plan/1"
    assert doc["sender"]["mesh"] == {"dp_shard": 2, "tp": 2}
    assert doc["receiver"]["mesh"] == {"dp_shard": 1, "tp": 2}
    assert doc["totals"]["wire_bytes"] == doc["totals"]["engine_bytes"]
    one = ["--infer-D", "world=1", "--infer-D", "tp=1"]
    rc, stdout, _ = _cli(
        ["transfer", LLAMA, LLAMA, "--train-D", "world=4", *one, "--format", "json"]
    )
    again = json.loads(stdout)
    assert rc == 0 and again["status"] == 0 and again["diagnostics"] == []
    # deterministic, and the fingerprint follows the engine's mesh
    assert again["plan"]["fingerprint"] != doc["fingerprint"]
    rc, stdout2, _ = _cli(
        ["transfer", LLAMA, LLAMA, "--train-D", "world=4", *one, "--format", "json"]
    )
    assert stdout2 == stdout


def test_cli_errors_exit_1_and_write_nothing(tmp_path: Path) -> None:
    train = _write(tmp_path / "t", {"w.weight": [8, 4], "n.weight": [4]}, lines=PLAIN)
    infer = _write(tmp_path / "e", {"w.weight": [8, 6], "n.weight": [4]}, lines=PLAIN)
    out = tmp_path / "plan.json"
    rc, stdout, err = _cli(["transfer", train, infer, "--plan", str(out)])
    assert rc == 1 and not out.exists()
    assert "SS125" in err and "spec.shard:10:" in err and "^" in err and "hint:" in err
    rc, stdout, _ = _cli(["transfer", train, infer, "--format", "json"])
    doc = json.loads(stdout)
    assert rc == 1 and [d["code"] for d in doc["diagnostics"]] == ["SS125"]
    assert "plan" not in doc


@pytest.mark.parametrize(
    "argv",
    [
        ["transfer", LLAMA],
        ["transfer", LLAMA, LLAMA, "--train-D", "tpp=2"],
        ["transfer", LLAMA, LLAMA, "--infer-D", "tp=x"],
        ["transfer", LLAMA, "/no/such/spec.shard"],
    ],
)
def test_cli_bad_input_exit_2(argv: list[str]) -> None:
    rc, _, err = _cli(argv)
    assert rc == 2, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--train-D", "tpp=2"], "--train-D tpp: spec"),
        (["--infer-D", "tp=2", "--infer-D", "tp=4"], "--infer-D tp is given twice"),
        (["--train-D", "tp=" + "9" * 5000], "--train-D tp: number too large"),
    ],
)
def test_cli_bad_sizes_name_the_side(argv: list[str], said: str) -> None:
    """An error about a size names the option the user wrote, not lint's ``-D``."""
    rc, _, err = _cli(["transfer", LLAMA, LLAMA, *argv])
    assert rc == 2 and "error SS00" in err and said in err, err


def test_cli_unwritable_plan(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder", encoding="utf-8")
    plan = str(tmp_path / "file" / "p.json")
    rc, _, err = _cli(["transfer", LLAMA, LLAMA, "--train-D", "world=4", "--plan", plan])
    assert rc == 2 and "SS002" in err and "Traceback" not in err
    assert (tmp_path / "file").read_text(encoding="utf-8") == "not a folder"


# ------------------------------------------------------------------------------ fuzz

PIECES = [
    " transpose",
    " rope 16",
    " rope 3",
    "    tp: 4\n",
    "{i}",
    ".q",
    ".k",
    " -> ",
    "\n    drop model.norm.weight\n",
    "\n    tie model.norm.weight = lm_head.weight\n",
    "[i]",
    " grouped",
    " as q, k, v",
    "shard hidden over tp\n",
    "fuse ffn as 3 groups of gate 1, up 1\n",
    "}",
    "",
]


LLAMA_TEXT = (REPO / "specs" / "llama.shard").read_text(encoding="utf-8")
LINE_EDITS = [
    lambda ln: ln + " transpose",
    lambda ln: ln + " rope 16",
    lambda ln: ln.replace("_proj", "_prj"),
    lambda ln: "",
    lambda ln: ln.replace(".q rope", ".k rope").replace(".gate", ".up"),
    lambda ln: ln.replace("rope 16", "rope 8"),
    lambda ln: ln.replace("tp: 2", "tp: 4").replace("tp: 2", "tp: 1"),
]


@st.composite
def _edited(draw: Any) -> str:
    """The llama spec with a few of its map lines (or its tp line) edited: a transform
    added or changed, a name misspelt, a line gone."""
    lines = LLAMA_TEXT.splitlines()
    where = [i for i, ln in enumerate(lines) if " -> " in ln or "tp: 2" in ln]
    for i in draw(st.lists(st.sampled_from(where), min_size=1, max_size=3)):
        lines[i] = draw(st.sampled_from(LINE_EDITS))(lines[i])
    return "\n".join(lines) + "\n"


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    text=st.one_of(_edited(), mutated(LLAMA_TEXT, PIECES)),
    engine_world=st.sampled_from([1, 2, 4, 8]),
    fmt=st.sampled_from(["text", "json"]),
)
def test_fuzz_engine_spec_never_raises(
    text: str, engine_world: int, fmt: str, tmp_path_factory: Any
) -> None:
    """A damaged engine spec: the command answers 0, 1 or 2, never a traceback, and writes
    a plan only with 0; whatever the planner accepts executes exactly (every engine element
    once, from its own HF element)."""
    folder = tmp_path_factory.mktemp("fuzz")
    for name in ("llama.manifest.json", "llama.hf.json"):
        (folder / name).write_bytes((REPO / "specs" / name).read_bytes())
    (folder / "llama.shard").write_text(text, encoding="utf-8")
    out = folder / "plan.json"
    argv = ["transfer", LLAMA, str(folder / "llama.shard"), "--train-D", "world=4"]
    argv += ["--infer-D", f"world={engine_world}", "--plan", str(out), "--format", fmt]
    rc, stdout, err = _cli(argv)
    assert rc in (0, 1, 2), err
    event(f"status {rc}")
    assert "Traceback" not in stdout + err
    assert out.exists() == (rc == 0)
    if rc == 0:
        plan = _plan(LLAMA, str(folder / "llama.shard"), TRAIN, {"world": engine_world})
        assert plan.status == 0
        execute(plan)


# ------------------------------------------------------------------------------ padding


def _padded_pair(folder: Path, train: tuple[int, str, int], engine: tuple[int, str, int]) -> Plan:
    """The plan between two one-matrix specs (``w.weight`` [rows, 8] sharded over tp, a
    norm): each side ``(model rows, the w line's transforms, tp)``; the trainer on dp 2 x
    tp with FSDP on dp, the engine on tp alone. Each side's HF manifest holds 1100 rows."""
    from shardspec.inputs.hfmanifest import dump_hf_manifest

    hf = {
        "format": "shardspec-hf-manifest/1",
        "config": {},
        "tensors": {
            "w.proj": {"shape": [HF_ROWS, 8], "dtype": "F32", "file": "model.safetensors"},
            "n.proj": {"shape": [8], "dtype": "F32", "file": "model.safetensors"},
        },
    }
    paths = []
    for name, (rows, pad, tp) in (("t", train), ("e", engine)):
        fmt: dict[str, Any] = {"world": 2 * tp, "fsdp": "fsdp dp"} if name == "t" else {}
        path = _write(
            folder / name,
            {"w.weight": [rows, 8], "n.weight": [8]},
            lines=f"    w.proj -> w.weight{pad}\n    n.proj -> n.weight",
            **({"world": tp} | fmt),
            tp=tp,
        )
        text = Path(path).read_text(encoding="utf-8").replace("hf {", 'hf "hf.json" {')
        Path(path).write_text(text, encoding="utf-8")
        (folder / name / "hf.json").write_text(dump_hf_manifest(hf), encoding="utf-8")
        paths.append(path)
    plan = _plan(paths[0], paths[1], {}, {})
    assert plan.status == 0, plan.diagnostics
    assert plan.diagnostics == []
    (w,) = (t for t in plan.tensors if t.key == "w.proj")
    assert w.shape == (HF_ROWS, 8)
    return plan


HF_ROWS = 1100


def test_padded_engine_vocab_every_real_element_once_no_padding_sent(tmp_path: Path) -> None:
    """A trainer with an unpadded vocabulary (1100 rows, dp 2 x tp 2) to a vLLM-style
    engine whose embedding is padded to a multiple of 64 (1152 rows) and split over tp 2:
    the plan covers every real element exactly once and sends no padding (``execute``
    builds the engine's padding with torch, and checks that no move writes it)."""
    plan = _padded_pair(tmp_path, (HF_ROWS, "", 2), (1152, " pad 0 to 64", 2))
    assert execute(plan) == (1152 - HF_ROWS) * 8
    # Engine rank 1 holds rows 576..1151, 524 of them real: it receives those only.
    assert plan.received == [(576 * 8 + 8) * 4, (524 * 8 + 8) * 4]


@pytest.mark.parametrize(("tp", "rows"), [(1, 1152), (2, 1152), (4, 1280)])
def test_megatron_padded_engine_vocab_through_execute(tp: int, rows: int) -> None:
    """`pad vocab to 64 x tp` (Megatron's `make_vocab_size_divisible_by` x tp) on the
    engine, by the target rule's dimension name: 1100 rows padded to 1152 at tp 1 and 2,
    to 1280 at tp 4 (a multiple of 256); every real element once, no padding sent, and
    each engine rank receives exactly the real rows it holds."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        plan = _padded_pair(Path(tmp), (HF_ROWS, "", 2), (rows, " pad rows to 64 x tp", tp))
        assert execute(plan) == (rows - HF_ROWS) * 8
    per = rows // tp
    real = [max(0, min(per, HF_ROWS - r * per)) for r in range(tp)]
    assert plan.received == [(n * 8 + 8) * 4 for n in real]


def test_padded_trainer_vocab_to_an_unpadded_engine_reads_no_padding(tmp_path: Path) -> None:
    """The other way: a Megatron trainer whose vocabulary is padded to 64 x tp (1100 ->
    1152 rows at tp 2) to an unpadded engine at tp 2: the trainer's padding rows are never
    read (``execute`` would find the padding marker in the engine), and the engine has
    none of its own."""
    plan = _padded_pair(tmp_path, (1152, " pad rows to 64 x tp", 2), (HF_ROWS, "", 2))
    assert execute(plan) == 0
    assert plan.wire_bytes == (HF_ROWS * 8 + 2 * 8) * 4  # the norm: one copy per engine rank


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen2_to_vllm_engines_through_execute(tp: int) -> None:
    """specs/qwen2.shard to the vLLM-style engines (`pad vocab to 64` lines, replicated KV
    heads at tp 4) through ``execute``: the owner's engine tensors are built from the
    engine spec's own layout (tests/test_transfer_kvrep.py checks the same plans against
    vLLM's weight_loader slices); Qwen2's 256-row vocabulary needs no padding."""
    plan = plan_transfer(
        str(REPO / "specs" / "qwen2.shard"), str(REPO / "specs" / f"qwen2_vllm_tp{tp}.shard")
    )
    assert plan.status == 0, plan.diagnostics
    assert plan.engine is not None
    assert any(t.kind == "pad" for r in plan.engine.hfmap.rules for t in r.transforms)
    assert execute(plan) == 0


def test_execute_fails_on_a_move_into_the_padding(tmp_path: Path) -> None:
    """``execute``'s padding check can fail: the padded pair's plan with its last move to
    engine rank 1 shifted one row down (its last row lands on the first padding row)."""
    plan = _padded_pair(tmp_path, (HF_ROWS, "", 2), (1152, " pad 0 to 64", 2))
    doc = json.loads(json.dumps(plan_json(plan)))
    moves = [m for t in doc["tensors"] for m in t["moves"]]
    last = max(
        (m for m in moves if m["dst"] == 1 and m["dst_param"] == "w.weight"),
        key=lambda m: m["dims"][0]["runs"][0][1],
    )
    last["dims"][0]["runs"][0][1] += 1
    with pytest.raises(AssertionError, match=r"rank 1 w\.weight: padding written"):
        execute(plan, doc)
