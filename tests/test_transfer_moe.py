"""Weight transfers from expert-parallel and pipeline trainers (issue 24 points 3 and 6).

Planner (no torch): stacked experts under ep x dp_shard and under folded dense/expert
meshes plan to an ep 4 and a tp 2 engine (specs/deepseek_moe_engine_{ep,tp}.shard), each
engine byte once; a pipeline trainer's moves come from the ranks of the stage that holds
the layer, under the name the stage model gives it (layers renumbered per stage with
`split ... local`, a tied weight's alias on the last stage). In one process the runtime's
packing fills every engine element with its id (tests/test_transfer_runtime.py's harness).

Multi-rank (gloo, tests/transfer_moe_scenarios.py, eight ranks in one host for every
round): trained trainers send, every engine parameter equals bitwise the trainer's full
tensors cut by the engine spec's own ``parallelize``; each engine rank receives exactly
the bytes it owns; only the two all_reduces of the runtime and point-to-point ops run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from shardspec.transfer import plan_json, plan_transfer
from shardspec.transfer.plan import Plan
from tests.transfer_checks import assert_point_to_point

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "specs"
MOE = str(SPECS / "deepseek_moe.shard")
FOLDED = str(SPECS / "deepseek_moe_folded.shard")
ENGINE_EP = str(SPECS / "deepseek_moe_engine_ep.shard")
ENGINE_TP = str(SPECS / "deepseek_moe_engine_tp.shard")
TRAINERS = {"moe": (MOE, {"ep": 2}), "folded": (FOLDED, {"ep": 2, "tp": 2})}
ENGINES = {"ep4": (ENGINE_EP, 4), "moe-tp2": (ENGINE_TP, 2)}


def moe_plan(trainer: str, engine: str) -> Plan:
    path, sizes = TRAINERS[trainer]
    epath, world = ENGINES[engine]
    plan = plan_transfer(path, epath, sizes, {}, 4, world)
    assert plan.status == 0, [str(d) for d in plan.diagnostics]
    return plan


@pytest.fixture(scope="module")
def pp_gen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/test_hf_pipeline.py's compiled 4-layer Llama specs: llama4 (no pipeline),
    llama_pp_hf and llama_pp_hf_local (specs/llama_pp.shard with llama.shard's hf block)."""
    from examples.models import llama
    from tests.test_hf_pipeline import compile_specs, to_hf, write_hf

    root = tmp_path_factory.mktemp("pp")
    cfg = llama.LlamaConfig(n_layers=4)
    model = llama.tiny(n_layers=4)
    write_hf(root / "hf", to_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg), cfg)
    compile_specs(root / "gen", root / "hf")
    return root / "gen"


def pp_plan(gen: Path, trainer: str) -> Plan:
    plan = plan_transfer(
        str(gen / f"{trainer}.shard"),
        str(gen / "llama4.shard"),
        {"pp": 2, "tp": 2},
        {"tp": 2},
        4,
        2,
    )
    assert plan.status == 0, [str(d) for d in plan.diagnostics]
    return plan


