"""``export_hf`` when a rank dies, and around folders it did not make (issue 10).

Four gloo ranks export the example llama (generated/llama.py, dp_shard 4) while one rank
is killed (``os._exit``) at a step of the export: while writing its file, or (rank 0)
before renaming the finished folder into place. Every surviving rank raises ``HFError``
(never the backend's raw error), ``path`` is never half-written, and ``<path>.partial``
is removed when rank 0 survives. Before any death, on the same ranks: a folder named
``<path>.partial`` that export_hf did not make is refused and left as it was, and a
leftover of an unfinished export (marked as export_hf's) is replaced.

The ranks are launched here, not through ``shardspec.testing.run_ranks``: a killed rank
would fail that harness, and survivors of a broken group skip its teardown (they write
their results, then ``os._exit``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import traceback
from datetime import timedelta
from pathlib import Path

import pytest

from shardspec.testing import free_port

WORLD = 4


def _rank(rank: int, port: int, out: str, victim: int, step: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        CUDA_VISIBLE_DEVICES="",
    )
    result: dict = {"rank": rank, "checks": []}
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        import generated.llama as layout
        from examples.models import llama
        from shardspec.runtime.hf import EXPORT_MARKER, HFError
        from shardspec.runtime.hf import export as hfmod

        mesh = layout.build_mesh(tp=1)
        model = llama.tiny()
        layout.distribute(model, mesh)
        llama.init_weights(model, 0)
        root = os.path.join(out, "hf")
        checks = result["checks"]

        if step == "folders":
            # A folder of the user's own, named like export_hf's temporary one.
            target = os.path.join(root, "mine")
            if rank == 0:
                os.makedirs(target + ".partial")
                Path(target + ".partial", "notes.txt").write_text("keep me")
            dist.barrier()
            try:
                layout.export_hf(model, target, mesh)
                checks.append(("refused a foreign .partial", False, "exported"))
            except HFError as e:
                checks.append(
                    ("refused a foreign .partial", "not made by export_hf" in str(e), str(e))
                )
            dist.barrier()
            kept = Path(target + ".partial", "notes.txt")
            checks.append(
                ("foreign folder kept", kept.is_file() and kept.read_text() == "keep me", "")
            )
            checks.append(("nothing at path", not os.path.exists(target), ""))
            # A leftover of an export that did not finish (marked): replaced.
            target = os.path.join(root, "again")
            if rank == 0:
                os.makedirs(target + ".partial")
                Path(target + ".partial", EXPORT_MARKER).write_text("")
                Path(target + ".partial", "model-00001-of-00004.safetensors").write_text("junk")
            dist.barrier()
            layout.export_hf(model, target, mesh)
            dist.barrier()
            files = sorted(os.listdir(target))
            index = json.loads(Path(target, "model.safetensors.index.json").read_text())
            ok = EXPORT_MARKER not in files and set(index["weight_map"].values()) <= set(files)
            checks.append(("leftover replaced", ok, str(files)))
            checks.append(("no partial left", not os.path.exists(target + ".partial"), ""))
            dist.barrier()  # every rank has looked before the next export starts
            # overwrite=True over an earlier export: the new one, whole.
            layout.export_hf(model, target, mesh, overwrite=True)
            dist.barrier()
            checks.append(("overwritten", sorted(os.listdir(target)) == files, ""))
            checks.append(("no aside left", not os.path.exists(target + ".replaced"), ""))
        else:
            target = os.path.join(root, step)
            if rank == victim:
                name = "_write_file" if step == "writing" else "_finish"

                def die(*_a, **_k):
                    os._exit(17)

                setattr(hfmod, name, die)
            try:
                layout.export_hf(model, target, mesh)
                checks.append(("survivor raised", False, "export returned"))
            except HFError as e:
                checks.append(("survivor raised HFError", True, str(e)[:300]))
            except BaseException as e:
                checks.append(("survivor raised HFError", False, f"{type(e).__name__}: {e}"))
            checks.append(("path not written", not os.path.exists(target), ""))
            if rank == 0:
                gone = not os.path.exists(target + ".partial")
                checks.append(("partial removed by rank 0", gone, str(os.listdir(root))))
    except BaseException:
        result["error"] = traceback.format_exc()
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)  # a broken group's teardown may hang: skip it


def _run(tmp_path: Path, victim: int, step: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, str(tmp_path), victim, step)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail(f"rank {procs.index(p)} hung")
    out = []
    for r in range(WORLD):
        f = tmp_path / f"{r}.pkl"
        if r == victim and step != "folders":
            assert not f.exists(), "the victim was not killed"
            assert procs[r].exitcode == 17
            continue
        assert f.exists(), f"rank {r} wrote no result (exit {procs[r].exitcode})"
        out.append(pickle.loads(f.read_bytes()))
    return out


def _assert(results: list[dict], least: int) -> None:
    for res in results:
        assert "error" not in res, res.get("error")
        bad = [(what, why) for what, ok, why in res["checks"] if not ok]
        assert not bad, f"rank {res['rank']}: {bad}"
        assert len(res["checks"]) >= least, res["checks"]


@pytest.mark.dist
def test_export_hf_leaves_folders_it_did_not_make(tmp_path: Path) -> None:
    _assert(_run(tmp_path, -1, "folders"), 7)


@pytest.mark.dist
@pytest.mark.parametrize(("victim", "step"), [(2, "writing"), (0, "renaming")])
def test_export_hf_when_a_rank_dies(tmp_path: Path, victim: int, step: str) -> None:
    results = _run(tmp_path, victim, step)
    assert len(results) == WORLD - 1
    _assert(results, 2)
    for res in results:
        (msg,) = [why for what, _, why in res["checks"] if what == "survivor raised HFError"]
        assert msg.startswith(f"export to {tmp_path}") and "failed" in msg, msg
