"""Multi-rank tests: the example specs' generated modules on real gloo CPU ranks.

Each world size runs all its scenarios in one spawn (``tests/dist_scenarios.py``, where the
scenarios are described); every rank returns its list of failures, each naming the scenario
and the parameter, and how many parameters each scenario checked.
"""

from __future__ import annotations

import importlib

import pytest

from shardspec.testing import run_ranks
from tests import dist_scenarios

LLAMA, MOE, MOE_LOCAL = (
    "generated.llama",
    "generated.deepseek_moe",
    "generated.deepseek_moe_local",
)

PLANS = {
    4: [
        ("full", LLAMA, {"tp": 2}),
        ("meta", LLAMA, {"tp": 2}),
        ("torch", LLAMA, {"tp": 2}),
        ("errors", LLAMA, {"tp": 2}),
        ("runtime", LLAMA, {"tp": 2}),
        ("full", MOE, {"ep": 2}),
        ("meta", MOE, {"ep": 2}),
        ("local", MOE_LOCAL, {"ep": 2}),
        ("meta", MOE_LOCAL, {"ep": 2}),
    ],
    8: [
        ("full", LLAMA, {"tp": 2}),
        ("meta", LLAMA, {"tp": 2}),
        ("torch", LLAMA, {"tp": 2}),
        ("full", MOE, {"ep": 4}),
        ("local", MOE_LOCAL, {"ep": 2}),
    ],
}
N_ERROR_CASES = 9  # SpecErrors the errors scenario expects


def expected_checks(plan) -> dict[str, int]:
    """Parameters each scenario must have checked on every rank."""
    out = {}
    for scenario, modname, _ in plan:
        n = len(importlib.import_module(modname).PARAMS)
        if scenario == "errors":
            out[f"[errors {modname}]"] = N_ERROR_CASES
        elif scenario == "runtime":
            # llama and the local-expert MoE without manifest, 2 tied cases, 1 wrong rank
            out["[runtime]"] = n + len(importlib.import_module(MOE_LOCAL).PARAMS) + 3
        elif scenario == "torch":
            out[f"[torch-vs-spec {modname}]"] = n
        else:
            out[f"[{scenario} {modname}]"] = 2 * n if scenario == "meta" else n
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", sorted(PLANS))
def test_example_specs_on_ranks(world: int) -> None:
    results = run_ranks(dist_scenarios.run_all, world, PLANS[world], timeout=180)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:40]) + (
        f"\n... {len(failures)} failures in all" if len(failures) > 40 else ""
    )
    want = expected_checks(PLANS[world])
    for rank, (_, checked) in enumerate(results):
        assert checked == want, f"rank {rank} checked {checked}, expected {want}"