# ------------------------------------------------------------------------------ planner


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_moe_plan_sends_each_engine_byte_once(trainer: str, engine: str) -> None:
    """Every engine rank receives what it owns, once; each expert's moves leave from the
    trainer ranks that hold that expert (ep coordinate, then FSDP2's shard of it)."""
    plan = moe_plan(trainer, engine)
    assert plan.received == plan.owned and all(plan.owned)
    assert plan.wire_bytes == plan.engine_bytes
    experts = [t for t in plan.tensors if ".mlp.experts." in t.key]
    assert len(experts) == 2 * 8 * 3  # layers x experts x projections, one HF tensor each
    for t in experts:
        e = int(re.search(r"experts\.(\d+)\.", t.key).group(1))  # type: ignore[union-attr]
        # 8 experts: ep rank e // 4, and within it FSDP2's shard (e % 4) // 2.
        ep, shard = e // 4, (e % 4) // 2
        want = {shard * 2 + ep} if trainer == "moe" else {ep * 2 + shard}
        assert {m.src.rank for m in t.moves} == want, (t.key, [m.src.rank for m in t.moves])
        assert all(m.src.fixed == ((0, e % 2),) for m in t.moves)  # the stacked expert's row
        if engine == "ep4":  # whole experts, 2 per engine rank
            assert {m.dst.rank for m in t.moves} == {e // 2}
            assert all(m.dst.fixed == ((0, e % 2),) for m in t.moves)
        else:  # every engine rank holds its half of every expert's ffn
            assert {m.dst.rank for m in t.moves} == {0, 1}
            assert all(m.dst.fixed == ((0, e),) for m in t.moves)


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_moe_plan_in_one_process(trainer: str, engine: str) -> None:
    from tests.test_transfer_runtime import _run_in_process

    _run_in_process(moe_plan(trainer, engine), 4096)


@pytest.mark.parametrize("trainer", ["llama_pp_hf", "llama_pp_hf_local"])
def test_pipeline_plan_sends_from_the_stage_under_its_names(pp_gen: Path, trainer: str) -> None:
    """Layers 0-1 leave from stage 0's ranks (0, 1), layers 2-3, the norm and the head
    from stage 1's (2, 3), the embedding from stage 0's; with `split ... local` stage 1
    names its layers 0 and 1 (the names its stage model has), else 2 and 3."""
    plan = pp_plan(pp_gen, trainer)
    assert plan.received == plan.owned and plan.wire_bytes == plan.engine_bytes
    local = trainer.endswith("local")
    seen = 0
    for t in plan.tensors:
        m = re.match(r"model\.layers\.(\d+)\.", t.key)
        stage = (int(m.group(1)) >= 2) if m else (t.key != "model.embed_tokens.weight")
        for mv in t.moves:
            assert mv.src.rank // 2 == stage, (t.key, mv.src.rank)
            if m:
                layer = int(m.group(1)) - 2 * stage if local else int(m.group(1))
                assert mv.src.param.startswith(f"layers.{layer}."), (t.key, mv.src.param)
                assert mv.dst.param.startswith(f"layers.{m.group(1)}."), mv.dst.param
                seen += 1
    assert seen


def test_tied_pipeline_plan_sends_the_alias_from_the_last_stage(tmp_path: Path) -> None:
    """specs/llama_pp_tied.shard plus a tied hf block: lm_head is the embedding's tie; its
    moves may leave from either stage's copy, each under the name that stage holds it."""
    from examples.models import llama
    from tests.test_hf_pipeline import compile_tied, to_hf, write_hf

    cfg = llama.LlamaConfig(n_layers=4, tie_embeddings=True)
    model = llama.tiny_tied(n_layers=4)
    write_hf(
        tmp_path / "hf", to_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg), cfg
    )
    (tmp_path / "gen").mkdir()
    compile_tied(tmp_path / "gen", tmp_path / "hf")
    plan = plan_transfer(
        str(tmp_path / "gen" / "llama_pp_tied_hf.shard"),
        str(tmp_path / "gen" / "llama_pp_tied_hf.shard"),
        {"pp": 2, "tp": 2},
        {"pp": 2, "tp": 2},
        4,
        4,
    )
    assert plan.status == 0, [str(d) for d in plan.diagnostics]
    assert plan.received == plan.owned
    names = {
        (mv.src.rank // 2, mv.src.param)
        for t in plan.tensors
        if t.key == "model.embed_tokens.weight"
        for mv in t.moves
    }
    assert names <= {(0, "tok_embeddings.weight"), (1, "output.weight")}, names
    dst = {
        (mv.dst.rank // 2, mv.dst.param)
        for t in plan.tensors
        if t.key == "model.embed_tokens.weight"
        for mv in t.moves
    }
    assert dst == {(0, "tok_embeddings.weight"), (1, "output.weight")}, dst


# ------------------------------------------------------------------------------ multi-rank


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory: pytest.TempPathFactory, pp_gen: Path) -> dict[str, Any]:
    """Every multi-rank round in one host (tests/kill_harness.py): eight gloo ranks."""
    from tests import transfer_moe_scenarios as ts
    from tests.kill_harness import run_rounds

    folder = tmp_path_factory.mktemp("xmoe")
    owned: dict[str, list[int]] = {}
    cases: dict[str, dict[str, Any]] = {}
    modules = {"moe": "deepseek_moe", "folded": "deepseek_moe_folded"}
    engines = {"ep4": "deepseek_moe_engine_ep", "moe-tp2": "deepseek_moe_engine_tp"}
    pairs: list[tuple[str, Plan, dict[str, Any]]] = []
    for trainer in ("moe", "folded"):
        for engine in ("ep4", "moe-tp2"):
            case = {
                "kind": trainer,
                "engine": engine,
                "trainer_module": modules[trainer],
                "engine_module": engines[engine],
            }
            pairs.append((f"{trainer}->{engine}", moe_plan(trainer, engine), case))
    for trainer in ("llama_pp_hf", "llama_pp_hf_local"):
        case = {
            "kind": "pp",
            "engine": "tp2",
            "trainer_module": trainer,
            "engine_module": "llama4",
            "gen": str(pp_gen),
            "local_names": trainer.endswith("local"),
        }
        pairs.append((f"{trainer}->tp2", pp_plan(pp_gen, trainer), case))
    for name, plan, case in pairs:
        path = folder / f"{name}.json"
        path.write_text(json.dumps(plan_json(plan)))
        owned[name] = plan.owned
        cases[name] = {**case, "plan": str(path), "bucket": 16384}
    # One round per trainer (kind and module), its engines one after another: the trainer
    # is trained once for all of them.
    by_trainer: dict[str, dict[str, dict[str, Any]]] = {}
    for name, case in cases.items():
        by_trainer.setdefault(name.split("->")[0], {})[name] = case
    rounds = []
    for trainer, group in by_trainer.items():
        run = folder / "runs" / trainer
        run.mkdir(parents=True)
        rounds.append((trainer, ts.transfer_rounds, (str(run), group)))
    hosted = run_rounds(8, rounds, timeout=600, pg_timeout=300)
    # each case's own record per rank; a rank's error (a traceback) under every case
    results: dict[str, Any] = {}
    for trainer, group in by_trainer.items():
        per_rank = hosted[trainer]["ranks"]
        for name in group:
            results[name] = {
                "ranks": {
                    r: (status, value[name] if status == "ok" else value)
                    for r, (status, value) in per_rank.items()
                }
            }
    results["owned"] = owned
    return results


NAMES = [
    "moe->ep4",
    "moe->moe-tp2",
    "folded->ep4",
    "folded->moe-tp2",
    "llama_pp_hf->tp2",
    "llama_pp_hf_local->tp2",
]


@pytest.mark.dist
@pytest.mark.parametrize("name", NAMES)
def test_engine_equals_the_trainers_full_tensors(dist_results: dict[str, Any], name: str) -> None:
    """Every engine parameter equals, bitwise, the trained trainer's full tensors cut into
    the engine's layout by the engine spec's parallelize; each engine rank received
    exactly the bytes it owns and the trainers sent their sum; one all_reduce to validate
    and one to close, no other collective (no all-gather, no broadcast)."""
    owned = dist_results["owned"][name]
    engines = list(range(4, 4 + len(owned)))
    ranks = {}
    for r, (status, value) in dist_results[name]["ranks"].items():
        assert status == "ok", f"{name}: rank {r}: {status} {value}"
        ranks[r] = value
    assert sorted(ranks) == list(range(8))
    for r in [*range(4), *engines]:
        assert_point_to_point(ranks[r], r, r in engines)
    assert [ranks[r]["stats"].received_bytes for r in engines] == owned
    assert sum(ranks[r]["stats"].sent_bytes for r in range(4)) == sum(owned)
