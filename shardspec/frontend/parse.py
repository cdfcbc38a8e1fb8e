"""Text -> IR. A lark LALR parser over ``grammars/shardspec.lark`` and a transformer that
turns the tree into :mod:`shardspec.frontend.ir` objects with source spans.

Syntax errors come back as ``SS001`` diagnostics (with the tokens that were expected),
never as exceptions.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span
from shardspec.frontend import ir
from shardspec.inputs.textfile import read_text

GRAMMAR_NAME = "shardspec.lark"


def _grammar_path() -> Path:
    package = Path(__file__).resolve().parent.parent  # shardspec/
    # installed: the package data shardspec/grammars/; from a checkout: grammars/ beside it
    for candidate in (
        package / "grammars" / GRAMMAR_NAME,
        package.parent / "grammars" / GRAMMAR_NAME,
    ):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(GRAMMAR_NAME)  # pragma: no cover - packaging error


@lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark(
        _grammar_path().read_text(encoding="utf-8"),
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=False,
        # Cache the built parser (a pickle in the temp directory, keyed by the grammar's
        # hash): saves rebuilding the LALR tables on every lint.
        cache=True,
    )


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
    "CONFIG_EXPR": "a product of config keys and whole numbers (a * b * 2)",
    "PIPE_LOCAL": "'local'",
    "COMMA": "','",
    "$END": "the end of the file",
}

_SUPPRESS = re.compile(r"#\s*shardspec:\s*ignore\[([A-Za-z0-9_,\s]*)\]")


def _token_name(t: str) -> str:
    if t in _TOKEN_NAMES:
        return _TOKEN_NAMES[t]
    if t.startswith("__ANON") or not t.isupper():
        return repr(t)
    return repr(t.lower())


def _span(path: str, meta: object) -> Span:
    return Span(
        path,
        getattr(meta, "line", 1),
        getattr(meta, "column", 1),
        getattr(meta, "end_line", None),
        getattr(meta, "end_column", None),
    )


def _tok_span(path: str, tok: Token) -> Span:
    return Span(path, tok.line or 1, tok.column or 1, tok.end_line, tok.end_column)


class _ToIR(Transformer):
    """Lark tree -> IR objects. Statements come out as (kind, node) pairs."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.rule_index = 0

    def _name(self, tok: Token) -> ir.Name:
        return ir.Name(span=_tok_span(self.path, tok), text=str(tok))

    @v_args(meta=True)
    def manifest_stmt(self, meta, children):
        (tok,) = children
        return ("manifest", (str(tok)[1:-1], _tok_span(self.path, tok)), _span(self.path, meta))

    @v_args(meta=True)
    def world(self, meta, children):
        return int(children[0])

    @v_args(meta=True)
    def axis_decl(self, meta, children):
        name, size = children
        return ir.AxisDecl(
            span=_span(self.path, meta),
            name=self._name(name),
            size=None if size.type == "REST" else int(size),
        )

    @v_args(meta=True)
    def mesh_stmt(self, meta, children):
        world = next((c for c in children if isinstance(c, int)), None)
        axes = [c for c in children if isinstance(c, ir.AxisDecl)]
        node = ir.MeshDecl(span=_span(self.path, meta), axes=axes, world=world)
        return ("mesh", node, node.span)

    @v_args(meta=True)
    def fsdp_stmt(self, meta, children):
        return ("fsdp", self._name(children[0]), _span(self.path, meta))

    @v_args(meta=True)
    def ignore_stmt(self, meta, children):
        tok = children[0]
        pat = ir.Pattern(span=_tok_span(self.path, tok), text=str(tok))
        return ("ignore", ir.IgnoreRule(span=_span(self.path, meta), pattern=pat), None)

    def dims(self, children):
        return [self._name(t) for t in children]

    def axis_list(self, children):
        return [self._name(t) for t in children]

    @v_args(meta=True)
    def shard_item(self, meta, children):
        dim, axes = children
        return ir.ShardItem(span=_span(self.path, meta), dim=self._name(dim), axes=axes)

    @v_args(meta=True)
    def local_item(self, meta, children):
        return ("local", [self._name(t) for t in children])

    @v_args(meta=True)
    def replicate_item(self, meta, children):
        return ("replicate", [self._name(t) for t in children[1:]])

    @v_args(meta=True)
    def component(self, meta, children):
        name = children[0]
        size = int(children[1]) if len(children) > 1 else None
        return ir.Component(span=_span(self.path, meta), name=self._name(name), size=size)

    def components(self, children):
        return list(children)

    def groups(self, children):
        return (int(children[0]), children[1])

    def stored(self, children):
        return "stored"

    @v_args(meta=True)
    def fuse_item(self, meta, children):
        dim = children[0]
        body = children[1]
        groups = None
        if isinstance(body, tuple):
            groups, body = body
        return ir.FuseItem(
            span=_span(self.path, meta),
            dim=self._name(dim),
            components=body,
            groups=groups,
            stored_fused="stored" in children[2:],
        )

    @v_args(meta=True)
    def head_size(self, meta, children):
        target, size = children
        return ir.HeadSize(
            span=_span(self.path, meta),
            target=self._name(target),
            size=int(size) if size.type == "INT" else None,
            size_name=self._name(size) if size.type == "NAME" else None,
        )

    def heads_item(self, children):
        return ("heads", list(children))

    @v_args(meta=True)
    def checkpoint_shard(self, meta, children):
        dim, axes = children
        item = ir.ShardItem(span=_span(self.path, meta), dim=self._name(dim), axes=axes)
        return ("checkpoint", item)

    @v_args(meta=True)
    def checkpoint_replicate(self, meta, children):
        return ("checkpoint", _span(self.path, meta))

    def style_opt(self, children):
        if len(children) == 1:
            return ("dtensor", None)
        return (str(children[0]), self._name(children[1]))

    @v_args(meta=True)
    def style_item(self, meta, children):
        fields: dict = {}
        for key, value in children[1:]:
            fields[key] = True if key == "dtensor" else value
        return ir.StyleItem(span=_span(self.path, meta), kind=self._name(children[0]), **fields)

    def _pattern(self, tok: Token) -> ir.Pattern:
        return ir.Pattern(span=_tok_span(self.path, tok), text=str(tok))

    @v_args(meta=True)
    def hf_stack(self, meta, children):
        return self._name(children[0])

    @v_args(meta=True)
    def hf_transform(self, meta, children):
        kind = children[0]
        head_dim = int(children[1]) if len(children) > 1 else 0
        return ir.HFTransform(span=_span(self.path, meta), kind=str(kind), head_dim=head_dim)

    @v_args(meta=True)
    def hf_map(self, meta, children):
        hf, _arrow, target = children[0], children[1], children[2]
        stack = next((c for c in children[3:] if isinstance(c, ir.Name)), None)
        transforms = [c for c in children[3:] if isinstance(c, ir.HFTransform)]
        parts = next((c[1] for c in children[3:] if isinstance(c, tuple)), None)
        return ir.HFMapItem(
            span=_span(self.path, meta),
            hf=self._pattern(hf),
            target=self._pattern(target),
            stack=stack,
            transforms=transforms,
            parts=parts,
        )

    def hf_parts(self, children):
        return ("parts", list(children))

    @v_args(meta=True)
    def hf_size(self, meta, children):
        return ("size", self._factors(children[0]), _span(self.path, meta))

    @v_args(meta=True)
    def hf_part(self, meta, children):
        size = next((c for c in children[1:] if isinstance(c, tuple)), None)
        return ir.HFPart(
            span=_span(self.path, meta),
            name=self._name(children[0]),
            size=size[1] if size else None,
            size_span=size[2] if size else None,
            transforms=[c for c in children[1:] if isinstance(c, ir.HFTransform)],
        )

    def _factors(self, expr: Token) -> list[ir.HFConfigFactor]:
        """The factors of a ``config`` product (or a size), each with its own span."""
        factors = []
        line, col = expr.line or 1, expr.column or 1
        for m in re.finditer(r"[A-Za-z0-9_]+", str(expr)):
            start = col + m.start()
            factors.append(
                ir.HFConfigFactor(
                    span=Span(self.path, line, start, line, start + len(m.group())),
                    text=m.group(),
                )
            )
        return factors

    @v_args(meta=True)
    def hf_drop(self, meta, children):
        return ("drop", ir.HFGlob(span=_span(self.path, meta), pattern=self._pattern(children[0])))

    @v_args(meta=True)
    def hf_keep(self, meta, children):
        return ("keep", ir.HFGlob(span=_span(self.path, meta), pattern=self._pattern(children[0])))

    @v_args(meta=True)
    def hf_tie(self, meta, children):
        alias, source = children
        return ir.HFTie(
            span=_span(self.path, meta), alias=self._pattern(alias), source=self._pattern(source)
        )

    @v_args(meta=True)
    def hf_config(self, meta, children):
        name, expr = children
        factors = self._factors(expr)
        return ir.HFConfig(span=_span(self.path, meta), name=self._name(name), factors=factors)

    @v_args(meta=True)
    def hf_stmt(self, meta, children):
        fields: dict = {"maps": [], "drops": [], "ties": [], "keeps": [], "configs": []}
        for c in children:
            if isinstance(c, Token):
                fields["manifest"] = str(c)[1:-1]
                fields["manifest_span"] = _tok_span(self.path, c)
            elif isinstance(c, ir.HFMapItem):
                fields["maps"].append(c)
            elif isinstance(c, ir.HFTie):
                fields["ties"].append(c)
            elif isinstance(c, ir.HFConfig):
                fields["configs"].append(c)
            else:
                fields[f"{c[0]}s"].append(c[1])
        node = ir.HFBlock(span=_span(self.path, meta), **fields)
        return ("hf", node, node.span)

    @v_args(meta=True)
    def pipe_first(self, meta, children):
        return ("first", [self._pattern(t) for t in children])

    @v_args(meta=True)
    def pipe_last(self, meta, children):
        return ("last", [self._pattern(t) for t in children])

    @v_args(meta=True)
    def pipe_counts(self, meta, children):
        return ("counts", [int(t) for t in children], _span(self.path, meta))

    @v_args(meta=True)
    def pipe_split(self, meta, children):
        counts = next((c for c in children if isinstance(c, tuple)), None)
        return ir.StageSplit(
            span=_span(self.path, meta),
            pattern=self._pattern(children[0]),
            counts=counts[1] if counts else [],
            counts_span=counts[2] if counts else None,
            local_names=any(isinstance(c, Token) and c.type == "PIPE_LOCAL" for c in children),
        )

    @v_args(meta=True)
    def pipe_tie(self, meta, children):
        alias, source = children
        return ir.StageTie(
            span=_span(self.path, meta), alias=self._pattern(alias), source=self._pattern(source)
        )

    @v_args(meta=True)
    def pipeline_stmt(self, meta, children):
        fields: dict = {"first": [], "last": [], "splits": [], "ties": []}
        for c in children[1:]:
            if isinstance(c, ir.StageSplit):
                fields["splits"].append(c)
            elif isinstance(c, ir.StageTie):
                fields["ties"].append(c)
            else:
                fields[c[0]].extend(c[1])
        node = ir.Pipeline(span=_span(self.path, meta), axis=self._name(children[0]), **fields)
        return ("pipeline", node, node.span)

    def param_body(self, children):
        return list(children)

    def replicate_all(self, children):
        return "replicate"

    @v_args(meta=True)
    def param_stmt(self, meta, children):
        tok, body = children[0], children[-1]
        dims = children[1] if len(children) == 3 else None
        shards, fusions, local, replicate = [], [], [], []
        ckpt_shards: list[ir.ShardItem] = []
        ckpt_replicate: list[Span] = []
        styles: list[ir.StyleItem] = []
        heads: list[ir.HeadSize] = []
        if body != "replicate":
            for item in body:
                if isinstance(item, ir.StyleItem):
                    styles.append(item)
                elif isinstance(item, ir.ShardItem):
                    shards.append(item)
                elif isinstance(item, ir.FuseItem):
                    fusions.append(item)
                elif item[0] == "local":
                    local.extend(item[1])
                elif item[0] == "heads":
                    heads.extend(item[1])
                elif item[0] == "checkpoint":
                    if isinstance(item[1], ir.ShardItem):
                        ckpt_shards.append(item[1])
                    else:
                        ckpt_replicate.append(item[1])
                else:
                    replicate.extend(item[1])
        rule = ir.Rule(
            span=_span(self.path, meta),
            index=self.rule_index,
            pattern=ir.Pattern(span=_tok_span(self.path, tok), text=str(tok)),
            dims=dims or [],
            dims_given=dims is not None,
            replicate_all=body == "replicate",
            shards=shards,
            fusions=fusions,
            local=local,
            replicate=replicate,
            checkpoint_shards=ckpt_shards,
            checkpoint_replicate=ckpt_replicate[0] if ckpt_replicate else None,
            style=styles[0] if styles else None,
            heads=heads,
            extra_styles=styles[1:],
        )
        self.rule_index += 1
        return ("param", rule, None)


