"""Syntax errors -> ``SS001`` diagnostics: where the error is, what the parser found and
expected (in words), and a hint for the mistakes people really make.

The hints are a table (:data:`_HINTS`), tried in order; the first that applies is given.
Most are a :class:`_Hint` (a terminal the parser expected, and the word found or the text
before it); the rest are small functions for the cases that need to look further.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from lark import Token
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span, clip
from shardspec.findings.suggest import closest

# Readable names for the grammar's terminals, for "expected ..." messages.
_TOKEN_NAMES = {
    "NAME": "a name",
    "INT": "a whole number",
    "PART_SIZE": "a whole number",
    "STRING": 'a quoted string ("...")',
    "PATTERN": "a parameter pattern",
    "REST": "'*'",
    "REPLICATE": "'replicate'",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LSQB": "'['",
    "RSQB": "']'",
    "LPAR": "'('",
    "RPAR": "')'",
    "COLON": "':'",
    "EQUAL": "'='",
    "ARROW": "'->'",
    "TRANSPOSE": "'transpose'",
    "ROPE": "'rope'",
    "PAD": "'pad'",
    "CONFIG_EXPR": "a product of config keys and whole numbers (a * b * 2)",
    "PIPE_LOCAL": "'local'",
    "COMMA": "','",
    "$END": "the end of the file",
}

# The first words of statements, of pipeline and hf block lines, and of a rule's body lines.
_STATEMENTS = ("fsdp", "hf", "ignore", "manifest", "mesh", "param", "pipeline")
_HF_ITEMS = ("config", "drop", "fp8", "keep", "tie")
_PIPE_ITEMS = ("first", "last", "split", "tie")
_BODY_ITEMS = ("checkpoint", "fuse", "heads", "local", "replicate", "shard", "style")


def syntax_error(path: str, text: str, err: UnexpectedInput) -> Diagnostic:
    """The ``SS001`` diagnostic for ``err``, a syntax error in ``text`` (file ``path``)."""
    w = _where(text, err)
    names = sorted({_token_name(t) for t in w.expected})
    hint = f"expected {_join_or(names)}" if names else ""
    friendly = _friendly(w)
    if friendly:
        joint = " " if friendly.endswith("?") else "; "
        hint = f"{friendly}{joint}{hint}" if hint else friendly
    span = Span(path, w.line, w.col, w.line, w.col + w.width)
    return diag("SS001", f"syntax error: {w.found}", span, hint)


@dataclass
class _Where:
    """A syntax error as the hints read it. Nothing here splits the whole text into lines
    or rescans it per line: a hint costs at most a few passes over the text."""

    text: str
    line: int  # 1-based; at the end of the text, just after its last code
    col: int
    width: int  # of the word found, on its line
    found: str  # "unexpected ..."
    word: str  # the token or character found, "" at the end of the text
    expected: set[str]  # the terminals the parser expected
    at_end: bool
    line_start: int  # offset of the error's line in the text

    @cached_property
    def src(self) -> str:
        """The error's line without its comment."""
        end = self.text.find("\n", self.line_start)
        return _code_part(self.text[self.line_start : end if end >= 0 else len(self.text)])

    @property
    def stripped(self) -> str:
        return self.src.strip()

    @property
    def before(self) -> str:
        """The error's line up to the error, without its comment."""
        return self.src[: self.col - 1]

    @cached_property
    def before_or_prior(self) -> str:
        """:attr:`before`, or the last line of code above when the error is the first thing
        on its line."""
        if self.before.strip():
            return self.before
        end = self.line_start - 1  # the "\n" that ends the line above
        while end >= 0:
            start = self.text.rfind("\n", 0, end) + 1
            code = _code_part(self.text[start:end])
            if code.strip():
                return code
            end = start - 1
        return ""

    @property
    def text_before(self) -> str:
        """The text up to the error, comments included."""
        return self.text[: self.line_start] + self.before


