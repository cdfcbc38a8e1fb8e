"""``tp_axes``: the axes tensor parallelism may run on are the ones some rule shards.

specs/llama.shard with sequence-parallel norms (tests/test_parallel.py's edits) and an
HSDP-style replica axis in front (`dp_replicate: 2  dp_shard: *  tp: 2`). No rule shards
over dp_replicate, so it is no tensor-parallel axis: at tp 1 parallelize used to take it
for one (the one model-parallel axis of size > 1) and put the norms' SequenceParallel (and
any caller's `styles`) on the replicas: their DTensors spanned (dp_shard, dp_replicate).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from shardspec.cli import main as shardspec_main
from shardspec.testing import Checks, run_ranks
from tests.test_parallel import _sequence_parallel

ROOT = Path(__file__).resolve().parent.parent
NAME = "llama_hsdp_sp"


def _hsdp(text: str) -> str:
    old = "mesh over 8 ranks {\n    dp_shard: *"
    assert text.count(old) == 1, "specs/llama.shard changed"
    return text.replace(old, "mesh over 8 ranks {\n    dp_replicate: 2\n    dp_shard: *")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tp_axes")
    spec = root / f"{NAME}.shard"
    spec.write_text(_hsdp(_sequence_parallel((ROOT / "specs" / "llama.shard").read_text())))
    assert shardspec_main(["compile", str(spec), "-o", str(root)]) == 0
    return root


def _load(root: str) -> Any:
    spec = importlib.util.spec_from_file_location(NAME, Path(root) / f"{NAME}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = mod
    spec.loader.exec_module(mod)
    return mod


def test_an_axis_no_rule_shards_is_no_tensor_parallel_axis(compiled: Path) -> None:
    from shardspec.runtime.parallel import tp_axes

    layout = _load(str(compiled))
    assert layout.SPEC.axes == ("dp_replicate", "dp_shard", "tp")
    assert tp_axes(layout.SPEC) == ("tp",)


def _replicas(rank: int, world: int, root: str) -> dict[str, Any]:
    """dp_replicate 2 x dp_shard 1 x tp 1: no parameter's DTensor spans the replicas, the
    norms' SequenceParallel included (it runs on tp, of size 1), and verify holds."""
    from torch.distributed.tensor import DTensor

    from examples.models import llama
    from shardspec.runtime.parallel import build_tp_plan, plan_params
    from tests.parallel_scenarios import seeded

    layout = _load(root)
    c = Checks()
    mesh = layout.build_mesh(dp_replicate=2, tp=1)
    model = seeded(llama.tiny)()
    lmesh = layout.SPEC.layout_mesh(mesh)
    axis, styles = build_tp_plan(
        layout.SPEC, model, lmesh, plan_params(layout.SPEC, model, lmesh, mesh)[0]
    )
    c.check("plan", axis == "tp", f"tensor parallelism on {axis!r}")
    c.check("plan", len(styles) == 5, f"styles {sorted(styles)}")  # the 5 norms
    layout.parallelize(model, mesh)
    layout.verify(model, mesh)
    for fqn, p in model.named_parameters():
        names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None
        c.check("mesh", "dp_replicate" not in (names or ()), f"{fqn}: DTensor over {names}")
    return {"fail": c.fail, "count": c.count}


@pytest.mark.dist
def test_parallelize_at_tp_1_leaves_the_replica_axis_alone(compiled: Path) -> None:
    results = run_ranks(_replicas, 2, str(compiled), timeout=240)
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fail"]]
    assert not fails, "\n".join(fails[:20])
    for res in results:
        assert res["count"] == {"plan": 2, "mesh": 15}