_STATEMENTS = ("fsdp", "hf", "ignore", "manifest", "mesh", "param", "pipeline")
_HF_ITEMS = ("config", "drop", "keep", "tie")
_PIPE_ITEMS = ("first", "last", "split", "tie")
_BODY_ITEMS = ("checkpoint", "fuse", "heads", "local", "replicate", "shard", "style")


def _syntax_diag(path: str, text: str, err: UnexpectedInput) -> Diagnostic:
    line, col = err.line or 1, err.column or 1
    width = 1
    token: Token | None = getattr(err, "token", None)
    at_end = isinstance(err, UnexpectedEOF) or (token is not None and token.type == "$END")
    if at_end:
        line, col = _end_of_text(text)
    expected: set[str] = set()
    if isinstance(err, UnexpectedToken):
        expected = set(err.accepts or err.expected)
        found = "unexpected end of file" if at_end else f"unexpected {_describe_token(err.token)}"
        if not at_end:
            width = max(1, len(str(err.token).split("\n", 1)[0]))
    elif isinstance(err, UnexpectedCharacters):
        expected = set(err.allowed or ())
        ch = text[err.pos_in_stream] if err.pos_in_stream < len(text) else ""
        found = f"unexpected character {ch!r}"
    else:
        expected = set(getattr(err, "expected", ()) or ())
        found = "unexpected end of file"
    expected.discard("COMMENT")
    names = sorted({_token_name(t) for t in expected})
    hint = f"expected {_join_or(names)}" if names else ""
    word = "" if at_end or token is None else str(token)
    if isinstance(err, UnexpectedCharacters):
        word = text[err.pos_in_stream] if err.pos_in_stream < len(text) else ""
    friendly = _friendly(text, line, col, word, expected, at_end)
    if friendly:
        joint = " " if friendly.endswith("?") else "; "
        hint = f"{friendly}{joint}{hint}" if hint else friendly
    span = Span(path, line, col, line, col + width)
    return diag("SS001", f"syntax error: {found}", span, hint)


