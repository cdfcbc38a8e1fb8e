"""``shardspec lint --format sarif``: SARIF 2.1.0, validated against the OASIS schema
(tests/data/sarif-schema-2.1.0.json, vendored: see its NOTICE), for specs with errors,
warnings, suppressed findings, a syntax error, and none."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest

from shardspec.cli import main
from shardspec.findings.codes import BY_CODE, CHECKS, diag
from shardspec.findings.diagnostics import Span
from shardspec.findings.sarif import anchor, artifact, render_sarif
from tests.test_cli import BROKEN  # an unknown axis: SS011

REPO = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((REPO / "tests" / "data" / "sarif-schema-2.1.0.json").read_text("utf-8"))

WARNS = "mesh over 2 ranks { dp: * }\nparam ** [x] {}\n"  # SS061: no manifest


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """specs/llama.shard (one suppressed finding), its manifests, and specs with an error,
    a warning and a syntax error, run from the folder that holds specs/."""
    (tmp_path / "specs").mkdir()
    for name in ("llama.shard", "llama.manifest.json", "llama.hf.json", "qwen2.shard"):
        shutil.copy(REPO / "specs" / name, tmp_path / "specs" / name)
    for name in ("qwen2.manifest.json", "qwen2.hf.json"):  # (qwen2.shard has an hf block)
        shutil.copy(REPO / "specs" / name, tmp_path / "specs")
    (tmp_path / "specs" / "broken.shard").write_text(BROKEN, "utf-8")
    (tmp_path / "specs" / "warn.shard").write_text(WARNS, "utf-8")
    (tmp_path / "specs" / "syntax.shard").write_text("mesh { tp 2 }\n", "utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def sarif(capsys: pytest.CaptureFixture[str], *specs: str) -> tuple[int, dict]:
    status = main(["lint", "--format", "sarif", *specs])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    log = json.loads(out)
    jsonschema.Draft4Validator(SCHEMA).validate(log)  # the schema is draft 4
    return status, log


def test_the_vendored_schema_is_the_sarif_2_1_0_schema() -> None:
    jsonschema.Draft4Validator.check_schema(SCHEMA)
    assert SCHEMA["id"].endswith("/sarif-schema-2.1.0.json")
    # and it rejects what is not SARIF: a validation that cannot fail proves nothing
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(SCHEMA).validate({"version": "2.1.0", "runs": [{}]})


def test_errors_are_error_results_at_their_place(
    capsys: pytest.CaptureFixture[str], work: Path
) -> None:
    status, log = sarif(capsys, "specs/broken.shard")
    assert status == 1
    (run,) = log["runs"]
    assert log["version"] == "2.1.0" and run["invocations"][0]["executionSuccessful"]
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == work.resolve().as_uri() + "/"
    ss011 = next(r for r in run["results"] if r["ruleId"] == "SS011")
    assert ss011["level"] == "error" and "tpp" in ss011["message"]["text"]
    assert run["tool"]["driver"]["rules"][ss011["ruleIndex"]]["id"] == "SS011"
    (loc,) = ss011["locations"]
    where = loc["physicalLocation"]
    assert where["artifactLocation"] == {"uri": "specs/broken.shard", "uriBaseId": "%SRCROOT%"}
    # the same place as the JSON output gives
    main(["lint", "--format", "json", "specs/broken.shard"])
    plain = next(d for d in json.loads(capsys.readouterr().out) if d["code"] == "SS011")
    region = where["region"]
    assert (region["startLine"], region["startColumn"]) == (plain["line"], plain["col"])
    assert region["endColumn"] == plain["end_col"] and region["snippet"]["text"].strip()


def test_warnings_are_warning_results(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    status, log = sarif(capsys, "specs/warn.shard")
    assert status == 0
    (result,) = log["runs"][0]["results"]
    assert (result["ruleId"], result["level"]) == ("SS061", "warning")
    assert "suppressions" not in result


def test_suppressed_findings_are_results_with_an_in_source_suppression(
    capsys: pytest.CaptureFixture[str], work: Path
) -> None:
    """llama.shard silences SS078 (`drop model.rotary_emb.inv_freq   # shardspec:
    ignore[SS078]`): text lint shows nothing, SARIF shows it suppressed on that line."""
    status, log = sarif(capsys, "specs/llama.shard")
    assert status == 0
    (result,) = log["runs"][0]["results"]
    assert result["ruleId"] == "SS078" and result["suppressions"] == [{"kind": "inSource"}]
    line = result["locations"][0]["physicalLocation"]["region"]["startLine"]
    text = (work / "specs" / "llama.shard").read_text("utf-8").split("\n")[line - 1]
    assert "drop model.rotary_emb.inv_freq" in text and "ignore[SS078]" in text
    assert main(["lint", "specs/llama.shard"]) == 0


def test_a_clean_spec_has_no_results(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    status, log = sarif(capsys, "specs/qwen2.shard")
    assert status == 0 and log["runs"][0]["results"] == []


def test_a_syntax_error_is_an_unsuccessful_run(
    capsys: pytest.CaptureFixture[str], work: Path
) -> None:
    status, log = sarif(capsys, "specs/syntax.shard", "specs/warn.shard")
    assert status == 2
    (run,) = log["runs"]
    assert not run["invocations"][0]["executionSuccessful"]
    assert sorted(r["ruleId"] for r in run["results"]) == ["SS001", "SS061"]


def test_every_code_is_a_rule_with_its_catalogue_entry() -> None:
    log = json.loads(render_sarif([]))
    jsonschema.Draft4Validator(SCHEMA).validate(log)
    rules = log["runs"][0]["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == [c.code for c in CHECKS]
    headings = {
        anchor(BY_CODE[m[1]])
        for m in re.finditer(r"^## (SS\d+) ", (REPO / "docs/checks.md").read_text("utf-8"), re.M)
    }
    for rule in rules:
        check = BY_CODE[rule["id"]]
        assert rule["name"] == check.name
        assert rule["shortDescription"]["text"] == check.summary
        assert rule["fullDescription"]["text"] == check.why
        assert rule["defaultConfiguration"]["level"] == check.severity.value
        assert rule["helpUri"].endswith(f"docs/checks.md#{anchor(check)}")
        assert anchor(check) in headings
    assert anchor(BY_CODE["SS001"]) == "ss001-syntax-error"


def test_places_outside_the_root_and_off_any_file(tmp_path: Path) -> None:
    assert artifact("specs/a b.shard", tmp_path) == {
        "uri": "specs/a%20b.shard",
        "uriBaseId": "%SRCROOT%",
    }
    assert artifact(str(tmp_path / "x.shard"), tmp_path)["uri"] == "x.shard"  # type: ignore[index]
    outside = artifact("/elsewhere/x.shard", tmp_path)
    assert outside == {"uri": "file:///elsewhere/x.shard"}
    assert artifact("<command line>", tmp_path) is None
    d = diag("SS004", "bad", Span("<command line>", 1, 1))
    log = json.loads(render_sarif([d], root=tmp_path, successful=False))
    jsonschema.Draft4Validator(SCHEMA).validate(log)
    assert "locations" not in log["runs"][0]["results"][0]