def _line_start(text: str, line: int, pos: int | None, col: int) -> int:
    """The offset where 1-based ``line`` starts: from the error's offset ``pos`` and column
    where lark gives them, else by counting lines."""
    if pos is not None:
        start = pos - (col - 1)
        if 0 <= start <= len(text) and (start == 0 or text[start - 1] == "\n"):
            return start
    start = 0
    for _ in range(line - 1):
        nl = text.find("\n", start)
        if nl < 0:
            break
        start = nl + 1
    return start


def _where(text: str, err: UnexpectedInput) -> _Where:
    token: Token | None = getattr(err, "token", None)
    at_end = isinstance(err, UnexpectedEOF) or (token is not None and token.type == "$END")
    pos: int | None = None
    if at_end:
        line, col, pos = _end_of_text(text)
    else:
        line, col = err.line or 1, err.column or 1
    width, word = 1, ""
    if isinstance(err, UnexpectedToken):
        expected = set(err.accepts or err.expected)
        found = "unexpected end of file"
        if not at_end:
            word = str(err.token)
            found = f"unexpected {clip(word)!r}"
            width = max(1, len(word.split("\n", 1)[0]))
            pos = err.token.start_pos
    elif isinstance(err, UnexpectedCharacters):
        expected = set(err.allowed or ())
        pos = err.pos_in_stream or 0
        word = text[pos] if pos < len(text) else ""
        found = f"unexpected character {word!r}"
    else:
        expected = set(getattr(err, "expected", ()) or ())
        found = "unexpected end of file"
    expected.discard("COMMENT")
    start = _line_start(text, line, pos, col)
    return _Where(text, line, col, width, found, word, expected, at_end, start)


def _token_name(t: str) -> str:
    if t in _TOKEN_NAMES:
        return _TOKEN_NAMES[t]
    if t.startswith("__ANON") or not t.isupper():
        return repr(t)
    return repr(t.lower())


def _join_or(names: list[str]) -> str:
    if len(names) <= 2:
        return " or ".join(names)
    return ", ".join(names[:-1]) + f" or {names[-1]}"


def _end_of_text(text: str) -> tuple[int, int, int]:
    """(line, col, offset) just after the last thing that is not blank or a comment."""
    end = len(text)
    while end >= 0:
        start = text.rfind("\n", 0, end) + 1
        code = _code_part(text[start:end]).rstrip()
        if code:
            return text.count("\n", 0, start) + 1, len(code) + 1, start + len(code)
        end = start - 1
    return 1, 1, 0


def _code_part(line: str) -> str:
    """``line`` without its comment (a ``#`` outside a string)."""
    start = comment_start(line)
    return line if start is None else line[:start]


def comment_start(line: str) -> int | None:
    """Index of the ``#`` that starts the comment on ``line``, ``None`` if there is none.
    Strings cannot span lines, so one line is enough to tell."""
    hash_at = line.find("#")
    if hash_at < 0:
        return None
    quote = line.find('"', 0, hash_at)
    while quote >= 0:  # a "#" inside a string is text: find the next one after it closes
        close = line.find('"', quote + 1)
        if close < 0:
            return None
        if close > hash_at:
            hash_at = line.find("#", close + 1)
            if hash_at < 0:
                return None
        quote = line.find('"', close + 1, hash_at)
    return hash_at


def _unclosed_brace(text: str) -> int | None:
    """The line of the last ``{`` that no ``}`` closes (outside strings and comments;
    the braces of a pattern's ``{a,b}`` pair up among themselves)."""
    stack: list[int] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if "{" not in line and "}" not in line:
            continue
        in_string = False
        for ch in _code_part(line):
            if ch == '"':
                in_string = not in_string
            elif in_string:
                continue
            elif ch == "{":
                stack.append(lineno)
            elif ch == "}" and stack:
                stack.pop()
    return stack[-1] if stack else None


# -- the hints ------------------------------------------------------------------------------


def _friendly(w: _Where) -> str:
    """The first hint of :data:`_HINTS` that applies to ``w``, ``""`` if none does."""
    for hint in _HINTS:
        message = hint(w)
        if message:
            return message
    return ""


