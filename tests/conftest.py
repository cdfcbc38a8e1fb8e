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
