"""The runtime that executes a transfer plan (shardspec/runtime/transfer.py).

Single-process: loading a plan (a damaged or foreign file is a clear PlanError, never a
traceback: a hypothesis fuzz over mutated plans), the schedule's bounds, and send/receive
run on every rank's local tensors in one process against the plan tests' id tensors.
Multi-rank (gloo, tests/transfer_scenarios.py, one host for every round): the llama
trainer trained under FSDP2 dp_shard 2 x tp 2 sends to a tp 2 engine, a bf16 tp 2 engine
and a one-rank engine, compared bitwise with the trainer's export loaded into the engine's
layout; refused plans; a killed trainer rank.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardspec.runtime import transfer
from shardspec.runtime.transfer import PlanError, load_plan
from shardspec.transfer import plan_json, plan_transfer
from shardspec.transfer.plan import FORMAT
from tests.transfer_checks import assert_point_to_point

REPO = Path(__file__).resolve().parents[1]
LLAMA = str(REPO / "specs" / "llama.shard")


def _doc(engine_world: int, engine_tp: int, infer: str = LLAMA) -> dict[str, Any]:
    plan = plan_transfer(LLAMA, infer, {"tp": 2}, {"tp": engine_tp}, 4, engine_world)
    assert plan.status == 0, plan.diagnostics
    return json.loads(json.dumps(plan_json(plan)))


@pytest.fixture(scope="module")
def tp2() -> dict[str, Any]:
    return _doc(2, 2)


def test_format_is_the_planners() -> None:
    assert transfer.FORMAT == FORMAT


# ------------------------------------------------------------------------------ loading


def test_load_plan_reads_the_planners_json(tp2: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(tp2))
    plan = load_plan(path)
    assert (plan.senders, plan.receivers) == (4, 2)
    assert plan.fingerprint == tp2["fingerprint"]
    assert sum(m.count for m in plan.moves) == sum(
        m["count"] for t in tp2["tensors"] for m in t["moves"]
    )
    assert [plan.owned_bytes(r) for r in range(2)] == tp2["totals"]["owned"]


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.update(format="shardspec-transfer-plan/9"), "format"),
        (lambda d: d["sender"]["layout"].update(spec_sha256="0" * 64), "fingerprint"),
        (lambda d: d["receiver"]["mesh"].update(tp=4), None),  # (not in the fingerprint)
        (lambda d: d["tensors"][0]["moves"][0].update(count=7), "runs hold"),
        (lambda d: d["tensors"][0]["moves"][0].update(dst=9), "receiver 9"),
        (lambda d: d["tensors"][0].update(dtype="int8", itemsize=1), "casts"),
        (lambda d: d.pop("tensors"), "no 'tensors'"),
        (lambda d: d["tensors"][0]["moves"][0]["dims"][0].update(runs=[[0, 0, 1, 1]]), "5"),
    ],
)
def test_damaged_plan_is_refused(tp2: dict[str, Any], edit: Any, words: str | None) -> None:
    doc = copy.deepcopy(tp2)
    edit(doc)
    if words is None:
        load_plan(doc)
        return
    with pytest.raises(PlanError, match=words):
        load_plan(doc)


def test_unreadable_plan_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot be read"):
        load_plan(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "shardspec-transfer-plan/1", ')
    with pytest.raises(PlanError, match="not JSON"):
        load_plan(bad)


def _mutations(draw: Any, doc: Any, depth: int = 0) -> Any:
    """``doc`` with one value somewhere replaced by another of any JSON type."""
    if isinstance(doc, (dict, list)) and doc and depth < 8 and draw(st.booleans()):
        keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
        k = draw(st.sampled_from(keys))
        out = copy.copy(doc)
        out[k] = _mutations(draw, doc[k], depth + 1)
        return out
    return draw(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**70), 2**70),
            st.floats(allow_nan=True),
            st.text(max_size=8),
            st.lists(st.integers(-3, 3), max_size=6),
            st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
        )
    )


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_mutated_plan_is_a_plan_error_or_a_plan(tp2: dict[str, Any], data: Any) -> None:
    """Any value replaced anywhere: load_plan returns a plan or raises PlanError."""
    mutated = st.composite(lambda draw: _mutations(draw, tp2))()
    try:
        plan = load_plan(data.draw(mutated))
    except PlanError:
        return
    assert plan.senders >= 1 and plan.receivers >= 1


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(cut=st.integers(0, 10**6), junk=st.binary(max_size=16))
def test_fuzz_damaged_plan_bytes(
    tp2: dict[str, Any], cut: int, junk: bytes, tmp_path_factory: Any
) -> None:
    raw = json.dumps(tp2).encode()
    path = tmp_path_factory.mktemp("p") / "plan.json"
    path.write_bytes(raw[: cut % (len(raw) + 1)] + junk)
    try:
        load_plan(path)
    except PlanError:
        pass


# ------------------------------------------------------------------------------ in one process


def _run_in_process(plan: Any, bucket: int) -> None:
    """Every message of the runtime's schedule packed by the sender's code (``_fill``) from
    id tensors of every trainer rank and written by the receiver's (``_drain``) into empty
    engine tensors; each engine element must then hold the id its own layout puts there
    (the plan tests' torch-built local tensors)."""
    import torch

    from tests.test_transfer_plan import _ids, _locals

    doc = json.loads(json.dumps(plan_json(plan)))
    loaded = load_plan(doc)
    ids = _ids(plan.trainer)
    src = {
        r: {f: t.double() for f, t in ts.items()} for r, ts in _locals(plan.trainer, ids).items()
    }
    want = _locals(plan.engine, ids)
    got = {
        r: {f: torch.full(t.shape, -1.0, dtype=torch.float64) for f, t in ts.items()}
        for r, ts in want.items()
    }
    for t in loaded.tensors:  # ids are exact in float64; the plan's dtype is the engine's
        assert t.dtype == "float32"
    loaded.tensors = [transfer.TensorInfo(t.hf, t.src_dtype, "float64") for t in loaded.tensors]
    loaded.moves = [
        transfer.Move(
            m.tensor,
            m.src,
            m.dst,
            m.count,
            m.src_param,
            m.src_fixed,
            m.dst_param,
            m.dst_fixed,
            m.dims,
            8,
        )
        for m in loaded.moves
    ]
    rounds = loaded.schedule(bucket)
    for rnd in rounds:
        for msg in rnd:
            buf = transfer._fill(msg, src[msg.src], loaded)
            transfer._drain(msg, buf, got[msg.dst], loaded)
        sizes: dict[tuple[str, int], int] = {}
        for msg in rnd:
            for end in (("s", msg.src), ("r", msg.dst)):
                sizes[end] = sizes.get(end, 0) + msg.nbytes
        for end, n in sizes.items():  # a round over the bucket holds one message only
            assert (
                n <= bucket
                or sum(1 for m in rnd if (m.src if end[0] == "s" else m.dst) == end[1]) == 1
            )
    for r, ts in want.items():
        for f, t in ts.items():
            mapped = t >= 0
            assert torch.equal(got[r][f][mapped], t[mapped].double()), f"rank {r} {f}"


@pytest.mark.parametrize("engine", [(1, 1), (2, 2), (8, 2)], ids=["one-rank", "tp2", "dp4-tp2"])
@pytest.mark.parametrize("bucket", [64, 1 << 20])
def test_llama_in_one_process(engine: tuple[int, int], bucket: int) -> None:
    plan = plan_transfer(LLAMA, LLAMA, {"tp": 2}, {"tp": engine[1]}, 4, engine[0])
    assert plan.status == 0
    _run_in_process(plan, bucket)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(pair=st.data())
def test_property_random_pairs_in_one_process(pair: Any, tmp_path_factory: Any) -> None:
    """The plan tests' random pairs (RoPE, transposes, fused splits and joins, tp 1-4,
    FSDP or not): the runtime's packing and unpacking give every engine element its id
    (non-contiguous positions take the index path)."""
    from tests.test_transfer_plan import _pairs, pair_plan

    plan = pair_plan(pair.draw(_pairs()), tmp_path_factory)
    if plan.status != 0:
        return  # refused pairs: the plan tests check those
    _run_in_process(plan, pair.draw(st.sampled_from([16, 1 << 20])))


# ------------------------------------------------------------------------------ multi-rank


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory: Any) -> dict[str, Any]:
    """Every multi-rank round, in one host (tests/kill_harness.py): six gloo ranks."""
    from tests import transfer_scenarios as ts
    from tests.kill_harness import run_rounds

    folder = tmp_path_factory.mktemp("transfer")
    plans, owned = {}, {}
    bf16 = folder / "bf16"
    bf16.mkdir()
    for name in ("llama.shard", "llama.hf.json"):
        (bf16 / name).write_bytes((REPO / "specs" / name).read_bytes())
    manifest = (REPO / "specs" / "llama.manifest.json").read_text()
    (bf16 / "llama.manifest.json").write_text(manifest.replace('"float32"', '"bfloat16"'))
    for name, doc in (
        ("tp2", _doc(2, 2)),
        ("one", _doc(1, 1)),
        ("bf16", _doc(2, 2, str(bf16 / "llama.shard"))),
    ):
        plans[name] = str(folder / f"{name}.json")
        owned[name] = doc["totals"]["owned"]
        Path(plans[name]).write_text(json.dumps(doc))
    stale = _doc(2, 2)
    stale["sender"]["layout"]["spec_sha256"] = "0" * 64  # a plan of another trainer spec
    stale["fingerprint"] = transfer._fingerprint(
        stale["sender"]["layout"], stale["receiver"]["layout"]
    )
    plans["stale"] = str(folder / "stale.json")
    Path(plans["stale"]).write_text(json.dumps(stale))
    plans["damaged"] = str(folder / "damaged.json")
    Path(plans["damaged"]).write_text(Path(plans["tp2"]).read_text()[:-40])
    small = 4096  # several rounds
    cases = {
        "tp2": {"plan": plans["tp2"], "engine": "tp2", "bucket": small, "export": True},
        "one": {
            "plan": plans["one"],
            "engine": "one",
            "bucket": 1 << 20,
            "export": True,
            "runtime": True,  # runtime.transfer's functions with spec=; the others: layout's
        },
        "bf16": {
            "plan": plans["bf16"],
            "engine": "tp2",
            "bucket": small,
            "export": True,
            "dtype": "bfloat16",
        },
        "stale": {"plan": plans["stale"], "engine": "tp2", "bucket": small},
        "damaged": {
            "plan": plans["tp2"],
            "engine": "tp2",
            "bucket": small,
            "plan_on": {5: plans["damaged"]},
        },
        "killed": {
            "plan": plans["tp2"],
            "engine": "tp2",
            "bucket": small,
            "victim": 1,
            "die_at": 2,
            "timeout": 8.0,
            "linger": 12.0,
        },
    }
    for name in cases:
        (folder / "runs" / name).mkdir(parents=True)
    rounds = [
        (name, ts.transfer_round, (str(folder / "runs" / name), case))
        for name, case in cases.items()
    ]
    (folder / "runs" / "interop").mkdir(parents=True)
    rounds.insert(0, ("interop", ts.interop_round, (str(folder / "runs" / "interop"), {})))
    results = run_rounds(6, rounds, timeout=400, pg_timeout=120)
    results["owned"] = owned
    return results


