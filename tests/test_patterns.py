"""Parameter-name globs (``shardspec.core.patterns``): matching, captures, errors, precedence."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardspec.core.patterns import PatternError, compile_glob, describe_key


def matches(pattern: str, fqn: str) -> bool:
    return compile_glob(pattern).match(fqn) is not None


# ----------------------------------------------------------------------------- matching


@pytest.mark.parametrize(
    ("pattern", "fqn", "expected"),
    [
        # `*` is exactly one whole segment, never empty, never two
        ("layers.*.w", "layers.0.w", True),
        ("layers.*.w", "layers.10.w", True),
        ("layers.*.w", "layers..w", False),
        ("layers.*.w", "layers.0.1.w", False),
        ("layers.*.w", "layers.w", False),
        ("*", "w", True),
        ("*", "a.b", False),
        # literal segments match themselves only, whole
        ("embed.weight", "embed.weight", True),
        ("embed.weight", "embed.weights", False),
        ("embed.weight", "xembed.weight", False),
        ("embed.weight", "embed.weight.x", False),
        ("embed.weight", "embedxweight", False),  # '.' is not a regex wildcard
        # `**` at the start: zero or more leading segments
        ("**.w", "w", True),
        ("**.w", "a.w", True),
        ("**.w", "a.b.c.w", True),
        ("**.w", "aw", False),
        ("**.w", "a.w.x", False),
        # `**` in the middle: zero or more segments between
        ("a.**.w", "a.w", True),
        ("a.**.w", "a.b.w", True),
        ("a.**.w", "a.b.c.w", True),
        ("a.**.w", "a.bw", False),
        ("a.**.w", "ab.w", False),
        # `**` at the end: zero or more trailing segments
        ("a.**", "a", True),
        ("a.**", "a.b", True),
        ("a.**", "a.b.c", True),
        ("a.**", "ab", False),
        ("a.**", "b.a", False),
        ("**", "anything.at.all", True),
        # `*` inside a segment: any characters but a dot, none included
        ("w*", "w", True),
        ("w*", "w13", True),
        ("w*", "w.13", False),
        ("w*", "xw", False),
        ("*norm", "attention_norm", True),
        ("*norm", "norm", True),
        ("*norm", "norm_x", False),
        ("**.*norm.weight", "layers.0.ffn_norm.weight", True),
        ("**.*norm.weight", "norm.weight", True),
        ("**.*norm.weight", "layers.0.norm.bias", False),
        ("a*b", "ab", True),
        ("a*b", "a_x_b", True),
        ("a*b", "a.b", False),
        # `{a,b}`: one of the alternatives, whole, in a segment or as one
        ("w{1,3}", "w1", True),
        ("w{1,3}", "w3", True),
        ("w{1,3}", "w2", False),
        ("w{1,3}", "w13", False),
        ("attn.w{q,k,v}.weight", "attn.wk.weight", True),
        ("attn.w{q,k,v}.weight", "attn.wo.weight", False),
        ("{embed,head}.weight", "head.weight", True),
        ("{embed,head}.weight", "lm_head.weight", False),
        ("{a,b}{c,d}", "bc", True),
        ("{a,b}{c,d}", "cb", False),
    ],
)
def test_match(pattern: str, fqn: str, expected: bool) -> None:
    assert matches(pattern, fqn) is expected


def test_patterns_are_not_regexes() -> None:
    assert matches("a_b", "a_b")
    assert not matches("a.b", "axb")
    assert not matches("w1", "w1\n")
    with pytest.raises(PatternError):
        compile_glob("a+")


# ----------------------------------------------------------------------------- captures


def test_capture_binds_one_segment() -> None:
    g = compile_glob("layers.*.moe.local_experts.{expert}.w{1,3}.weight")
    assert g.captures == ("expert",)
    assert g.match("layers.0.moe.local_experts.3.w1.weight") == {"expert": "3"}
    assert g.match("layers.0.moe.local_experts.3.w2.weight") is None
    assert g.match("layers.0.moe.local_experts.3.4.w1.weight") is None
    assert g.match("layers.0.moe.local_experts..w1.weight") is None


def test_several_captures_and_captures_inside_a_segment() -> None:
    g = compile_glob("blocks.{block}.experts.e{expert}.weight")
    assert g.captures == ("block", "expert")
    assert g.match("blocks.2.experts.e17.weight") == {"block": "2", "expert": "17"}
    assert g.match("blocks.2.experts.17.weight") is None
    assert g.match("blocks.2.experts.e.weight") is None  # a capture is never empty


def test_patterns_without_captures_match_with_no_bindings() -> None:
    assert compile_glob("a.*.b").match("a.x.b") == {}
    assert compile_glob("a.*.b").captures == ()


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("", "empty pattern"),
        ("a..b", "empty segment"),
        (".a", "empty segment"),
        ("a.", "empty segment"),
        ("a**", "'**' must be a whole segment"),
        ("**b.c", "'**' must be a whole segment"),
        ("a-b", "characters other than letters"),
        ("a b", "characters other than letters"),
        ("{a,}", "empty alternative"),
        ("{,b}", "empty alternative"),
        ("{}", "empty braces"),
        ("{1x}", "must be a name"),
        ("{e}.{e}", "appears twice"),
        ("a{b", "never closed"),
        ("a}b", "closes no '{'"),
        ("{a{b}}", "braces nest"),
        ("{a.b}", "spans a '.'"),
        ("x.{b,c.d}", "spans a '.'"),
    ],
)
def test_malformed_patterns_raise_with_a_reason(pattern: str, reason: str) -> None:
    with pytest.raises(PatternError, match=re.escape(reason)):
        compile_glob(pattern)


def test_pattern_error_is_a_value_error() -> None:
    assert issubclass(PatternError, ValueError)


# ----------------------------------------------------------------------------- precedence


def key(pattern: str) -> tuple[int, int, int, int]:
    return compile_glob(pattern).key


@pytest.mark.parametrize(
    ("winner", "loser", "fqn"),
    [
        # 1. more literal segments: `hc_head` is literal, `*head` is not
        ("hc_head.*", "*head.*", "hc_head.fn"),
        ("layers.*.w", "**.w", "layers.0.w"),
        ("layers.*.attn.wq.weight", "layers.*.attn.*.weight", "layers.0.attn.wq.weight"),
        ("a.b.c", "*.b.c", "a.b.c"),
        # a literal segment beats any number of partial segments
        ("x.*.*", "x*.y*.z*", "x.y.z"),
        # 2. then fewer `**`
        ("a.**.*.c", "a.**.**.c", "a.b.c"),
        ("*.w", "**.w", "a.w"),
        # 3. then more partial segments: `w{1,3}` and `w*` constrain the text, `*` does not
        ("x.w{1,3}", "x.*", "x.w1"),
        ("x.w*", "x.*", "x.w1"),
        ("x.*norm", "x.*", "x.ffn_norm"),
        ("x.{a,b}", "x.*", "x.a"),
        ("x.w*.y*", "x.w*.*", "x.w1.y1"),
        ("x.e{e}", "x.{e}", "x.e1"),  # a capture with a literal prefix constrains
        # 4. then more literal characters
        ("x.ffn_*", "x.f*", "x.ffn_norm"),
        # (an alternation counts its shortest alternative)
        ("x.{attn,mlp}_norm", "x.*_norm", "x.attn_norm"),
        ("layers.*.w{1,3}", "layers.*.w*", "layers.0.w1"),
    ],
)
def test_precedence(winner: str, loser: str, fqn: str) -> None:
    assert matches(winner, fqn) and matches(loser, fqn)
    assert key(winner) > key(loser)


def test_key_components() -> None:
    # (literal segments, -number of '**', partial segments, literal characters)
    assert key("layers.*.feed_forward.w13.weight") == (4, 0, 0, 27)
    assert key("**.*norm.weight") == (1, -1, 1, 10)
    assert key("hc_head.*") == (1, 0, 0, 7)
    assert key("*head.*") == (0, 0, 1, 4)
    assert key("x.{e}") == (1, 0, 0, 1)
    assert key("attn.w{q,k,v}.weight") == (2, 0, 1, 12)
    assert key("x.{ab,cde}_n") == (1, 0, 1, 5)
    assert key("**") == (0, -1, 0, 0)


def test_equal_keys_are_ties() -> None:
    # Neither is more specific: lint reports such pairs (SS043) when both match a name.
    assert key("a.*.c") == key("*.b.c") == (2, 0, 0, 2)
    assert key("layers.10.*") == key("layers.*.w2") == (2, 0, 0, 8)
    assert key("x.{e}.y") == key("x.*.y")
    assert key("x.{ab,cd}") == key("x.{a,bcd}c") == (1, 0, 1, 3)


def test_precedence_never_depends_on_order() -> None:
    pats = ["**.w", "layers.*.w", "layers.0.w", "*.*.w", "layers.**"]
    ranked = sorted(pats, key=key, reverse=True)
    assert ranked[0] == "layers.0.w"
    assert sorted(reversed(pats), key=key, reverse=True) == ranked


def test_describe_key_names_the_criteria() -> None:
    text = describe_key(key("**.*norm.weight"))
    assert text == ("1 literal segment(s), 1 '**', 1 partial segment(s), 10 literal character(s)")


# ----------------------------------------------------------------------------- properties

_SEG = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(st.lists(_SEG, min_size=1, max_size=6))
def test_literal_patterns_match_exactly_themselves(segments: list[str]) -> None:
    fqn = ".".join(segments)
    g = compile_glob(fqn)
    assert g.match(fqn) == {}
    assert g.match(fqn + ".x") is None
    assert g.match("x." + fqn) is None
    assert g.key[0] == len(segments)


@settings(max_examples=150, deadline=None)
@given(st.lists(_SEG, min_size=1, max_size=6), st.data())
def test_wildcards_match_what_they_replace(segments: list[str], data: st.DataObject) -> None:
    fqn = ".".join(segments)
    i = data.draw(st.integers(0, len(segments) - 1))
    one = segments.copy()
    one[i] = "*"
    assert matches(".".join(one), fqn)
    j = data.draw(st.integers(i, len(segments)))
    many = [*segments[:i], "**", *segments[j:]]
    assert matches(".".join(many), fqn)
    cap = segments.copy()
    cap[i] = "{name}"
    assert compile_glob(".".join(cap)).match(fqn) == {"name": segments[i]}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.from_regex(r"[A-Za-z0-9_]{1,6}", fullmatch=True), min_size=1, max_size=6))
def test_literal_patterns_compile_as_every_pattern(segments: list[str]) -> None:
    """A pattern of literal segments takes a short way (its regex, captures and key follow
    from its text); it must give what the segment-by-segment compilation gives."""
    from shardspec.core.patterns import _compile

    text = ".".join(segments)
    fast, slow = compile_glob(text), _compile(text)
    assert (fast.source, fast.captures, fast.key) == (slow.source, slow.captures, slow.key)
    assert fast == slow and fast.regex.pattern == slow.regex.pattern


def test_globs_share_their_keys_and_captures() -> None:
    """A spec of half a million rules holds a glob per rule: one key and one captures tuple
    per distinct value, and no regex until one is matched."""
    a, b = compile_glob("layers.1.w{i}"), compile_glob("layers.2.w{i}")
    assert a.key is b.key and a.captures is b.captures == ("i",)
    c, d = compile_glob("model.layers.1.mlp"), compile_glob("model.layers.2.mlp")
    assert c.key is d.key and c._regex is None
    assert c.match("model.layers.1.mlp") == {} and c._regex is not None
