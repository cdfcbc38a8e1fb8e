"""Kill-point tests with one spawn for many kill points (tests/test_ckpt_crash.py,
tests/test_hf_export_crash.py).

A spawn per kill point costs a fresh interpreter importing torch and the generated modules
on every rank: on 2 busy cores, most of a crash test's time. Here one spawned *host*
process imports them once, then runs each *round* (one kill point, or the final
verification) by forking its ranks: every round's ranks form a fresh gloo process group
on a fresh port, so a rank killed (``os._exit``) in one round ends only that round. The
host forks from a fresh interpreter that has run nothing in parallel (torch's thread pools
are not fork-safe once used). Each forked rank writes its result to a file and leaves with
``os._exit`` (a broken group's teardown may hang); the host collects what each left.

:func:`run_rounds` runs ``rounds`` in order in one host and returns, per round, each
rank's ``("ok", value)`` or ``("error", traceback)``; a rank that left no result (the
victim) is absent, and one still running after ``timeout`` seconds is killed and reported
as ``("hung", "")``. ``after`` (optional) runs in the host after each round (say, to record
what a crash left on disk before the next round changes it) and its value is kept under
the round's name with the key ``"after"``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from shardspec.testing import set_rank_env

Round = tuple[str, Callable[..., Any], tuple]


def _child(
    rank: int, world: int, port: int, fn: Callable, args: tuple, out: str, pg: float
) -> None:
    set_rank_env(rank, world, port)
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg))
        result: tuple[str, Any] = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    tmp = os.path.join(out, f"{rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, os.path.join(out, f"{rank}.pkl"))


def fork_round(
    world: int, fn: Callable, args: tuple, *, timeout: float, pg_timeout: float
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks of a fresh gloo group."""
    from shardspec.testing import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        pids = {}
        for r in range(world):
            pid = os.fork()
            if pid == 0:  # the rank
                code = 0
                try:
                    _child(r, world, port, fn, args, out, pg_timeout)
                except BaseException:
                    code = 1
                os._exit(code)
            pids[r] = pid
        deadline = time.monotonic() + timeout
        alive = dict(pids)
        while alive and time.monotonic() < deadline:
            for r, pid in list(alive.items()):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    del alive[r]
            time.sleep(0.05)
        for pid in alive.values():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        results: dict[int, tuple[str, Any]] = {}
        for r in range(world):
            name = os.path.join(out, f"{r}.pkl")
            if r in alive:
                results[r] = ("hung", "")
            elif os.path.exists(name):
                with open(name, "rb") as f:
                    results[r] = pickle.load(f)
        return results


def _host(
    world: int,
    rounds: list[Round],
    after: Callable[[str], Any] | None,
    timeout: float,
    pg_timeout: float,
    setup: Callable[[], None] | None,
    out: str,
) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        if setup is not None:
            setup()  # imports shared by every round, once
        results: dict[str, Any] = {}
        for name, fn, args in rounds:
            t0 = time.monotonic()
            results[name] = {
                "ranks": fork_round(world, fn, args, timeout=timeout, pg_timeout=pg_timeout)
            }
            results[name]["seconds"] = round(time.monotonic() - t0, 2)  # (for --durations work)
            if after is not None:
                results[name]["after"] = after(name)
        value: tuple[str, Any] = ("ok", results)
    except BaseException:
        value = ("error", traceback.format_exc())
    with open(out, "wb") as f:
        pickle.dump(value, f)


def run_rounds(
    world: int,
    rounds: list[Round],
    *,
    after: Callable[[str], Any] | None = None,
    setup: Callable[[], None] | None = None,
    timeout: float = 300.0,
    pg_timeout: float = 120.0,
) -> dict[str, Any]:
    """Run ``rounds`` in one spawned host (module docstring). ``pg_timeout``: the default
    process group's timeout in every round (a survivor's bound is asserted well under it)."""
    import multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "host.pkl")
        proc = mp.get_context("spawn").Process(
            target=_host, args=(world, rounds, after, timeout, pg_timeout, setup, out)
        )
        proc.start()
        proc.join(timeout * (len(rounds) + 1))
        if proc.is_alive():
            proc.kill()
            raise AssertionError("the kill harness's host hung")
        with open(out, "rb") as f:
            status, value = pickle.load(f)
    if status != "ok":
        raise AssertionError(f"the kill harness's host failed:\n{value}")
    return value


