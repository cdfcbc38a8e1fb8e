"""Multi-rank scenarios for ``tests/test_hf_export_crash.py``: a rank killed (``os._exit``)
at each step of export_hf's folder protocol, on 3 gloo ranks (the example llama,
``generated/llama.py``, dp_shard 3), then what the next export_hf to the path finds,
recovers and says.

:func:`crash` runs in one round of ``tests/kill_harness.py`` per kill point: every rank
exports A (the model at seed 1), then starts exporting B (seed 2, ``overwrite=True``), and
the victim dies at the chosen step. Each survivor returns its error and how long its
export took. :func:`verify` runs once, in a last round: it exports A, B and C (seed 3) to
fresh folders as references, checks what each crashed path holds, exports C over it
(the recovery reported on every rank alike), and compares the result with the reference,
bitwise, with no ``.partial`` or ``.replaced`` left.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardspec.runtime import hf as hfmod
from shardspec.testing import Checks
from tests.hf_scenarios import hf_state
from tests.kill_harness import victim_run, wait_for_survivors

WORLD = 4
# case -> (kill point, victim rank, what the path holds after the crash: "A", "B", or None)
CASES: dict[str, tuple[str, int, str | None]] = {
    "prepared": ("prepared", 1, "A"),  # <path>.partial made, nothing sent
    "exchange-writer": ("exchanging", 2, "A"),  # a writer dies before receiving its chunks
    "exchange-sender": ("sent-one", 1, "A"),  # a sender dies after its first message
    "exchange-rank0": ("exchanging", 0, "A"),  # rank 0 (the store's host) dies there
    "exchanged": ("exchanged", 1, "A"),  # a rank dies once its chunks are sent and received
    "writing": ("writing", 2, "A"),  # a rank dies with its file half written
    "written-rank0": ("written", 0, "A"),  # every file written, rank 0 dies before the index
    "written-other": ("written", 2, "B"),  # rank 0 finishes without rank 2
    "marked": ("marked", 0, "A"),  # marked complete, not moved into place
    "renamed-old": ("renamed-old", 0, None),  # path set aside, the new one not moved in
    "renamed-new": ("renamed-new", 0, "B"),  # moved into place, the old one not removed
}
# What the next export_hf reports it did, per case (a substring of its one sentence).
RECOVERED = {
    "exchange-rank0": "an unfinished export_hf",
    "written-rank0": "an unfinished export_hf",
    "marked": "moved it to",
    "renamed-old": "moved it to",
    "renamed-new": "removed",
}


def _model(layout: Any, mesh: Any, seed: int) -> torch.nn.Module:
    from examples.models import llama

    model = llama.tiny()
    layout.distribute(model, mesh)
    llama.init_weights(model, seed)
    return model


def _path(root: str, case: str) -> str:
    return os.path.join(root, case, "out")


def crash(rank: int, world: int, root: str, case: str) -> dict[str, Any]:
    """Export A, then die at ``case``'s step of exporting B over it (the victim)."""
    import generated.llama as layout

    torch.set_num_threads(1)
    point, victim, _ = CASES[case]
    path = _path(root, case)
    mesh = layout.build_mesh(tp=1)
    layout.export_hf(_model(layout, mesh, 1), path, mesh)
    model = _model(layout, mesh, 2)
    out = victim_run(
        lambda: layout.export_hf(model, path, mesh, overwrite=True),
        hfmod.HFError,
        victim=rank == victim,
        point=point,
    )
    wait_for_survivors(os.path.join(root, case), rank, world, victim)  # the store's host
    return out


def left(root: str, case: str) -> tuple[str, str, str] | None:
    """What a crash left: the states of (path, path.partial, path.replaced)."""
    if case not in CASES:
        return None
    p = _path(root, case)
    state = hfmod.folders.EXPORT.state
    return (state(p), state(p + ".partial"), state(p + ".replaced"))


