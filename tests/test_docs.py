"""The docs stay true: every relative link and ``#anchor`` in README.md and docs/*.md
resolves (anchors computed as GitHub computes them from headings), and every code block
marked runnable (info string ``sh runnable``, ``bash runnable`` or ``python runnable``;
docs/internals.md, "Testing the docs") runs and exits 0.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE_LANGUAGES = {"sh": "sh", "bash": "sh", "python": "python"}

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@dataclass(frozen=True)
class Block:
    """A fenced code block: where it starts (the fence's line), its info string, its text."""

    page: Path
    line: int
    info: str
    text: str

    @property
    def runnable_as(self) -> str | None:
        """``"sh"`` or ``"python"`` for a block marked runnable, else None."""
        words = self.info.split()
        if len(words) >= 2 and "runnable" in words[1:]:
            return RUNNABLE_LANGUAGES.get(words[0])
        return None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO).as_posix()}:{self.line}"


@dataclass(frozen=True)
class Page:
    """What the tests read from one Markdown page: its anchors, its links (line, target)
    outside code, and its fenced code blocks."""

    anchors: frozenset[str]
    links: tuple[tuple[int, str], ...]
    blocks: tuple[Block, ...]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (code spans and links reduced to their
    text), lower case, punctuation other than ``-`` and ``_`` dropped, spaces as ``-``."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def read_page(path: Path) -> Page:
    """Headings, links and fenced blocks of ``path``; nothing inside a fence counts as a
    heading or a link, nor does anything inside a code span."""
    anchors: list[str] = []
    seen: dict[str, int] = {}
    links: list[tuple[int, str]] = []
    blocks: list[Block] = []
    fence: re.Match[str] | None = None
    body: list[str] = []
    fence_line = 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        m = _FENCE.match(line)
        if fence is not None:
            mark = fence.group("fence")
            if m and m.group("fence")[0] == mark[0] and len(m.group("fence")) >= len(mark):
                if not m.group("info").strip():
                    indent = len(fence.group("indent"))
                    text = "\n".join(x[indent:] if x[:indent].isspace() else x for x in body)
                    blocks.append(Block(path, fence_line, fence.group("info").strip(), text))
                    fence = None
                    continue
            body.append(line)
            continue
        if m:
            fence, fence_line, body = m, number, []
            continue
        h = _HEADING.match(line)
        if h:
            anchor = github_anchor(h.group(2))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.append(anchor if count == 0 else f"{anchor}-{count}")
        for link in _LINK.finditer(_CODE_SPAN.sub("", line)):
            links.append((number, link.group("target")))
    return Page(frozenset(anchors), tuple(links), tuple(blocks))


def broken_links(pages: list[Path], root: Path = REPO) -> list[str]:
    """``page:line: target (why)`` (``page`` relative to ``root``) for every relative link in
    ``pages`` that names a missing file, or an anchor that no heading of the target page
    gives."""
    read: dict[Path, Page] = {}

    def page(path: Path) -> Page:
        if path not in read:
            read[path] = read_page(path)
        return read[path]

    problems = []
    for source in pages:
        for line, target in page(source).links:
            if _SCHEME.match(target):
                continue  # https:, mailto: ...: not checked offline
            name, _, anchor = target.partition("#")
            dest = (source.parent / name).resolve() if name else source
            where = f"{source.relative_to(root).as_posix()}:{line}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in page(dest).anchors:
                problems.append(f"{where} (no heading gives #{anchor})")
    return problems


def runnable_blocks() -> list[Block]:
    return [b for p in PAGES for b in read_page(p).blocks if b.runnable_as]


# ------------------------------------------------------------------------------- links


def test_github_anchors() -> None:
    assert github_anchor("Training with the spec") == "training-with-the-spec"
    assert github_anchor('`hf ["FILE"] { ITEMS }`') == "hf-file--items-"
    assert github_anchor("Block-scaled FP8 (`fp8` lines)") == "block-scaled-fp8-fp8-lines"
    assert github_anchor("SS001 syntax-error") == "ss001-syntax-error"
    assert (
        github_anchor("Expert parallelism: folded views and token dispatch")
        == "expert-parallelism-folded-views-and-token-dispatch"
    )


def test_every_relative_link_and_anchor_resolves() -> None:
    assert len(PAGES) > 1
    problems = broken_links(PAGES)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_broken_links_are_found(tmp_path: Path) -> None:
    """The checker can fail: a missing file, a missing anchor (here and on another page),
    and a repeated heading's anchor; links in code are not links."""
    other = tmp_path / "other.md"
    other.write_text("# Other\n\n## Part\n\n## Part\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n"
        "[ok](other.md#part-1) [ok](#title) [ok](other.md) [web](https://example.com/x#y)\n"
        "[bad](missing.md) [bad](#nothing) [bad](other.md#part-2)\n"
        "`[code](missing.md)`\n\n```md\n[fenced](missing.md)\n# Fenced\n```\n[bad](#fenced)\n",
        encoding="utf-8",
    )
    assert broken_links([page], root=tmp_path) == [
        "page.md:4: missing.md (no such file)",
        "page.md:4: #nothing (no heading gives #nothing)",
        "page.md:4: other.md#part-2 (no heading gives #part-2)",
        "page.md:11: #fenced (no heading gives #fenced)",
    ]


# ------------------------------------------------------------------------------- runnable


def test_blocks_are_read_with_their_marker(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "1. step\n\n   ```sh runnable\n   echo hi\n     indented\n   ```\n\n"
        "```python\nprint()\n```\n````python runnable\n```\nx = 1\n````\n",
        encoding="utf-8",
    )
    blocks = read_page(page).blocks
    assert [(b.line, b.info, b.text, b.runnable_as) for b in blocks] == [
        (3, "sh runnable", "echo hi\n  indented", "sh"),
        (8, "python", "print()", None),
        (11, "python runnable", "```\nx = 1", "python"),
    ]


def test_some_blocks_are_runnable() -> None:
    """Zero marked blocks would make the test below pass vacuously."""
    blocks = runnable_blocks()
    assert len(blocks) >= 8, [b.id for b in blocks]
    assert {b.runnable_as for b in blocks} == {"sh", "python"}


def run_block(block: Block, workdir: Path) -> subprocess.CompletedProcess[str]:
    """Run ``block`` in ``workdir`` (holding copies of specs/ and generated/), with the
    repository on PYTHONPATH and this interpreter's bin/ first on PATH."""
    for name in ("specs", "generated"):
        shutil.copytree(REPO / name, workdir / name)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if block.runnable_as == "python":
        script = workdir / "block.py"
        script.write_text(block.text + "\n", encoding="utf-8")
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", block.text]
    return subprocess.run(
        argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def test_a_failing_block_fails(tmp_path: Path) -> None:
    """run_block reports a failing line in the middle of a block, not just the last one."""
    bad = Block(REPO / "README.md", 1, "sh runnable", "false\necho still here")
    assert run_block(bad, tmp_path).returncode != 0


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b.id)
def test_runnable_block(block: Block, tmp_path: Path) -> None:
    run = run_block(block, tmp_path)
    assert run.returncode == 0, (
        f"{block.id}: the block exited {run.returncode}\n{block.text}\n"
        f"--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}"
    )