@dataclass(frozen=True)
class _Hint:
    """``message``, when the parser expected all of ``expects`` (exactly those, with
    ``exactly``), the word found passes ``word``, the error's line up to the error has a
    match of ``before`` and the error's line starts with a match of ``line``."""

    message: str
    expects: frozenset[str] = frozenset()
    exactly: bool = False
    word: Callable[[str], bool] | None = None
    before: re.Pattern[str] | None = None
    line: re.Pattern[str] | None = None

    def __call__(self, w: _Where) -> str:
        if not (w.expected == self.expects if self.exactly else self.expects <= w.expected):
            return ""
        if self.word is not None and not self.word(w.word):
            return ""
        if self.before is not None and not self.before.search(w.before):
            return ""
        if self.line is not None and not self.line.match(w.stripped):
            return ""
        return self.message


def _expects(*terminals: str) -> frozenset[str]:
    return frozenset(terminals)


def _is(text: str) -> Callable[[str], bool]:
    return lambda word: word == text


def _unclosed_block(w: _Where) -> str:
    if not (w.at_end and "RBRACE" in w.expected):
        return ""
    open_line = _unclosed_brace(w.text)
    where = f" on line {open_line}" if open_line else ""
    return f"the `{{`{where} is never closed: add `}}`"


def _arrow_then_as(line: str) -> bool:
    """Whether ``line`` has ``->``, then a word, then the word ``as`` (a split line's
    ``as`` list). One pass: the first ``->`` leaves the most room after it (the regex
    ``->\\s*\\S+.*\\bas\\b`` it replaces backtracked quadratically)."""
    arrow = line.find("->")
    if arrow < 0:
        return False
    rest = line[arrow + 2 :]
    word = len(rest) - len(rest.lstrip())  # the first character of the target
    return word < len(rest) and _AS.search(rest, word + 1) is not None


_AS = re.compile(r"\bas\b")


def _hf_parts(w: _Where) -> str:
    """A split line's ``as`` list (the error may be the first thing on the next line)."""
    if not (
        w.expected & {"NAME", "PART_SIZE", "RPAR", "CONFIG_EXPR"}
        and _arrow_then_as(w.before_or_prior)
    ):
        return ""
    if "RPAR" in w.expected or "CONFIG_EXPR" in w.expected:
        return (
            "a size from config.json is a product in parentheses: "
            "`k (num_key_value_heads * head_dim)`"
        )
    return (
        "after `as`, name the target's fused components in the checkpoint's order, "
        "separated by commas, each with an optional size and transforms: "
        "`as q 64 rope 16, k 32 rope 16, v 32`"
    )


_FP8_LINE = re.compile(r"\s*fp8\b")
_FP8_WORDS = ("scale", "block", "ue8m0", "float32", "bfloat16", "float16", "e4m3", "e5m2")
_FP8_OPTIONS = (
    "an fp8 line's options are `scale TEMPLATE`, `block R x C`, the scale format "
    "(`float32`, `bfloat16`, `float16` or `ue8m0`) and `e4m3` (or `e5m2`)"
)
_FP8_BLOCK = "write the block size as `block R x C`, rows x columns: `block 128 x 128`"