def _end_of_text(text: str) -> tuple[int, int]:
    """(line, col) just after the last thing that is not blank or a comment."""
    lines = text.split("\n")
    for i in range(len(lines) - 1, -1, -1):
        code = _code_part(lines[i]).rstrip()
        if code:
            return i + 1, len(code) + 1
    return 1, 1


def _code_part(line: str) -> str:
    """``line`` without its comment (a ``#`` outside a string)."""
    start = _comment_start(line)
    return line if start is None else line[:start]


def _comment_start(line: str) -> int | None:
    """Index of the ``#`` that starts the comment on ``line``, ``None`` if there is none.
    Strings cannot span lines, so one line is enough to tell."""
    in_string = False
    for i, ch in enumerate(line):
        if ch == '"':
            in_string = not in_string
        elif ch == "#" and not in_string:
            return i
    return None


def _describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    return f"{str(tok)!r}"


def _join_or(names: list[str]) -> str:
    if len(names) <= 2:
        return " or ".join(names)
    return ", ".join(names[:-1]) + f" or {names[-1]}"


def _closest(word: str, options: tuple[str, ...]) -> str | None:
    import difflib

    close = difflib.get_close_matches(word.lower(), options, n=1, cutoff=0.6)
    return close[0] if close else None


def _friendly(text: str, line: int, col: int, word: str, expected: set[str], at_end: bool) -> str:
    """Map the mistakes people really make to a sentence."""
    lines = text.split("\n")
    src = _code_part(lines[line - 1]) if 0 < line <= len(lines) else ""
    stripped = src.strip()
    before = src[: col - 1]
    if at_end and "RBRACE" in expected:
        open_line = _unclosed_brace(text)
        where = f" on line {open_line}" if open_line else ""
        return f"the `{{`{where} is never closed: add `}}`"
    # (the line before, when the error is the first thing on its line)
    prior = next((c for c in (_code_part(x) for x in reversed(lines[: line - 1])) if c.strip()), "")
    upto = before if before.strip() else prior
    if expected & {"NAME", "PART_SIZE", "RPAR", "CONFIG_EXPR"} and re.search(
        r"->\s*\S+.*\bas\b", upto
    ):
        if "RPAR" in expected or "CONFIG_EXPR" in expected:
            return (
                "a size from config.json is a product in parentheses: "
                "`k (num_key_value_heads * head_dim)`"
            )
        return (
            "after `as`, name the target's fused components in the checkpoint's order, "
            "separated by commas, each with an optional size and transforms: "
            "`as q 64 rope 16, k 32 rope 16, v 32`"
        )
    if "ARROW" in expected:
        return (
            "an hf map line is written `HF_NAME -> MODEL_NAME` (`model.norm.weight -> norm.weight`)"
        )
    if "CONFIG_EXPR" in expected:
        return "write `config NAME = key * key * 2` (config.json keys and whole numbers)"
    if "EQUAL" in expected and re.search(r"\btie\s+\S+\s*$", before):
        upto = "\n".join([*lines[: line - 1], before])
        if re.search(r"\bpipeline\s+\w+\s*\{", upto[upto.rfind("}") + 1 :]):
            return "write `tie ALIAS = SOURCE`, two parameter names (`tie output.weight = ...`)"
        return "write `tie ALIAS = SOURCE` (two Hugging Face names)"
    if "EQUAL" in expected:
        return "write `config NAME = key * key * 2`"
    if "INT" in expected and re.search(r"\brope\s*$", before):
        return "write `rope N`, N the head size in rows"
    if "SPLIT" in expected and word == "as" and re.search(r"\bsplit\s+\S+\s+local\s*$", before):
        return "the counts come before `local`: `split layers.{layer} as 3, 5 local`"
    if "SPLIT" in expected and word.isdigit() and re.search(r"\bsplit\s+\S+\s+as\b", before):
        return "separate the counts with commas: `split layers.{layer} as 3, 5`"
    if "SPLIT" in expected and word.isdigit() and re.search(r"\bsplit\s+\S+\s*$", before):
        return "the counts follow `as`: `split layers.{layer} as 3, 5`"
    if "SPLIT" in expected and word and word != "}":
        guess = _closest(word, _PIPE_ITEMS)
        hint = f"did you mean `{guess}`? " if guess else ""
        return hint + "a pipeline block holds first, last, split and tie lines"
    if "PARAM" in expected and word == "tie":
        return "`tie` goes inside a `pipeline` block (parameters) or an `hf` block (HF keys)"
    if "PARAM" in expected and word in _PIPE_ITEMS:
        return f"`{word}` goes inside a `pipeline AXIS {{ ... }}` block"
    if "PARAM" in expected and word in _HF_ITEMS:
        return f"`{word}` goes inside an `hf {{ ... }}` block"
    if "COLON" in expected and word not in (":", ""):
        return "mesh axes are written `name: size`, for example `tp: 2`"
    if word == "," and expected == {"NAME", "RBRACE"}:
        return "mesh axes are separated by spaces or new lines, not commas"
    if "INT" in expected and re.search(r"\b(as|,)\s*$", before) and "split" in before:
        return "write the layers per stage as whole numbers: `split layers.{layer} as 3, 5`"
    if expected & {"INT", "REST"} and not expected & {"NAME", "COMMA"} and word:
        return "a mesh axis size is a positive whole number, or `*` for the rest of the world"
    upto = "\n".join([*(_code_part(x) for x in lines[: line - 1]), before])
    heads = _heads_hint(upto, word, expected)
    if heads:
        return heads
    if "OVER" in expected and re.match(r"^shard\s+\w+\s+(on|by|across|along)\b", stripped):
        return "write `shard DIM over AXIS` (or `over (OUTER, INNER)`)"
    if "OVER" in expected:
        return "write `shard DIM over AXIS`"
    if expected == {"COMMA", "RPAR"}:
        return "separate the axes in parentheses with commas: `over (tp, dp)`"
    if "AS" in expected:
        return "write `fuse DIM as a, b` (or `as q 32, k 16, v 16`)"
    if "OF" in expected:
        return "write `fuse DIM as N groups of a 32, b 16`"
    if "FUSED" in expected:
        return "write `stored fused`"
    if "RANKS" in expected:
        return "write `mesh over N ranks { ... }`"
    if word == ";":
        return "statements end at the end of the line; there is no `;`"
    if word == '"' and "STRING" in expected:
        return 'a string must end with `"` on the same line'
    if "PATTERN" in expected and word.startswith('"'):
        return "patterns are written without quotes: `param layers.*.wq.weight [...]`"
    # (a pattern token with a `{` that no `}` follows; not one regex, which backtracks
    # quadratically over a token of many `{`)
    head = re.match(r"(param|ignore)\s+(\S+)\s", stripped)
    if head and "{" in head.group(2).rpartition("}")[2]:
        return "a pattern has no spaces: write alternatives as `{a,b}`"
    if expected == {"COMMA", "RSQB"}:
        return "close the dimension list with `]`"
    if {"LSQB", "LBRACE"} <= expected and re.match(r"^param\b", stripped):
        return "a rule names the parameter's dimensions: `param PATTERN [dim, ...] { ... }`"
    if {"LBRACE", "REPLICATE"} <= expected:
        return "a rule needs a body: `{ ... }`, or `replicate`"
    if "PARAM" in expected and word == "}":
        return "this `}` closes nothing"
    if "PARAM" in expected and word:
        if word in _BODY_ITEMS:
            return f"`{word}` goes inside a rule: `param PATTERN [dims] {{ {word} ... }}`"
        guess = _closest(word, _STATEMENTS)
        if guess:
            return f"did you mean `{guess}`?"
        return "a statement starts with manifest, mesh, fsdp, ignore, param, pipeline or hf"
    if "SHARD" in expected and word and word != "}":
        if re.search(r"\bshard\s+\w+\s+over\s+\w+\s*$", before):
            return "several axes on one dimension go in parentheses, outer first: `over (tp, dp)`"
        guess = _closest(word, _BODY_ITEMS)
        if guess:
            return f"did you mean `{guess}`?"
        return (
            "a rule's body holds shard, fuse, heads, local, replicate, checkpoint and style lines"
        )
    return ""