def _ranks(results: dict[str, Any], name: str) -> dict[int, dict[str, Any]]:
    out = {}
    for r, (status, value) in results[name]["ranks"].items():
        assert status == "ok", f"{name}: rank {r}: {status} {value}"
        out[r] = value
    return out


@pytest.mark.parametrize("name", ["tp2", "one", "bf16"])
def test_engine_equals_the_trainers_export(dist_results: dict[str, Any], name: str) -> None:
    """Every engine parameter equals, bitwise, the trainer's export_hf loaded into the
    engine's layout by load_hf (cast to bf16 with torch for the bf16 engine); each engine
    rank received exactly the bytes it owns; one all_reduce to validate and one to close,
    no other collective (no all-gather, no broadcast, no DTensor redistribution)."""
    ranks = _ranks(dist_results, name)
    engines = [4] if name == "one" else [4, 5]
    owned = dist_results["owned"][name]
    for r, v in ranks.items():
        if r not in engines and r >= 4:
            continue
        assert_point_to_point(v, r, r in engines)
        if r in engines:
            assert v["stats"].received_bytes > 0
    assert [ranks[r]["stats"].received_bytes for r in engines] == owned
    assert sum(ranks[r]["stats"].sent_bytes for r in range(4)) == sum(owned)


@pytest.mark.parametrize("name", ["stale", "damaged"])
def test_refused_on_every_rank_before_any_byte(dist_results: dict[str, Any], name: str) -> None:
    """A plan of another trainer spec (its spec sha256 is not the compiled module's), or
    a damaged plan file on one engine rank only: every rank raises TransferError, nothing
    changed anywhere, no engine marked stale, and only the validation all_reduce ran."""
    ranks = _ranks(dist_results, name)
    assert sorted(ranks) == list(range(6))
    for r, v in ranks.items():
        assert v["error"] is not None and "UNEXPECTED" not in v["error"], (r, v["error"])
        assert "before any byte moved" in v["error"], v["error"]
        assert v["changed"] == [] and not v["stale"], (r, v)
    if name == "stale":
        assert "another trainer spec" in ranks[0]["error"]
        assert "group rank" in ranks[4]["error"] and "refused" in ranks[4]["error"]
    else:
        assert (
            "damaged or not a transfer plan" in ranks[5]["error"] or "not JSON" in ranks[5]["error"]
        )
        assert "group rank 5 (engine rank 1) refused" in ranks[0]["error"]


