"""bench/gpu_check.py, the script a session runs on a lent GPU machine, checked on CPU.

The GPU machine is lent to a session by chance and for minutes: what can break before it
runs there is found here. Each phase has a runner and a time limit, unknown phases are
refused before anything runs, the driver runs a phase in its own process and writes the
JSON, and the two patches every multi-rank phase on one GPU relies on work: point-to-point
messages through host memory (``_host_p2p``, forced on CPU tensors by
``GPU_CHECK_HOST_P2P``), and the record of the checkpoint's wire-device decisions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_check
from shardspec.testing import run_ranks


def test_every_phase_has_a_runner_and_the_new_ones_run_first() -> None:
    assert list(gpu_check.RUNNERS) and set(gpu_check.RUNNERS) == set(gpu_check.PHASES)
    order = list(gpu_check.PHASES)
    never_run = ("async", "pp", "views_pp", "ep_sp", "fp8", "transfer")
    assert order[: 1 + len(never_run)] == ["env", *never_run]


def test_unknown_phase_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--phases", "env,pipeline"])
    assert e.value.code == 2
    assert "unknown phase(s) pipeline" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_driver_runs_a_phase_in_its_own_process_and_writes_the_json(tmp_path: Path) -> None:
    assert gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--phases", "env"]) == 0
    got = json.loads((tmp_path / "gpu_check.json").read_text())
    assert got["device"] == "cpu"
    env = got["env"]
    assert env["rc"] == 0 and env["cuda_available"] in (False, True)
    for mod in ("torch", "lark", "pydantic"):
        assert not str(env[mod]).startswith("missing"), env[mod]
    assert "===== env (rc 0)" in (tmp_path / "phase_logs.txt").read_text()


def _p2p_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 sends two tensors (one through ``batch_isend_irecv``, one through ``isend``),
    rank 1 receives them into tensors of its own, all staged through host copies; one of
    them a leaf that requires grad (what pipelining receives activations into)."""
    import os

    import torch
    import torch.distributed as dist

    os.environ["GPU_CHECK_HOST_P2P"] = "1"
    gpu_check._host_p2p()
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (1 + rank)
    b = torch.full((4,), 5.0 + rank, requires_grad=True)
    if rank == 0:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, 1)])
        works.append(dist.isend(b, 1))
    else:
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, a, 0)])
        works.append(dist.irecv(b, 0))
    staged = [type(w).__name__ for w in works]
    for w in works:
        w.wait()
    return {
        "a": a.tolist(),
        "b": b.tolist(),
        "b_version": b._version,
        "staged": staged,
        "name": dist.isend.__name__,
    }


@pytest.mark.dist
def test_point_to_point_through_host_memory_delivers_into_the_receivers_tensors() -> None:
    sent, got = run_ranks(_p2p_rank, 2, timeout=120)
    assert got["a"] == sent["a"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert got["b"] == sent["b"] == [5.0] * 4
    assert got["b_version"] == 0  # written as the backend writes: no autograd version bump
    assert sent["staged"] == got["staged"] == ["_HostWork", "_HostWork"]
    assert got["name"] == "isend"  # P2POp's checks and repr read the name


def test_the_wire_device_record_counts_each_decision() -> None:
    import torch

    from shardspec.runtime.checkpoint import locality

    before = locality.wire_device
    gpu_check._WIRE.clear()
    try:
        gpu_check._record_wire()
        gpu_check._record_wire()  # once only: not wrapped twice
        assert locality.wire_device("cpu:gloo,cuda:nccl", torch.device("cpu")) == torch.device(
            "cpu"
        )
        assert locality.wire_device("gloo", torch.device("cpu")) == torch.device("cpu")
        assert gpu_check._WIRE == {"cpu:gloo,cuda:nccl cpu -> cpu": 1, "gloo cpu -> cpu": 1}
    finally:
        locality.wire_device = before
        gpu_check._WIRE.clear()
