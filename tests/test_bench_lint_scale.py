"""The lint-scale benchmark runs at small worlds, where it also checks that the sampled
lint and a lint that visits every rank report the very same findings on every example spec
(codes, places, messages with their rank lists, hints)."""

from __future__ import annotations

from bench import bench_lint_scale


def test_sampled_and_walking_lint_agree_on_the_example_specs(capsys) -> None:
    assert (
        bench_lint_scale.main(["--rounds", "1", "--worlds", "64", "384", "--walk-max", "384"]) == 0
    )
    out = capsys.readouterr().out
    assert "| 64 |" in out and "| 384 |" in out and "sampled vs walk" in out


def test_a_disagreement_fails_the_benchmark(monkeypatch) -> None:
    real = bench_lint_scale.lint_once
    calls = []

    def skewed(paths, world):
        took, found = real(paths, world)
        calls.append(world)
        return took, found + (["extra"] if len(calls) % 2 == 0 else [])

    monkeypatch.setattr(bench_lint_scale, "lint_once", skewed)
    try:
        bench_lint_scale.main(["--rounds", "1", "--worlds", "64", "--walk-max", "64"])
    except SystemExit as e:
        assert "disagree" in str(e)
    else:
        raise AssertionError("a disagreement passed")
