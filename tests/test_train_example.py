"""examples/train.py under torchrun on 4 gloo processes: a run killed (SIGKILL to torchrun and
every worker, as a machine that dies) once its checkpoint of step K is complete resumes and
continues with the losses of an uninterrupted run. Three launches: the killed run is also
the uninterrupted run the resumes are compared with (it saves only at step K before the
steps compared, so the resumes read that checkpoint and redo every step after it).

- Resumed on the same mesh (dp_shard=2, tp=2): the losses equal the uninterrupted run's
  bitwise (same data, same reduction order; model, AdamW state and step restored).
- Resumed on another mesh (dp_shard=4, tp=1; the checkpoint resharded): equal within a
  relative 1e-6 (about 12 fp32 ulps at these losses). The sums are fp32 in another order
  there (each rank's loss is the mean over 2 rows instead of 4 and FSDP2 sums 4 gradients
  instead of 2; tp=1 has no row-parallel partial sums), so the values differ in their last
  bit or so (8e-8 relative measured over 10 steps). A resume that lost the AdamW state
  differs by 3e-5 to 2e-4 relative at these steps (checked), one that lost the step far more.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOSS = re.compile(r"step (\d+) loss (\S+)")
SAVE_EVERY = 6  # K: the killed run's first checkpoint
STEPS = 2 * SAVE_EVERY - 1  # the last step compared: the killed run saves next at 2K
TIMEOUT = 300.0  # generous: 4 processes on 2 shared cores


def _command(ckpt: Path, mesh: str, steps: int, save_every: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "examples/train.py",
        "--spec",
        "specs/llama.shard",
        "--mesh",
        mesh,
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        "--ckpt",
        str(ckpt),
    ]


def _start(cmd: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _losses(lines: list[str]) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in map(LOSS.fullmatch, lines) if m}


def _run(ckpt: Path, mesh: str, steps: int, save_every: int) -> list[str]:
    proc = _start(_command(ckpt, mesh, steps, save_every))
    out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, out[-4000:]
    return out.splitlines()


def _family(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts each worker in a session of its own, so
    killing torchrun's process group would leave them running)."""
    out = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        out.extend(_family(int(child)))
    return out


def _run_killed(ckpt: Path, mesh: str, after: str, through: int) -> tuple[list[str], int]:
    """Start a long run and SIGKILL torchrun and its workers once ``after`` and the loss of
    step ``through`` are printed; the lines it printed, and the step it had reached."""
    proc = _start(_command(ckpt, mesh, 100_000, SAVE_EVERY))
    watchdog = threading.Timer(TIMEOUT, proc.kill)
    watchdog.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if after in lines and through in _losses(lines):
                for pid in reversed(_family(proc.pid)):
                    os.kill(pid, signal.SIGKILL)
                break
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    assert after in lines and through in _losses(lines), "\n".join(lines[-40:])
    return lines, max(_losses(lines))


@pytest.mark.dist
def test_killed_run_resumes_on_same_and_other_mesh(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    lines, reached = _run_killed(
        ckpt, "dp_shard=2,tp=2", f"checkpoint step_{SAVE_EVERY} complete", STEPS
    )
    assert reached < 100_000  # killed mid-run
    # Its steps up to STEPS are an uninterrupted run's: nothing stopped it before them.
    whole = _losses(lines)
    assert sorted(whole)[:STEPS] == list(range(1, STEPS + 1))
    saved = sorted(int(p.name[5:]) for p in ckpt.iterdir() if re.fullmatch(r"step_\d+", p.name))
    assert saved and saved[0] == SAVE_EVERY
    k = max(s for s in saved if (ckpt / f"step_{s}" / ".shardspec.json").exists())
    assert k < STEPS, f"the killed run saved step {k}, past the steps compared ({STEPS})"

    # Resumes that do not save, so both read the checkpoint the killed run left.
    same = _run(ckpt, "dp_shard=2,tp=2", STEPS, 0)
    assert f"resumed from {ckpt}/step_{k} (step {k}) on {{'dp_shard': 2, 'tp': 2}}" in same
    resumed = _losses(same)
    assert sorted(resumed) == list(range(k + 1, STEPS + 1))
    assert resumed == {s: whole[s] for s in resumed}  # bitwise

    other = _run(ckpt, "dp_shard=4,tp=1", STEPS, 0)
    assert f"resumed from {ckpt}/step_{k} (step {k}) on {{'dp_shard': 4, 'tp': 1}}" in other
    moved = _losses(other)
    assert sorted(moved) == list(range(k + 1, STEPS + 1))
    for s, value in moved.items():
        assert value == pytest.approx(whole[s], rel=1e-6), (s, value, whole[s])