_HEADS_FORM = (
    "`heads DIM SIZE`, SIZE one head's size: a whole number, a factory argument or a "
    "config.json key (`heads kv 128`, `heads kv head_dim`)"
)


def _heads_hint(upto: str, word: str, expected: set[str]) -> str:
    """The usual mistakes in a ``heads`` line (``upto``: the text before the error), or
    ``""``."""
    m = re.search(r"(?:^|\{)[ \t]*heads\b([^\n{}]*)\n?[ \t]*$", upto, re.M)
    if m is None:
        return ""
    typed = m.group(1).split()
    if word == "of" or typed[-1:] == ["of"]:
        return "write `heads kv 128`, without `of`"
    if word.isdigit() and "INT" not in expected and (not typed or typed[-1].endswith(",")):
        return f"the dimension comes first: {_HEADS_FORM}"
    if "INT" in expected or "NAME" in expected:
        return f"write {_HEADS_FORM}"
    if "COMMA" in expected and word:
        return "separate the dimensions with commas, one size each: `heads q 128, k 128`"
    return ""


def _unclosed_brace(text: str) -> int | None:
    """The line of the last ``{`` that no ``}`` closes (outside strings and comments;
    the braces of a pattern's ``{a,b}`` pair up among themselves)."""
    stack: list[int] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
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


