"""Shared pytest setup.

``pytest --update-golden`` rewrites ``tests/cases/*/expected.py`` from the current compiler
(then review the diff): the golden tests in ``tests/test_codegen.py`` compare against
those files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not add the cwd
    sys.path.insert(0, str(REPO_ROOT))

from shardspec import testing  # noqa: E402  (after the path above)

# Multi-rank tests fork their ranks from a fork server that imported torch once, instead
# of a fresh interpreter importing torch per rank per spawn (shardspec.testing.run_ranks).
testing.DEFAULT_START_METHOD = "forkserver"
# ... and imported, once, what most ranks import next: transformers' model classes (about
# 2.5 s of CPU per rank per spawn otherwise, on 2 cores), safetensors and the runtime. Only
# imports: nothing here starts a thread, so forking after them stays safe.
testing.FORKSERVER_PRELOAD = (
    *testing.FORKSERVER_PRELOAD,
    "safetensors.torch",
    "transformers",
    "transformers.pytorch_utils",
    *(
        f"transformers.models.{m}.modeling_{m}"
        for m in ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gpt2", "phi3")
    ),
    "shardspec.runtime.parallel",
    "shardspec.runtime.checkpoint",
    "shardspec.runtime.hf",
    "shardspec.runtime.transfer",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/cases/*/expected.py from the current compiler instead of comparing",
    )


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    """Whether golden files are to be rewritten rather than compared."""
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the test from the repository root, so displayed paths are repo-relative."""
    monkeypatch.chdir(REPO_ROOT)
    return REPO_ROOT
