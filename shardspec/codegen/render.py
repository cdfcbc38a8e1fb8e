"""Render a generated module from resolved facts.

The output is deterministic (sorted, no timestamps) and already in ``ruff format`` style
(a test keeps it so), so it reads like a hand-written table. Literals are laid out by
:func:`layout`, which splits them where ruff would: a collection that does not fit goes
one element per line with a trailing comma; a call first tries all of its arguments on
one indented line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

from shardspec import RUNTIME_API, __version__
from shardspec.core.hfmap import MapRule, Transform
from shardspec.core.layout import RuleSpec, dtensor_placements
from shardspec.core.paramtable import fold, relative_name
from shardspec.frontend import ir
from shardspec.inputs.hfmanifest import HFManifest
from shardspec.resolve.hf import build_hfmap, with_dtypes
from shardspec.resolve.params import Match, Resolved, axis_aliases, rule_spec

LINE = 100
INDENT = 4


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["py"] = py
    return env


@dataclass(frozen=True)
class Call:
    """A call expression in generated code, such as ``Param(3, (64, 64), "float32")``."""

    func: str
    args: tuple[object, ...]


@dataclass(frozen=True)
class Kw:
    """A keyword argument of a :class:`Call`: ``name=value``."""

    name: str
    value: object


def py_str(value: str) -> str:
    """A string literal the way ruff writes it: double quotes unless the text holds more
    double than single quotes; backslashes and unprintable characters escaped."""
    if '"' not in value and "\\" not in value and value.isprintable():
        return f'"{value}"'  # the common case, without a per-character loop
    quote = "'" if value.count('"') > value.count("'") else '"'
    out = []
    for ch in value:
        if ch == "\\":
            out.append("\\\\")
        elif ch == quote:
            out.append("\\" + quote)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])
    return quote + "".join(out) + quote


def py(value: object) -> str:
    """A Python literal on one line in ruff's style: double quotes, one-element tuples with
    a trailing comma."""
    if isinstance(value, str):
        return py_str(value)
    if isinstance(value, bool) or value is None or isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Call):
        return f"{value.func}(" + ", ".join(py(a) for a in value.args) + ")"
    if isinstance(value, Kw):
        return f"{value.name}={py(value.value)}"
    if isinstance(value, tuple):
        if len(value) == 1:
            return f"({py(value[0])},)"
        return "(" + ", ".join(py(v) for v in value) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(py(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py(k)}: {py(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))  # pragma: no cover


def _brackets(value: object) -> tuple[str, str, list[tuple[str, object]]] | None:
    """Opening text, closing text and (prefix, element) pairs of a splittable value."""
    if isinstance(value, Call) and value.args:
        return (
            f"{value.func}(",
            ")",
            [(f"{a.name}=", a.value) if isinstance(a, Kw) else ("", a) for a in value.args],
        )
    if isinstance(value, tuple) and value:
        return "(", ")", [("", v) for v in value]
    if isinstance(value, list) and value:
        return "[", "]", [("", v) for v in value]
    if isinstance(value, dict) and value:
        return "{", "}", [(f"{py(k)}: ", v) for k, v in value.items()]
    return None


def layout(value: object, indent: int = 0, head: str = "", tail: str = "") -> list[str]:
    """The lines of ``head + value + tail`` at ``indent``, split the way ruff formats it."""
    pad = " " * indent
    one = pad + head + py(value) + tail
    parts = _brackets(value)
    if len(one) <= LINE or parts is None:
        return [one]
    open_, close, items = parts
    inner = indent + INDENT
    if isinstance(value, Call):
        hug = " " * inner + ", ".join(prefix + py(v) for prefix, v in items)
        if len(hug) <= LINE:
            return [pad + head + open_, hug, pad + close + tail]
    lines = [pad + head + open_]
    for prefix, item in items:
        lines.extend(layout(item, inner, prefix, ","))
    lines.append(pad + close + tail)
    return lines


def assign(target: str, value: object) -> str:
    """``target = value`` at the top level. A string that does not fit is wrapped in
    parentheses when that makes it fit, as ruff does."""
    one = f"{target} = {py(value)}"
    if isinstance(value, str) and len(one) > LINE and INDENT + len(py(value)) <= LINE:
        return f"{target} = (\n{' ' * INDENT}{py(value)}\n)"
    return "\n".join(layout(value, 0, f"{target} = "))


def comment(words: list[str], indent: int = 0, cont: str = "    ") -> str:
    """``# words`` at ``indent``, filled greedily into lines of at most :data:`LINE`
    characters; continuation lines are indented by ``cont`` after the ``#``. A word is
    never split, so a single long word may still overflow."""
    pad = " " * indent + "# "
    lines: list[str] = []
    cur = ""
    for w in words:
        first = not lines and not cur
        lead = pad if not lines else pad + cont
        if cur and len(lead + cur + " " + w) > LINE:
            lines.append(lead + cur)
            cur = w
        else:
            cur = w if first or not cur else f"{cur} {w}"
    lines.append((pad if not lines else pad + cont) + cur)
    return "\n".join(line.rstrip() for line in lines)


def _rule_fields(rs: RuleSpec) -> list[str]:
    """The keyword arguments of one ``RuleSpec(...)``, each laid out at indent 8."""
    fields: list[tuple[str, object]] = [("pattern", rs.pattern), ("dims", rs.dims)]
    if rs.shard:
        fields.append(("shard", rs.shard))
    if rs.fuse:
        fields.append(("fuse", rs.fuse))
    if rs.local:
        fields.append(("local", rs.local))
    if rs.name_indexed:
        fields.append(("name_indexed", rs.name_indexed))
    if rs.stored_fused:
        fields.append(("stored_fused", True))
    if rs.any_rank:
        fields.append(("any_rank", True))
    if rs.ckpt_shard:
        fields.append(("ckpt_shard", rs.ckpt_shard))
    if rs.replicated_heads:
        fields.append(("replicated_heads", rs.replicated_heads))
    if rs.squeezed:
        fields.append(("squeezed", rs.squeezed))
    return ["\n".join(layout(value, 8, f"{name}=", ",")).lstrip() for name, value in fields]


def _row_line(key: str, value: Call) -> str:
    """One row of a folded table (``PARAMS``, ``BUFFERS``, ``HOOK_KEYS``), laid out at
    indent 8 (the template adds the first indent) as ruff formats it. A key too long for
    ``"key": Value(`` goes in parentheses, in pieces split after dots where even that does
    not fit."""
    pad = " " * 8
    if len(f"{pad}{py_str(key)}: {value.func}(") <= LINE:
        return "\n".join(layout(value, 8, f"{py_str(key)}: ", ",")).lstrip()
    width = LINE - 12 - 2  # a piece's text at indent 12, between its quotes
    pieces: list[str] = []
    for segment in key.split("."):
        if pieces and len(pieces[-1]) + 1 + len(segment) <= width:
            pieces[-1] += "." + segment
        else:
            if pieces:
                pieces[-1] += "."
            pieces.append(segment)
    lines = ["(", *(f"    {py_str(p)}" for p in pieces)]
    lines += [line[8:] for line in layout(value, 8, "): ", ",")]
    return f"\n{pad}".join(lines)


def _table_context(
    items: Iterable[tuple[str, tuple[object, ...]]], func: str, noun: str
) -> dict[str, object]:
    """A folded table: names and the arguments of their ``func(...)`` values, folded into
    rows of names that differ only in numbers (:func:`shardspec.core.paramtable.fold`),
    one line each, with a comment that counts them (``noun``: what a name is)."""
    n = 0

    def counted() -> Iterable[tuple[str, tuple[object, ...]]]:
        nonlocal n
        for item in items:
            n += 1
            yield item

    rows = fold(counted())
    plural = "s" if len(rows) != 1 else ""
    words = f"{n} {noun}{'s' if n != 1 else ''} in {len(rows)} row{plural}."
    return {
        "rows": [_row_line(key, Call(func, value)) for key, value in rows.items()],
        "count": comment(words.split()),
    }


def _params_context(all_params: list[tuple[str, Match]]) -> dict[str, object]:
    """The ``PARAMS`` table: the manifest's parameters, ``Param(rule, shape, dtype)``."""
    return _table_context(
        ((fqn, (m.winner, tuple(m.entry.shape), m.entry.dtype)) for fqn, m in all_params),
        "Param",
        "parameter",
    )


def _buffers_context(res: Resolved) -> dict[str, object]:
    """The ``BUFFERS`` table: the manifest's persistent buffers, ``Buffer(rule or None,
    shape, dtype)``."""
    items = []
    if res.manifest is not None:
        for e in res.manifest.entries:
            if e.kind == "buffer":
                m = res.matches.get(e.fqn)
                items.append((e.fqn, (m.winner if m else None, tuple(e.shape), e.dtype)))
    doc = (
        "The manifest's persistent buffers: Buffer(rule, module tensor shape, dtype), one row "
        "per kind as in PARAMS. Checkpoints (and an hf block) store them as they store "
        "parameters; rule None (no rule matches): the whole tensor on every rank"
    )
    if res.spec.pipeline is not None:
        doc += (
            " of its pipeline stage (its module's stage, or every stage where no first, last "
            "or split pattern covers it)"
        )
    return _table_context(items, "Buffer", "buffer") | {"doc": comment(f"{doc}.".split(), cont="")}


def _hooks_context(res: Resolved) -> dict[str, object]:
    """The ``HOOK_KEYS`` table: the keys the model's state-dict hooks write (the manifest's
    ``state_dict`` section), ``Hook(module, parameters)`` with names relative to the key
    (:func:`shardspec.core.paramtable.relative_name`)."""
    section = res.manifest.state_dict if res.manifest is not None else None
    items = []
    for k in section.added() if section is not None else ():
        module = relative_name(k.module, k.fqn)
        sources = tuple(relative_name(f, k.fqn) for f in k.from_)
        items.append((k.fqn, (module, sources) if sources else (module,)))
    return _table_context(items, "Hook", "key")


def _layer_runs(values: tuple[str, ...]) -> str:
    """``0-1`` for consecutive layer numbers, else a comma list."""
    if not values:
        return "none"
    nums = [int(v) for v in values]
    if nums == list(range(nums[0], nums[0] + len(nums))) and len(nums) > 1:
        return f"{nums[0]}-{nums[-1]}"
    return ", ".join(values)


def _pipeline_context(res: Resolved) -> dict[str, object] | None:
    """The generated module's ``PIPELINE`` table, with a comment showing the stages at the
    default size, or ``None`` when the spec has no pipeline block."""
    p = res.pipeline
    if p is None:
        return None
    fields: list[tuple[str, object]] = [("axis", p.axis)]
    if p.first:
        fields.append(("first", p.first))
    if p.last:
        fields.append(("last", p.last))
    if p.split is not None:
        fields.append(("split", p.split))
    if p.counts:
        fields.append(("counts", p.counts))
    if p.local_names:
        fields.append(("local_names", True))
    if p.ties:
        fields.append(("ties", p.ties))
    lines = ["\n".join(layout(v, 4, f"{k}=", ",")).lstrip() for k, v in fields]
    doc = (
        f"# Pipeline stages on {p.axis}: a rank's coordinate on {p.axis} is its stage.\n"
        "# Patterns are module prefixes of the whole model's names."
    )
    sp = res.stages
    if sp is not None:
        doc += f"\n# At {p.axis}={sp.n_stages}:"
        for s in range(sp.n_stages):
            held = [f for f in p.first if s == 0] if p.first else []
            if sp.stage_layers and sp.stage_layers[s]:
                held.append(f"{p.split} for {_layer_runs(sp.stage_layers[s])}")
            held += [f for f in p.last if s == sp.n_stages - 1]
            doc += "\n" + comment([f"  stage {s}:", *", ".join(held).split(" ")])
        for alias, source in p.ties:
            a, b = sp.stage.get(source), sp.tie_stage.get(alias)
            where = (
                f"stage {b} holds a copy as {alias}"
                if a != b
                else "one stage holds both: the model ties them"
            )
            doc += "\n" + comment([f"  {source}", "(tied):", *where.split(" ")])
    table = "PIPELINE: PipelineSpec | None = PipelineSpec(\n"
    table += "".join(f"    {line}\n" for line in lines) + ")"
    return {"comment": doc, "table": table, "ties": bool(p.ties)}


def _hf_context(
    spec: ir.Spec, spec_path: str, hf_manifest: HFManifest | None
) -> dict[str, str] | None:
    """The generated module's ``HF`` table and the names it imports, or ``None`` when the
    spec has no ``hf`` block (the module is then exactly what it was before hf blocks).
    Each rule records the dtypes the HF manifest gives its keys, which load_hf checks."""
    if spec.hf is None:
        return None
    hfmap = with_dtypes(build_hfmap(spec.hf, hf_manifest), hf_manifest)

    def transform(t: Transform) -> Call:
        if t.kind == "pad":
            axes = (Kw("axes", t.axes),) if t.axes else ()
            pad = (Kw("dim", t.dim), Kw("multiple", t.multiple), *axes, Kw("size", t.size))
            return Call("Transform", ("pad", *pad))
        return Call("Transform", (t.kind, t.head_dim) if t.kind == "rope" else (t.kind,))

    def transforms(items: tuple[Transform, ...]) -> tuple[Call, ...]:
        return tuple(transform(t) for t in items)

    def parts(r: MapRule) -> tuple:
        if r.parts is None:
            return ()
        return (
            tuple(
                Call("Part", (p.name, transforms(p.transforms)) if p.transforms else (p.name,))
                for p in r.parts
            ),
        )

    def options(r: MapRule) -> tuple[Kw, ...]:
        grouped = (Kw("grouped", True),) if r.grouped else ()
        return (*grouped, *((Kw("dtypes", r.dtypes),) if r.dtypes else ()))

    rules = tuple(
        Call(
            "MapRule",
            (r.hf, r.target, r.stack, transforms(r.transforms), r.line, *parts(r), *options(r)),
        )
        for r in hfmap.rules
    )
    fields: list[tuple[str, object]] = [
        ("rules", rules),
        ("drops", hfmap.drops),
        ("ties", hfmap.ties),
        ("keeps", hfmap.keeps),
    ]
    quants = tuple(
        Call("BlockQuant", (q.glob, q.scale, q.block, q.scale_format, q.dtype, q.line))
        for q in hfmap.quants
    )
    if quants:  # (a module without fp8 lines is what it was before them)
        fields.append(("quants", quants))
    lines = ["HF = HFMap("]
    for name, value in fields:
        lines.extend(layout(value, INDENT, f"{name}=", ","))
    lines.append(")")
    imports = ["BlockQuant", "HFMap"] if quants else ["HFMap"]
    if hfmap.rules:
        imports.append("MapRule")
    if any(r.parts for r in hfmap.rules):
        imports.append("Part")
    every = [
        t
        for r in hfmap.rules
        for t in (*r.transforms, *(t for p in r.parts or () for t in p.transforms))
    ]
    if every:
        imports.append("Transform")
    first, last = spec.hf.span.line, spec.hf.span.end_line or spec.hf.span.line
    words = "How a Hugging Face checkpoint maps onto the storage units".split()
    words += [f"({spec_path},", "lines", f"{first}-{last})."]
    legend = "MapRule(HF name, storage unit, stack index, transforms from HF to model, spec line"
    if any(r.parts is not None for r in hfmap.rules):
        legend += ", parts of a split HF tensor in its order"
    if any(r.grouped for r in hfmap.rules):
        legend += "; grouped: the parts stored group by group"
    if any(r.dtypes for r in hfmap.rules):
        legend += "; dtypes: its HF tensors' dtypes in the HF manifest, which load_hf checks"
    legend += ")."
    if quants:
        legend += (
            " BlockQuant(HF key glob, scale key template, block, scale format, FP8 dtype, spec "
            "line): HF tensors stored block-scaled in FP8, dequantized on load and quantized on "
            "export in the HF layout."
        )
    text = comment(words) + "\n" + comment(legend.split())
    return {"table": "\n".join(lines), "imports": ", ".join(imports), "comment": text}


def effective_overrides(
    res: Resolved, overrides: dict[str, int] | None, world: int | None
) -> list[tuple[str, int]]:
    """The ``-D`` overrides that change the spec's declared mesh, in axis order, world
    last. An override equal to the declared value changes nothing and is left out."""
    spec = res.spec
    assert spec.mesh is not None
    declared = _declared_sizes(spec)
    out = [
        (name, size)
        for name, size in ((n, (overrides or {}).get(n)) for n in declared)
        if size is not None and declared[name] != size
    ]
    if world is not None and world != spec.mesh.world:
        out.append(("world", world))
    return out


def _declared_sizes(spec) -> dict[str, int | None]:
    """Every axis's declared size (None: the rest), in declaration order: the mesh's, or
    every view's (a shared axis once)."""
    out: dict[str, int | None] = {}
    for mesh in [m for m in spec.views if m.name is not None] or [spec.mesh]:
        for a in mesh.axes:
            out.setdefault(a.name.text, a.size)
    return out


def _views_context(res: Resolved) -> dict[str, str] | None:
    """VIEWS, VIEW_FSDP and RULE_VIEWS of a spec with views (None: one mesh)."""
    views = res.views
    if not res.spec.views or views is None:
        return None
    return {
        "axes": assign("VIEWS: dict[str, tuple[str, ...]]", dict(views.axes)),
        "fsdp": assign("VIEW_FSDP: dict[str, str | None]", dict(views.fsdp)),
        "rules": assign(
            "RULE_VIEWS: tuple[str, ...]",
            tuple(res.rule_views[r.index] for r in res.spec.rules),
        ),
    }


def compile_command(spec_path: str, defines: list[tuple[str, int]]) -> str:
    """The ``shardspec compile`` command line that reproduces a module (the path quoted
    for a shell where it needs to be)."""
    import shlex

    flags = "".join(f"-D {n}={v} " for n, v in defines)
    return f"shardspec compile {flags}{shlex.quote(spec_path)}"


def printable(text: str) -> str:
    """``text`` with every non-printable character (newline, tab, other controls) written
    as its Python escape, for comments and docstrings."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _styles(spec, res) -> dict[int, dict[str, str | bool]]:
    """Each rule's tensor-parallel style (rule index -> kind and layouts): as stated, or
    derived from the manifest's module kinds and the placements (marked "derived")."""
    from shardspec.checks.layouts import rule_styles
    from shardspec.core.styles import CONV1D

    derived = rule_styles(res) if res.manifest is not None and res.mesh is not None else {}
    out: dict[int, dict[str, str | bool]] = {}
    for rule in spec.rules:
        st = rule.style
        # transformers' Conv1D (weight [in, out]) has styles of its own: tp_plan without
        # a model knows the module from here
        conv1d: dict[str, str | bool] = (
            {"module": CONV1D} if derived.get(rule.index, ("", "", None))[2] == CONV1D else {}
        )
        if st is None:
            kind = derived.get(rule.index, ("", ""))[1]
            if kind in ("colwise", "rowwise"):
                out[rule.index] = {"kind": kind, "derived": True, **conv1d}
            continue
        entry: dict[str, str | bool] = {"kind": st.kind.text, **conv1d}
        if st.input is not None:
            entry["input"] = st.input.text
        if st.output is not None:
            entry["output"] = st.output.text
        if st.dtensor:
            entry["local"] = False
        out[rule.index] = entry
    return out


def render_module(
    res: Resolved,
    spec_path: str,
    import_name: str,
    *,
    overrides: dict[str, int] | None = None,
    world: int | None = None,
) -> str:
    """The text of ``generated/<name>.py`` for a spec that passed its checks.

    ``overrides`` and ``world`` are the ``-D`` values the spec was checked with (the same
    that :func:`shardspec.resolve.params.resolve` got): they become the module's default sizes,
    and the header records them.
    """
    raw_path = spec_path
    # Comments and the docstring show the path with its control characters escaped: a
    # newline in a file name must not put text on a code line.
    spec_path = printable(spec_path)
    spec = res.spec
    assert spec.mesh is not None
    all_params = res.params
    first_layout: dict[int, object] = {}
    for _fqn, m in res.stored:  # a rule may place buffers only
        if m.layout is not None and m.winner is not None:
            first_layout.setdefault(m.winner, m.layout)
    for m in res.tie_matches.values():  # a rule for a pipeline tie's alias only
        if m.layout is not None and m.winner is not None and m.ignored_by is None:
            first_layout.setdefault(m.winner, m.layout)
    rules = []
    for rule in spec.rules:
        rs = res.rule_specs.get(rule.index) or rule_spec(rule, res.fsdp_of_rule(rule.index))
        placements: list[str] = []
        mesh = res.mesh_of_rule(rule.index)
        if mesh is not None:
            pp = res.pipeline.axis if res.pipeline is not None and res.stages is not None else None
            names = [n for n in mesh.names if n not in rs.local and n != pp]
            layout_ = first_layout.get(rule.index)
            if layout_ is not None:
                ps = dtensor_placements(layout_, mesh)  # type: ignore[arg-type]
                items = [f"{n}={p}" for n, p in zip(names, ps, strict=True)]
                last = f"{items[-1]})" if items else ")"
                placements = ["->", *(f"{x}," for x in items[:-1]), last]
                placements[1] = "(" + placements[1]
        words = [f"{rule.index}:", f"{spec_path}:{rule.span.line}", *placements]
        rules.append({"comment": comment(words, 4), "fields": _rule_fields(rs)})
    params = None
    if res.manifest is not None:
        params = _params_context(all_params)
    defines = effective_overrides(res, overrides, world)
    given = dict(defines)
    mesh_sizes = {a: given.get(a, size) for a, size in _declared_sizes(spec).items()}
    default_world = given.get("world", spec.mesh.world)
    if res.mesh is not None:
        default_world = res.mesh.world
    size_doc = ", ".join(f"{n}={'rest' if s is None else s}" for n, s in mesh_sizes.items())
    size_line = f"    mesh = layout.build_mesh()  # sizes: {size_doc}"
    if len(size_line) > LINE:
        size_words = ["sizes:", *(f"{w}," for w in size_doc.split(", "))]
        size_words[-1] = size_words[-1].rstrip(",")
        size_line = comment(size_words, 4) + "\n    mesh = layout.build_mesh()"
    command = compile_command(spec_path, defines)
    do_not_edit = f"# DO NOT EDIT: change the spec and run `{command}`."
    if len(do_not_edit) > LINE:
        do_not_edit = f"# DO NOT EDIT: change the spec and run\n#     {command}"
    ctx = {
        "version": __version__,
        "api": RUNTIME_API,
        "spec_path": spec_path,
        "spec_path_value": raw_path,
        "spec_path_doc": spec_path.replace("\\", "\\\\").replace('"""', '\\"\\"\\"'),
        "sha256": spec.sha256,
        "defines": comment(
            [
                "Compiled",
                "with",
                *(f"-D {n}={v}" for n, v in defines[:-1]),
                f"-D {defines[-1][0]}={defines[-1][1]}:",
                *"the mesh defaults below are not the spec's own.".split(),
            ]
        )
        if defines
        else "",
        "do_not_edit": do_not_edit,
        "import_name": import_name,
        "size_doc": size_line,
        "name": spec.name,
        "factory": assign("FACTORY: str | None", res.manifest.factory if res.manifest else None),
        "factory_args": assign(
            "FACTORY_ARGS: dict[str, int | float | str | bool]",
            dict(sorted((res.manifest.factory_args if res.manifest else {}).items())),
        ),
        "axes": assign("AXES: tuple[str, ...]", tuple(mesh_sizes)),
        "default_sizes": assign("DEFAULT_SIZES: dict[str, int | None]", mesh_sizes),
        "world": assign("DEFAULT_WORLD: int | None", default_world),
        "fsdp": assign("FSDP_AXIS: str | None", res.fsdp_of_rule(None)),
        "aliases": _aliases_context(spec),
        **_keys_context(spec),
        "views": _views_context(res),
        "mesh_type": "MeshViews" if _views_context(res) else "DeviceMesh",
        "rules": rules,
        "ignore": assign("IGNORE: tuple[str, ...]", tuple(ig.pattern.text for ig in spec.ignores)),
        "name_indexed_counts": assign(
            "NAME_INDEXED_COUNTS: dict[int, dict[str, int]]",
            {k: dict(sorted(v.items())) for k, v in sorted(res.name_indexed_counts.items())},
        ),
        "params": params,
        "buffers": _buffers_context(res),
        "hook_keys": _hooks_context(res),
        "styles": assign("STYLES: dict[int, dict[str, str | bool]]", _styles(spec, res)),
        "hf": _hf_context(spec, spec_path, res.hf_manifest),
        "pipeline": _pipeline_context(res),
    }
    ctx["runtime_imports"] = _runtime_imports(ctx)
    return _env().get_template("module.py.j2").render(**ctx)


def _aliases_context(spec: ir.Spec) -> str:
    """``AXIS_ALIASES`` (alias -> axis), or nothing for a spec without ``aka``."""
    aliases = axis_aliases(spec)
    return assign("AXIS_ALIASES: dict[str, str]", aliases) if aliases else ""


def _keys_context(spec: ir.Spec) -> dict[str, str]:
    """``CHECKPOINT_KEYS`` (`checkpoint keys NAME`; nothing without one), and what save and
    load use without ``keys=``, in words for their docstrings."""
    stmt = spec.checkpoint_keys
    if stmt is None:
        return {"checkpoint_keys": "", "keys_doc": 'shardspec\'s own (``"shardspec"``)'}
    name = stmt.layout.text
    return {
        "checkpoint_keys": assign("CHECKPOINT_KEYS: str | None", name),
        "keys_doc": f"``{name!r}``, the spec's `checkpoint keys`",
    }


def _runtime_imports(ctx: dict) -> str:
    """The names a generated module takes from ``shardspec.runtime`` (its only import besides
    torch), in isort's order: classes, then functions; in parentheses, one per line, where
    they do not fit on the import's line (as ruff writes it)."""
    names = ["Buffer", "CompiledSpec", "Hook", "Param", "ParamTable", "RuleSpec", "RuntimeModule"]
    if ctx["hf"] is not None:
        names += ctx["hf"]["imports"].split(", ")
    if ctx["pipeline"] is not None:
        names.append("PipelineSpec")
    if ctx["views"] is not None:
        names.append("MeshViews")
    names = [*sorted(names), "require"]
    one = ", ".join(names)
    if len(f"from shardspec.runtime import {one}") <= LINE:
        return one
    return "(\n" + "".join(f"{' ' * INDENT}{n},\n" for n in names) + ")"