def _fp8_line(w: _Where) -> str:
    """The usual mistakes in an hf block's ``fp8`` line (the error on it, or first on the
    next line): the block size, the scale template, an option spelled otherwise (which the
    parser reads as the start of a map line, then misses its ``->``)."""
    line = w.before_or_prior
    if not _FP8_LINE.match(line):
        return _fp8_keyword(w, line)
    before = line.rstrip()
    if "X" in w.expected or ("INT" in w.expected and re.search(r"\b(block|x)$", before)):
        return _FP8_BLOCK
    if "PATTERN" in w.expected and before.endswith("scale"):
        return (
            "write `scale {key}_scale_inv`, without quotes: the scale's key, `{key}` standing "
            "for the weight's"
        )
    if "PATTERN" in w.expected and before.strip() == "fp8":
        return "write `fp8 GLOB`, the HF keys stored in FP8: `fp8 model.layers.*.mlp.*_proj.weight`"
    if "ARROW" not in w.expected:
        return ""
    # The word after the glob that is no option (the parser took it for a map line's name).
    words = line.split()[2:]
    if ("x" in words or w.word == "x") and "block" not in words:  # `128 x 128`, a bare `x`
        return "the block size follows `block`: `block R x C`, rows x columns (`block 128 x 128`)"
    known = {*_FP8_WORDS, "x"}
    odd = next(
        (
            x
            for i, x in enumerate(words)
            if x not in known and not x.isdigit() and (i == 0 or words[i - 1] != "scale")
        ),
        None,
    )
    if odd is None:
        return ""
    guess = next((o for o in ("ue8m0", "e4m3", "e5m2") if o[-4:] in odd.lower()), None)
    guess = guess or closest(odd.lower(), _FP8_WORDS)
    mean = f"did you mean `{guess}`? " if guess else ""
    return f"`{odd}` is no option of an fp8 line: {mean}{_FP8_OPTIONS}"


def _fp8_keyword(w: _Where, line: str) -> str:
    """``fp8`` misspelled at the start of an hf block's line."""
    first = line.split()[:1]
    if "ARROW" not in w.expected or not first or first[0] == "fp8" or "->" in line:
        return ""
    if closest(first[0].lower(), ("fp8",)) is None:
        return ""
    return f"did you mean `fp8`? write `fp8 GLOB [options]`; {_FP8_OPTIONS}"


def _tie(w: _Where) -> str:
    """A ``tie`` line without its ``=``: in a pipeline block or in an hf block."""
    if not ("EQUAL" in w.expected and re.search(r"\btie\s+\S+\s*$", w.before)):
        return ""
    upto = w.text_before
    if re.search(r"\bpipeline\s+\w+\s*\{", upto[upto.rfind("}") + 1 :]):
        return "write `tie ALIAS = SOURCE`, two parameter names (`tie output.weight = ...`)"
    return "write `tie ALIAS = SOURCE` (two Hugging Face names)"


def _pipeline_line(w: _Where) -> str:
    """An unknown word where a pipeline block's line starts."""
    if not ("SPLIT" in w.expected and w.word and w.word != "}"):
        return ""
    guess = closest(w.word.lower(), _PIPE_ITEMS)
    hint = f"did you mean `{guess}`? " if guess else ""
    return hint + "a pipeline block holds first, last, split and tie lines"


def _misplaced_line(w: _Where) -> str:
    """A pipeline or hf block's line outside its block."""
    if "PARAM" not in w.expected:
        return ""
    if w.word in _PIPE_ITEMS:
        return f"`{w.word}` goes inside a `pipeline AXIS {{ ... }}` block"
    if w.word in _HF_ITEMS:
        return f"`{w.word}` goes inside an `hf {{ ... }}` block"
    return ""


def _split_counts(w: _Where) -> str:
    if "INT" in w.expected and re.search(r"\b(as|,)\s*$", w.before) and "split" in w.before:
        return "write the layers per stage as whole numbers: `split layers.{layer} as 3, 5`"
    return ""


_PAD_FORM = (
    "write `pad D to M`: D the dimension's index or the rule's name for it, M the multiple, "
    "times mesh axes' sizes after `x` (vLLM: `pad vocab to 64`; Megatron: `pad 0 to 128 x tp`)"
)
_TRANSFORM_WORDS = ("pad", "rope", "transpose", "grouped")