def _same(a: str, b: str) -> bool:
    ta, tb = hf_state(a), hf_state(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def verify(rank: int, world: int, root: str) -> tuple[list[str], dict[str, int]]:
    """After every crash: what each path holds, then the next export over it recovers
    (saying so on every rank) and writes C, bitwise the reference, with no debris."""
    import generated.llama as layout

    torch.set_num_threads(1)
    c = Checks()
    mesh = layout.build_mesh(tp=1)
    refs = {}
    for seed, name in ((1, "A"), (2, "B"), (3, "C")):
        refs[name] = os.path.join(root, "refs", name)
        with _calls() as calls:
            layout.export_hf(_model(layout, mesh, seed), refs[name], mesh)
        _check_groups(c, calls)
    model = _model(layout, mesh, 3)
    _check_process_group(c, layout, mesh, model, root, refs["C"])
    _check_one_ranks_config(c, layout, mesh, model, rank, root)
    for case, (_, _, holds) in CASES.items():
        try:
            _verify_case(c, layout, mesh, model, rank, root, case, holds, refs)
        except Exception:
            c.fail.append(f"[{case}] raised:\n{traceback.format_exc()}")
        dist.barrier()
    return c.fail, c.count


# Every torch.distributed function that communicates, as the runtime may call it.
_COMMUNICATING = (
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather_object",
    "irecv",
    "isend",
    "recv",
    "scatter_object_list",
    "send",
)


@contextlib.contextmanager
def _calls() -> Iterator[list[tuple[str, Any]]]:
    """Every call of a communicating ``torch.distributed`` function while the block runs,
    with the group it ran on (None: the default group)."""
    seen: list[tuple[str, Any]] = []
    saved = {name: getattr(dist, name) for name in _COMMUNICATING}

    def recording(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, kwargs.get("group")))
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(dist, name, recording(name, fn))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _check_groups(c: Checks, calls: list[tuple[str, Any]]) -> None:
    """Every wait of an export runs on shardspec's checkpoint group, which a survivor can
    destroy, never on the default group, which it cannot."""
    from shardspec.runtime.checkpoint import checkpoint_group

    group = checkpoint_group()
    c.check("groups", bool(calls), "the export communicated nothing")
    wrong = sorted({name for name, g in calls if g is not group})
    c.check("groups", not wrong, f"not on the checkpoint group: {wrong}")
    kinds = {name for name, _ in calls}
    c.check("groups", {"isend", "irecv"} <= kinds, f"no chunk exchange seen: {sorted(kinds)}")


def _check_process_group(
    c: Checks, layout: Any, mesh: Any, model: Any, root: str, ref: str
) -> None:
    """``process_group=``: a gloo group of every rank carries the whole export (bitwise the
    reference); a group of some ranks only is refused on every rank, before anything."""
    group = dist.new_group(backend="gloo")
    path = os.path.join(root, "process-group", "out")
    with _calls() as calls:
        layout.export_hf(model, path, mesh, process_group=group)
    wrong = sorted({name for name, g in calls if g is not group})
    c.check("process_group", not wrong and bool(calls), f"not on the group given: {wrong}")
    c.check("process_group", _same(path, ref), f"{path} is not the reference")
    part = dist.new_group(ranks=[0, 1], backend="gloo")
    refused = ""
    try:
        layout.export_hf(model, path + "-part", mesh, process_group=part)
    except hfmod.HFError as e:
        refused = str(e)
    c.check("process_group", "a group of the model's" in refused, f"a part group: {refused!r}")
    c.check("process_group", not os.path.exists(path + "-part.partial"), "a part group wrote")


def _check_one_ranks_config(
    c: Checks, layout: Any, mesh: Any, model: Any, rank: int, root: str
) -> None:
    """A config path readable on rank 0 only (a file missing on one node): every rank
    raises, naming the ranks, and nothing is written; before, the others raised alone and
    rank 0 waited for them in the next collective (the checkpoint group's 30 minutes)."""
    config = os.path.join(root, "configs", str(rank), "config.json")
    if rank == 0:
        os.makedirs(os.path.dirname(config), exist_ok=True)
        with open(config, "w", encoding="utf-8") as f:
            f.write('{"tie_word_embeddings": false}')
    dist.barrier()
    path = os.path.join(root, "one-config", "out")
    said = ""
    try:
        layout.export_hf(model, path, mesh, config=config)
    except hfmod.HFError as e:
        said = str(e)
    named = all(f"rank {r}: HFError: config:" in said for r in range(1, dist.get_world_size()))
    c.check("config", named and "rank 0:" not in said, f"said {said!r}")
    dist.barrier()
    left = os.listdir(os.path.dirname(path)) if os.path.isdir(os.path.dirname(path)) else []
    c.check("config", left == [], f"left {left}")


def _verify_case(
    c: Checks,
    layout: Any,
    mesh: Any,
    model: Any,
    rank: int,
    root: str,
    case: str,
    holds: str | None,
    refs: dict[str, str],
) -> None:
    path = _path(root, case)
    if holds is None:
        c.check(case, not os.path.exists(path), f"{path} exists")
    else:
        c.check(case, _same(path, refs[holds]), f"{path} does not hold {holds}")
    dist.barrier()  # every rank has looked before the export changes it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = layout.export_hf(model, path, mesh, overwrite=True)
    said = [str(w.message) for w in caught if issubclass(w.category, hfmod.ExportRecoveryWarning)]
    c.check(case, said == report.recovered, f"warned {said}, reported {report.recovered}")
    want = RECOVERED.get(case)
    if want is None:
        c.check(case, said == [], f"recovery reported {said}")
    else:
        c.check(case, len(said) == 1 and want in said[0], f"recovery reported {said}")
    c.check(case, _same(path, refs["C"]), f"{path} is not C after the next export")
    for debris in (path + ".partial", path + ".replaced"):
        c.check(case, not os.path.exists(debris), f"{debris} is left")
