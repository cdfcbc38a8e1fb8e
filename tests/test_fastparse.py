"""The fast reader against lark: on every text, ``parse`` gives what lark alone gives (the
same IR, spans and rule indices, the same findings), whether the fast reader read the text
or left it to lark. Texts are generated statements of every kind (names that are also
keywords, every item of a rule's braces, blocks the fast reader hands to lark, comments and
blanks anywhere, glued tokens) and mutations of the example specs."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.bench_input_size import rules_text
from shardspec.frontend import ir
from shardspec.frontend.fastparse import _PLACES, _lexicon, fast_statements
from shardspec.frontend.parse import parse
from tests.mutations import mutated

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted([*REPO.glob("specs/*.shard"), *REPO.glob("tests/cases/*/spec.shard")])


def same(text: str) -> bool:
    """Both readers agree on ``text``; whether the fast one read it."""
    fast = parse(text, "f.shard")
    slow = parse(text, "f.shard", fast=False)
    assert fast == slow, text
    return fast_statements(text, ir.Source("f.shard", text)) is not None


KEYWORDS = sorted(_lexicon().keywords)
PLAIN = st.sampled_from(["a", "tp", "dp_shard", "ffn", "hidden", "x1", "_", "kv"])
# Mostly plain names, often keywords (lark reads most as names), now and then a word lark
# reads otherwise or refuses (a keyword glued to a name, a token too long, no name).
NAMES = st.one_of(
    PLAIN,
    PLAIN,
    PLAIN,
    st.sampled_from(KEYWORDS),
    st.sampled_from(["shardx", "overs", "a" * 5000, "9", "é"]),
)
NUMBERS = st.one_of(st.sampled_from(["1", "32", "0", "007", "1", "2"]), st.just("9" * 30))
PATTERNS = st.one_of(
    NAMES,
    st.sampled_from(["layers.*.w", "**", "*", "{a,b}.w", "layers.{i}.w", "a..b", "a.", "w*x"]),
)
# What goes between two tokens: mostly a blank; now and then nothing, a comment or a
# line break.
GAP = st.sampled_from([" ", " ", " ", " ", "\n", "\t", "", "  # note {}\n", "\n\n", "\r\n", "\f"])


@st.composite
def joined(draw: st.DrawFn, parts: list[str]) -> str:
    return "".join(p + draw(GAP) for p in parts)


def _list(draw: st.DrawFn, item: st.SearchStrategy[str], sep: str = ",") -> list[str]:
    out = [draw(item)]
    for _ in range(draw(st.integers(0, 2))):
        out += [sep, draw(item)]
    return out


@st.composite
def items(draw: st.DrawFn) -> list[str]:
    kind = draw(
        st.sampled_from(
            ["shard", "local", "replicate", "fuse", "checkpoint", "style", "heads", "view"]
        )
    )
    if kind == "view":
        return ["view", draw(NAMES)]
    if kind == "shard" or (kind == "checkpoint" and draw(st.booleans())):
        axes = [draw(NAMES)] if draw(st.booleans()) else ["(", *_list(draw, NAMES), ")"]
        head = ["checkpoint", "shard"] if kind == "checkpoint" else ["shard"]
        return [*head, draw(NAMES), "over", *axes]
    if kind == "checkpoint":
        return ["checkpoint", "replicate"]
    if kind in ("local", "replicate"):
        return [kind, *_list(draw, NAMES)]
    if kind == "fuse":
        comp = st.builds(lambda n, s: [n, s] if s else [n], NAMES, st.one_of(st.none(), NUMBERS))
        comps = [w for c in _list_of(draw, comp) for w in c]
        groups = [draw(NUMBERS), "groups", "of"] if draw(st.booleans()) else []
        squeezed = ["squeezed"] if draw(st.booleans()) else []
        stored = ["stored", "fused"] if draw(st.booleans()) else []
        return ["fuse", draw(NAMES), "as", *groups, *comps, *squeezed, *stored]
    if kind == "style":
        opts = draw(
            st.lists(
                st.one_of(
                    st.just(["dtensor"]),
                    st.builds(lambda io, n: [io, n], st.sampled_from(["input", "output"]), NAMES),
                ),
                max_size=3,
            )
        )
        return ["style", draw(NAMES), *[w for o in opts for w in o]]
    size = st.one_of(NUMBERS, NAMES)
    replicated = st.sampled_from([[], ["replicated"]])  # `heads k 16 replicated`
    heads = st.builds(lambda n, s, r: [n, s, *r], NAMES, size, replicated)
    return ["heads", *[w for h in _list_of(draw, heads) for w in h]]


def _list_of(draw: st.DrawFn, item: st.SearchStrategy[list[str]]) -> list[list[str]]:
    out = [draw(item)]
    for _ in range(draw(st.integers(0, 2))):
        out += [[","], draw(item)]
    return out


@st.composite
def statements(draw: st.DrawFn) -> list[str]:
    kind = draw(
        st.sampled_from(
            ["param"] * 6 + ["ignore", "fsdp", "manifest", "mesh", "hf", "pipeline", "checkpoint"]
        )
    )
    if kind == "param":
        dims: list[str] = []
        if draw(st.integers(0, 4)):
            inner = _list(draw, NAMES) if draw(st.integers(0, 3)) else []
            dims = ["[", *inner, "]"]
        if draw(st.integers(0, 5)):
            body = ["{", *[w for _ in range(draw(st.integers(0, 3))) for w in draw(items())], "}"]
        else:
            body = ["replicate"]
        return ["param", draw(PATTERNS), *dims, *body]
    if kind == "ignore":
        return ["ignore", draw(PATTERNS)]
    if kind == "fsdp":
        return ["fsdp", draw(NAMES)]
    if kind == "checkpoint":
        return ["checkpoint", "keys", draw(NAMES)]
    if kind == "manifest":
        return ["manifest", draw(st.sampled_from(['"m.json"', '"a { b } # c"', '""', '"x']))]
    if kind == "mesh":
        named = [draw(NAMES)] if draw(st.booleans()) else []  # a view
        return [
            "mesh",
            *named,
            "over",
            "8",
            "ranks",
            "{",
            draw(NAMES),
            ":",
            "*",
            draw(NAMES),
            ":",
            "2",
            "}",
        ]
    if kind == "hf":
        line = [draw(PATTERNS), "->", draw(PATTERNS)]
        if draw(st.booleans()):  # `pad 0 to 64`, `pad vocab to 64` (a rule's dimension)
            line += ["pad", draw(st.one_of(NUMBERS, NAMES)), "to", draw(NUMBERS)]
        # an fp8 line, its options in any order (`{key}` a brace the block's end skips)
        options = [["scale", "{key}_s"], ["block", draw(NUMBERS), "x", draw(NUMBERS)]]
        options += [[w] for w in ("ue8m0", "float32", "e4m3", "e5m2", draw(NAMES))]
        fp8 = ["fp8", draw(PATTERNS), *(w for o in draw(st.permutations(options))[:2] for w in o)]
        return ["hf", '"h}.json"', "{", *line, "# a } in a comment", "\n", "drop", "a.{x,y}",
                *fp8, "}"]  # fmt: skip
    return ["pipeline", draw(NAMES), "{", "first", draw(PATTERNS), "split", "layers.{l}", "}"]


@settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(statements(), max_size=5), st.data())
def test_generated_statements(stmts: list[list[str]], data: st.DataObject) -> None:
    text = "".join(data.draw(joined(s)) for s in stmts)
    same(text)


ATOMS = ["param ", "{", "}", "[", "]", "(", ")", ",", " ", "\n", "#", '"', "shard ", " over ",
         "replicate", "replicated", "heads", "fuse ", " as ", "3", "x", "*", ".", "local",
         "input", "mesh {", "hf {", "}\n", "é", "\x0b"]  # fmt: skip


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_examples_are_read_fast(example: Path) -> None:
    assert same(example.read_text(encoding="utf-8"))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(EXAMPLES), st.data())
def test_mutated_examples(example: Path, data: st.DataObject) -> None:
    same(data.draw(mutated(example.read_text(encoding="utf-8"), ATOMS)))


def test_a_large_generated_spec_is_read_fast() -> None:
    """The fast reader reads the specs that generators write (names that are also
    keywords included: ``heads heads 128``), or it would save nothing."""
    assert same(rules_text(300))


def test_every_place_is_a_state_of_lark() -> None:
    """Each place's text leaves lark's parser where the fast reader takes a name or a
    pattern (if the grammar changes, the table must): lark accepts a name (or pattern)
    there and nothing else the fast reader would take."""
    lexicon = _lexicon()
    for place in _PLACES:
        assert lexicon.accepted(place) == frozenset(), place  # no keyword where a name goes