# ----------------------------------------------------------------------------- helpers


class Killed(BaseException):
    """Raised by :func:`killed_at`'s hook: nothing in the protocols catches it, as nothing
    runs after a kill, so the folders are left as a killed rank 0 leaves them."""


@contextlib.contextmanager
def killed_at(point: str) -> Iterator[None]:
    """In one process: the folder protocol's step ``point`` raises :class:`Killed`."""
    from shardspec.runtime.checkpoint import folders

    def hook(where: str) -> None:
        if where == point:
            raise Killed(where)

    folders._fault_point = hook
    try:
        yield
    finally:
        folders._fault_point = None


def wait_for_survivors(folder: str, rank: int, world: int, victim: int) -> None:
    """A survivor of a round stays until every survivor has answered (rank 0 hosts the
    job's store, which a survivor still failing reads)."""
    open(os.path.join(folder, f"answered.{rank}"), "w").close()
    others = [os.path.join(folder, f"answered.{r}") for r in range(world) if r != victim]
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and not all(os.path.exists(o) for o in others):
        time.sleep(0.1)


def survivor_problems(
    results: dict[str, Any],
    cases: dict[str, int],
    world: int,
    *,
    error: str,
    bound: float,
    check: Callable[[str, str], str | None],
) -> list[str]:
    """What is wrong with each crash round's survivors (``cases``: round -> victim): each
    returned ``{"error": (kind, message), "seconds": ...}`` with ``kind == error``, a
    message naming the victim (rank 0 hosts the store here: its death is said, unnamed),
    within ``bound`` seconds, and ``check(round, message)`` finding nothing."""
    problems = []
    for case, victim in cases.items():
        ranks = results[case]["ranks"]
        if sorted(ranks) != sorted(r for r in range(world) if r != victim):
            problems.append(f"{case}: results from ranks {sorted(ranks)}: {ranks}")
            continue
        for r, (status, value) in ranks.items():
            if status != "ok":
                problems.append(f"{case}: rank {r} failed:\n{value}")
                continue
            kind, msg = value["error"] or ("none", "no error raised")
            if kind != error:
                problems.append(f"{case}: rank {r} raised {kind}: {msg}")
                continue
            name = f"rank(s) [{victim}] stopped" if victim else "usually rank 0"
            if name not in msg:
                problems.append(f"{case}: rank {r}'s error lacks {name!r}: {msg}")
            found = check(case, msg)
            if found is not None:
                problems.append(f"{case}: rank {r}: {found}: {msg}")
            if value["seconds"] > bound:
                problems.append(f"{case}: rank {r} took {value['seconds']:.1f} s: {msg}")
    return problems


def verify_problems(results: dict[str, Any], world: int, counts: dict[str, int]) -> list[str]:
    """What is wrong with the last round (``verify``): every rank returned ``(failures,
    counts)`` with no failure and exactly ``counts`` checks per tag."""
    ranks = results["verify"]["ranks"]
    if sorted(ranks) != list(range(world)):
        return [f"verify: results from ranks {sorted(ranks)}: {ranks}"]
    problems = []
    for r, (status, value) in ranks.items():
        if status != "ok":
            problems.append(f"verify: rank {r} failed:\n{value}")
            continue
        fails, got = value
        problems += [f"verify: rank {r}: {f}" for f in fails]
        if got != counts:
            problems.append(f"verify: rank {r} checked {got}, expected {counts}")
    return problems


def victim_run(
    call: Callable[[], Any], expected: type[BaseException], *, victim: bool, point: str
) -> dict[str, Any]:
    """A crash round's step on one rank: the victim dies (``os._exit``) at the folder
    protocol's step ``point``; every rank runs ``call`` and returns ``{"error": (kind,
    message) or None, "seconds": how long the call took}``, the traceback added for an
    error that is not ``expected``."""
    from shardspec.runtime.checkpoint import folders

    if victim:
        folders._fault_point = lambda where: os._exit(0) if where == point else None
    out: dict[str, Any] = {"error": None}
    started = time.monotonic()
    try:
        call()
    except expected as e:
        out["error"] = (type(e).__name__, str(e))
    except BaseException as e:  # reported: must not happen
        out["error"] = (type(e).__name__, f"{e}\n{traceback.format_exc()}")
    finally:
        out["seconds"] = time.monotonic() - started
        folders._fault_point = None
    return out