def parse(text: str, path: str = "<string>") -> tuple[ir.Spec | None, list[Diagnostic]]:
    """Parse ``text``. Returns the IR (``None`` on a syntax error) and the diagnostics."""
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as err:
        return None, [_syntax_diag(path, text, err)]
    items = _ToIR(path).transform(tree)
    assert isinstance(items, Tree)
    diags: list[Diagnostic] = []
    fields: dict = {"rules": [], "ignores": []}
    seen: dict[str, Span] = {}
    for kind, node, span in items.children:
        if kind in ("manifest", "mesh", "fsdp", "hf", "pipeline"):
            if kind in seen:
                diags.append(
                    diag(
                        "SS005",
                        f"`{kind}` appears more than once",
                        span,
                        f"the first one is at line {seen[kind].line}; keep one",
                    )
                )
                continue
            seen[kind] = span
        if kind == "manifest":
            fields["manifest"], fields["manifest_span"] = node
        elif kind == "mesh":
            fields["mesh"] = node
        elif kind == "fsdp":
            fields["fsdp"] = node
        elif kind == "ignore":
            fields["ignores"].append(node)
        elif kind == "hf":
            fields["hf"] = node
        elif kind == "pipeline":
            fields["pipeline"] = node
        else:
            fields["rules"].append(node)
    fields["suppressions"] = _suppressions(path, text)
    spec = ir.Spec(path=path, source=text, sha256=sha, **fields)
    return spec, diags


