"""The input-size benchmark runs at a tiny scale: its inputs are what they claim (the rules
spec lints clean, the long name is refused as SS007) and its report has every row."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_input_size
from shardspec.frontend.parse import parse


def test_the_rules_input_is_a_valid_spec_of_that_many_rules() -> None:
    text = bench_input_size.rules_text(50)
    spec, diags = parse(text, "rules.shard")
    assert spec is not None and not diags and len(spec.rules) == 50
    assert 90 < len(text) / 50 < 120  # about 100 bytes a rule: 510,000 of them are ~50 MB


def test_the_benchmark_runs_and_reports_each_input(capsys, tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    assert bench_input_size.main(["--scale", "0.0002", "--rounds", "1", "--json", str(out)]) == 0
    report = capsys.readouterr().out
    for case in ("name", "rules", "manifest"):
        assert f"| {case} |" in report
    runs = {r["case"]: r for r in json.loads(out.read_text())}
    assert runs["name"]["status"] == 2  # SS007: refused when read
    assert runs["rules"]["status"] == 0 and runs["manifest"]["status"] == 0
    assert all(r["peak_rss_mb"] > 0 for r in runs.values())


def test_the_stages_report_says_where_the_time_and_memory_go(capsys) -> None:
    argv = ["--scale", "0.0002", "--rounds", "1", "--cases", "rules,manifest", "--stages"]
    assert bench_input_size.main(argv) == 0
    report = capsys.readouterr().out
    for case, stage in [("rules", "parse"), ("rules", "check"), ("manifest", "load the manifest")]:
        row = next(
            line for line in report.splitlines() if line.startswith(f"| {case} | this | {stage} |")
        )
        cpu, rss, peak = (cell.split()[0] for cell in row.split("|")[4:7])
        assert float(cpu) >= 0 and 0 < float(rss.replace(",", "")) <= float(peak.replace(",", ""))