def _pad_line(w: _Where) -> str:
    """A ``pad`` transform written wrong, or a transform's name misspelled on a map line."""
    before = w.before if w.before.strip() else w.before_or_prior
    if re.search(r"\bpad\s*$", before) and "INT" in w.expected:
        return _PAD_FORM
    if re.search(r"\bpad\s+\d+\s*$", before) or re.search(r"\bpad\s+\d+\s+to\s*$", before):
        return _PAD_FORM
    if re.search(r"\bpad\s+\d+\s+to\s+\d+(?:\s+x\s+\w+)*\s*(?:x|\*)\s*$", before):
        return "multiply the multiple by a mesh axis's size with `x AXIS`: `pad 0 to 128 x tp`"
    if "->" not in before or "ARROW" not in w.expected:
        return ""
    # `padd 0 to 64`: the misspelled word was read as the next map line's HF name.
    words = before.split("->", 1)[1].split()
    odd = words[-1] if len(words) >= 2 else ""
    guess = closest(odd.lower(), _TRANSFORM_WORDS) if odd.isalpha() else None
    if guess is None:
        return ""
    form = {"pad": _PAD_FORM, "rope": "`rope N`, N the head size in rows"}.get(guess, "")
    return f"did you mean `{guess}`?" + (f" ({form})" if form else "")


def _mesh_size(w: _Where) -> str:
    if w.expected & {"INT", "REST"} and not w.expected & {"NAME", "COMMA"} and w.word:
        return "a mesh axis size is a positive whole number, or `*` for the rest of the world"
    return ""


_HEADS_FORM = (
    "`heads DIM SIZE`, SIZE one head's size: a whole number, a factory argument or a "
    "config.json key (`heads kv 128`, `heads kv head_dim`)"
)


_HEADS = re.compile(r"[ \t]*heads\b")


def _heads_line(w: _Where) -> str:
    """The usual mistakes in a ``heads`` line: the error is on it (or first on the next
    line), after the last ``{`` of that line."""
    item = w.before_or_prior.rpartition("{")[2]
    head = _HEADS.match(item)
    if head is None or "}" in item:
        return ""
    typed = item[head.end() :].split()
    if w.word == "of" or typed[-1:] == ["of"]:
        return "write `heads kv 128`, without `of`"
    if w.word.isdigit() and "INT" not in w.expected and (not typed or typed[-1].endswith(",")):
        return f"the dimension comes first: {_HEADS_FORM}"
    if "INT" in w.expected or "NAME" in w.expected:
        return f"write {_HEADS_FORM}"
    if "COMMA" in w.expected and w.word:
        return "separate the dimensions with commas, one size each: `heads q 128, k 128`"
    return ""


def _spaced_pattern(w: _Where) -> str:
    """A pattern token with a ``{`` that no ``}`` follows (not one regex, which backtracks
    quadratically over a token of many ``{``)."""
    head = re.match(r"(param|ignore)\s+(\S+)\s", w.stripped)
    if head and "{" in head.group(2).rpartition("}")[2]:
        return "a pattern has no spaces: write alternatives as `{a,b}`"
    return ""


def _statement(w: _Where) -> str:
    """An unknown word where a statement starts."""
    if not ("PARAM" in w.expected and w.word):
        return ""
    if w.word in _BODY_ITEMS:
        return f"`{w.word}` goes inside a rule: `param PATTERN [dims] {{ {w.word} ... }}`"
    guess = closest(w.word.lower(), _STATEMENTS)
    if guess:
        return f"did you mean `{guess}`?"
    return "a statement starts with manifest, mesh, fsdp, ignore, param, pipeline or hf"


def _rule_line(w: _Where) -> str:
    """An unknown word where a rule's body line starts."""
    if not ("SHARD" in w.expected and w.word and w.word != "}"):
        return ""
    if w.word == "fp8":
        return "`fp8` goes inside an `hf { ... }` block"
    if re.search(r"\bshard\s+\w+\s+over\s+\w+\s*$", w.before):
        return "several axes on one dimension go in parentheses, outer first: `over (tp, dp)`"
    guess = closest(w.word.lower(), _BODY_ITEMS)
    if guess:
        return f"did you mean `{guess}`?"
    return (
        "a rule's body holds shard, fuse, heads, local, replicate, checkpoint, style and view lines"
    )


