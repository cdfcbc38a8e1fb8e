"""Smoke test of the generated-module import benchmark (bench/bench_import.py) at tiny sizes,
so that ``python -m bench.bench_import`` cannot rot: two sizes, one round, the plan call."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_import


def test_the_import_benchmark_runs_and_reports_every_size(tmp_path: Path, capsys) -> None:
    out = tmp_path / "samples.json"
    argv = ["--sizes", "200", "2000", "--rounds", "1", "--plan-size", "200", "--json", str(out)]
    assert bench_import.main(argv) == 0
    text = capsys.readouterr().out
    assert "| parameters | rows | module |" in text and "`canonical_plan`" in text
    data = json.loads(out.read_text(encoding="utf-8"))
    small, big = data["sizes"]
    assert big["params"] > 5 * small["params"]
    assert small["rows"] == big["rows"]  # the module does not grow with the parameters
    assert big["expanded_bytes"] > 5 * small["expanded_bytes"]  # the table it replaced did
    for key in ("base", "200:cold", "200:warm", "2000:expanded-cold", "2000:expanded-warm"):
        assert len(data["samples"][key]) == 1, key
    cold = data["samples"]["2000:cold"][0]
    assert cold["params"] == big["params"] and "first_use_s" in cold
    # Peak RSS is each process's own, not its parent's (ru_maxrss would start from it).
    assert 0 < data["samples"]["base"][0]["base_rss_mb"] < 2_000
    plan = data["plan"]  # both tables planned alike (the benchmark compares fingerprints)
    assert plan["units"] > 0 and plan["folded_plan_s"] > 0 and plan["dict_plan_s"] > 0