def test_killed_trainer_rank(dist_results: dict[str, Any]) -> None:
    """Trainer rank 1 dies before round 2: every survivor raises TransferError within
    the bound (timeout 8 s per wait), the engines are marked stale, and every survivor's
    error names the dead rank (the survivors check in through the group's store)."""
    results = dist_results["killed"]["ranks"]
    assert 1 not in results  # the victim left no result
    for r in (0, 2, 3, 4, 5):
        error = results[r][1]["error"]
        assert (
            "Not answering after the failure (dead or hung): group rank 1 (trainer rank 1)" in error
        ), (r, error)


def test_packing_copies_blocks_without_an_index_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused gate/up rows of a tp 2 trainer -> tp 2 engine move are two runs: each
    block is copied straight between a view and the buffer, with no index tensor and no
    intermediate copy; past MAX_BLOCKS the index path gives the same elements."""

    def no_index(self: Any) -> Any:
        raise AssertionError("a move of few blocks went through an index gather")

    plan = plan_transfer(LLAMA, LLAMA, {"tp": 2}, {"tp": 2}, 4, 2)
    with monkeypatch.context() as m:
        m.setattr(transfer._View, "index", no_index)
        _run_in_process(plan, 1 << 20)
    monkeypatch.setattr(transfer, "MAX_BLOCKS", 0)  # every move by index
    _run_in_process(plan, 1 << 20)


@pytest.mark.parametrize("engine", ["tp2", "one"])
def test_standin_engine_from_get_sharding_and_local_view(
    dist_results: dict[str, Any], engine: str
) -> None:
    """A stand-in engine (tests/transfer_scenarios.py: interop_round) that knows nothing of
    shardspec but layout.hf_names/get_sharding/local_view plans its own M-to-N moves from
    both sides' declarations and moves the bytes with local views, into a tp 2 engine and
    into a one-rank engine: every engine parameter equals, bitwise, the trainer's full
    tensors cut by torch into the engine's layout; each engine rank received exactly the
    bytes it holds, and nothing but point-to-point ran."""
    ranks = {r: v[engine] for r, v in _ranks(dist_results, "interop").items()}
    engines = [4, 5] if engine == "tp2" else [4]
    assert ranks[0]["moves"] > 0
    for r in engines:
        assert ranks[r]["mismatch"] == [], ranks[r]["mismatch"]
        assert ranks[r]["received"] == ranks[r]["owned"] > 0
    for v in ranks.values():
        assert set(v["calls"]) <= {"batch_isend_irecv", "isend", "irecv"}, v["calls"]
    assert sum(ranks[r]["sent"] for r in range(4)) == sum(ranks[r]["owned"] for r in engines)