def _suppressions(path: str, text: str) -> list[ir.Suppression]:
    """``# shardspec: ignore[CODE, ...]`` comments; the same words inside a string (such as
    a manifest path) are not a comment and suppress nothing."""
    out = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        start = _comment_start(line)
        if start is None:
            continue
        m = _SUPPRESS.search(line, start)
        if not m:
            continue
        codes = [c.strip().upper() for c in m.group(1).split(",") if c.strip()]
        out.append(
            ir.Suppression(span=Span(path, lineno, m.start() + 1, lineno, m.end() + 1), codes=codes)
        )
    return out


def parse_file(
    path: str | Path, name: str | None = None
) -> tuple[ir.Spec | None, list[Diagnostic]]:
    """Read and parse a spec file; an unreadable file is an ``SS002`` diagnostic. ``name``
    is the path that spans (and so diagnostics) carry, ``path`` itself by default."""
    p = Path(path)
    name = name if name is not None else str(path)
    try:
        text = read_text(p)  # a byte order mark is not part of the text
    except UnicodeDecodeError as e:
        return None, [
            diag(
                "SS002",
                f"cannot read spec: byte {e.start} is not UTF-8",
                Span(name, 1, 1),
                "save the spec as UTF-8 text",
            )
        ]
    except OSError as e:
        reason = e.strerror or str(e)
        return None, [
            diag("SS002", f"cannot read spec: {reason}", Span(name, 1, 1), "check the path")
        ]
    return parse(text, name)