_HINTS: tuple[Callable[[_Where], str], ...] = (
    _unclosed_block,
    _hf_parts,
    _pad_line,
    _fp8_line,
    # hf and pipeline blocks
    _Hint(
        "an hf map line is written `HF_NAME -> MODEL_NAME` (`model.norm.weight -> norm.weight`)",
        _expects("ARROW"),
    ),
    _Hint(
        "write `config NAME = key * key * 2` (config.json keys and whole numbers)",
        _expects("CONFIG_EXPR"),
    ),
    _tie,
    _Hint("write `config NAME = key * key * 2`", _expects("EQUAL")),
    _Hint(
        "write `rope N`, N the head size in rows",
        _expects("INT"),
        before=re.compile(r"\brope\s*$"),
    ),
    _Hint(
        "the counts come before `local`: `split layers.{layer} as 3, 5 local`",
        _expects("SPLIT"),
        word=_is("as"),
        before=re.compile(r"\bsplit\s+\S+\s+local\s*$"),
    ),
    _Hint(
        "separate the counts with commas: `split layers.{layer} as 3, 5`",
        _expects("SPLIT"),
        word=str.isdigit,
        before=re.compile(r"\bsplit\s+\S+\s+as\b"),
    ),
    _Hint(
        "the counts follow `as`: `split layers.{layer} as 3, 5`",
        _expects("SPLIT"),
        word=str.isdigit,
        before=re.compile(r"\bsplit\s+\S+\s*$"),
    ),
    _pipeline_line,
    _Hint(
        "`tie` goes inside a `pipeline` block (parameters) or an `hf` block (HF keys)",
        _expects("PARAM"),
        word=_is("tie"),
    ),
    _misplaced_line,
    # the mesh
    _Hint(
        "mesh axes are written `name: size`, for example `tp: 2`",
        _expects("COLON"),
        word=lambda word: word not in (":", ""),
    ),
    _Hint(
        "mesh axes are separated by spaces or new lines, not commas",
        _expects("NAME", "RBRACE", "AKA"),  # (after a size, `aka` may follow)
        exactly=True,
        word=_is(","),
    ),
    _split_counts,
    _mesh_size,
    # a rule's body
    _heads_line,
    _Hint(
        "write `shard DIM over AXIS` (or `over (OUTER, INNER)`)",
        _expects("OVER"),
        line=re.compile(r"^shard\s+\w+\s+(on|by|across|along)\b"),
    ),
    _Hint("write `shard DIM over AXIS`", _expects("OVER")),
    _Hint(
        "separate the axes in parentheses with commas: `over (tp, dp)`",
        _expects("COMMA", "RPAR"),
        exactly=True,
    ),
    _Hint("write `fuse DIM as a, b` (or `as q 32, k 16, v 16`)", _expects("AS")),
    _Hint("write `fuse DIM as N groups of a 32, b 16`", _expects("OF")),
    _Hint("write `stored fused`", _expects("FUSED")),
    _Hint("write `mesh over N ranks { ... }`", _expects("RANKS")),
    # anywhere
    _Hint("statements end at the end of the line; there is no `;`", word=_is(";")),
    _Hint('a string must end with `"` on the same line', _expects("STRING"), word=_is('"')),
    # a rule's head
    _Hint(
        "patterns are written without quotes: `param layers.*.wq.weight [...]`",
        _expects("PATTERN"),
        word=lambda word: word.startswith('"'),
    ),
    _spaced_pattern,
    _Hint("close the dimension list with `]`", _expects("COMMA", "RSQB"), exactly=True),
    _Hint(
        "a rule names the parameter's dimensions: `param PATTERN [dim, ...] { ... }`",
        _expects("LSQB", "LBRACE"),
        line=re.compile(r"^param\b"),
    ),
    _Hint("a rule needs a body: `{ ... }`, or `replicate`", _expects("LBRACE", "REPLICATE")),
    # a line that starts with an unknown word
    _Hint("this `}` closes nothing", _expects("PARAM"), word=_is("}")),
    _statement,
    _rule_line,
)
