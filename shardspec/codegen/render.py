"""Render a generated module from resolved facts.

The output is deterministic (sorted, no timestamps) and already in ``ruff format`` style
(a test keeps it so), so it reads like a hand-written table.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2

from shardspec import RUNTIME_API, __version__
from shardspec.layout import RuleSpec, dtensor_placements
from shardspec.resolve import Resolved, rule_spec

LINE = 100


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def py(value: object) -> str:
    """A Python literal in ruff's style: double quotes, tuples with trailing commas."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool) or value is None or isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple):
        if len(value) == 1:
            return f"({py(value[0])},)"
        return "(" + ", ".join(py(v) for v in value) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(py(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py(k)}: {py(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))  # pragma: no cover


def _placement_text(p: tuple) -> str:
    if p[0] == "R":
        return "R"
    if p[0] == "S":
        return f"S({p[1]})"
    return f"_S({p[1]}, {p[2]})"


def _rule_fields(rs: RuleSpec) -> list[str]:
    fields = [f"pattern={py(rs.pattern)},", f"dims={py(rs.dims)},"]
    if rs.shard:
        fields.append(f"shard={py(rs.shard)},")
    if rs.fuse:
        fields.append(f"fuse={py(rs.fuse)},")
    if rs.local:
        fields.append(f"local={py(rs.local)},")
    if rs.virtual:
        fields.append(f"virtual={py(rs.virtual)},")
    if rs.stored_fused:
        fields.append("stored_fused=True,")
    if rs.any_rank:
        fields.append("any_rank=True,")
    return [_wrap_field(f, 8) for f in fields]


def _wrap_field(field: str, indent: int) -> str:
    """Keep a ``name=value,`` line within the line length, breaking tuples as ruff does."""
    if indent + len(field) <= LINE:
        return field
    name, _, value = field.partition("=")
    value = value.rstrip(",")
    if value.startswith("(") and value.endswith(")"):
        inner = _split_top(value[1:-1])
        pad = " " * (indent + 4)
        body = "".join(f"\n{pad}{_wrap_item(x, indent + 4)}," for x in inner)
        return f"{name}=({body}\n{' ' * indent}),"
    return field


def _wrap_item(item: str, indent: int) -> str:
    if indent + len(item) + 1 <= LINE or not (item.startswith("(") and item.endswith(")")):
        return item
    inner = _split_top(item[1:-1])
    pad = " " * (indent + 4)
    body = "".join(f"\n{pad}{_wrap_item(x, indent + 4)}," for x in inner)
    return f"({body}\n{' ' * indent})"


def _split_top(text: str) -> list[str]:
    """Split a literal's contents at top-level commas."""
    out, depth, cur, in_str = [], 0, [], False
    for ch in text:
        if ch == '"':
            in_str = not in_str
        if not in_str:
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch == "," and depth == 0:
                out.append("".join(cur).strip())
                cur = []
                continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _param_line(fqn: str, rule: int, shape: tuple[int, ...], dtype: str) -> str:
    key = py(fqn)
    args = f"{rule}, {py(tuple(shape))}, {py(dtype)}"
    one = f"{key}: Param({args}),"
    if 4 + len(one) <= LINE:
        return one
    return f"{key}: Param(\n        {args}\n    ),"


def render_module(res: Resolved, spec_path: str, import_name: str) -> str:
    """The text of ``generated/<name>.py`` for a spec that passed its checks."""
    spec = res.spec
    assert spec.mesh is not None
    fsdp = spec.fsdp.text if spec.fsdp else None
    all_params = res.params
    first_layout: dict[int, object] = {}
    for _fqn, m in all_params:
        if m.layout is not None:
            first_layout.setdefault(m.winner, m.layout)  # type: ignore[arg-type]
    rules = []
    for rule in spec.rules:
        rs = res.rule_specs.get(rule.index) or rule_spec(rule, fsdp)
        placements = ""
        if res.mesh is not None:
            names = [n for n in res.mesh.names if n not in rs.local]
            layout = first_layout.get(rule.index)
            if layout is not None:
                ps = dtensor_placements(layout, res.mesh)  # type: ignore[arg-type]
                placements = (
                    "("
                    + ", ".join(f"{n}={_placement_text(p)}" for n, p in zip(names, ps, strict=True))
                    + ")"
                )
        rules.append(
            {
                "index": rule.index,
                "where": f"{spec_path}:{rule.span.line}",
                "placements": placements,
                "fields": _rule_fields(rs),
            }
        )
    params = None
    if res.manifest is not None:
        params = [
            _param_line(fqn, m.winner, m.entry.shape, m.entry.dtype)  # type: ignore[arg-type]
            for fqn, m in all_params
        ]
    mesh_sizes = {a.name.text: a.size for a in spec.mesh.axes}
    size_doc = ", ".join(f"{n}={'rest' if s is None else s}" for n, s in mesh_sizes.items())
    ctx = {
        "version": __version__,
        "api": RUNTIME_API,
        "spec_path": spec_path,
        "sha256": spec.sha256,
        "import_name": import_name,
        "size_doc": size_doc,
        "name": spec.name,
        "factory": py(res.manifest.factory if res.manifest else None),
        "factory_args": py(
            dict(sorted((res.manifest.factory_args if res.manifest else {}).items()))
        ),
        "axes": py(tuple(mesh_sizes)),
        "default_sizes": py(mesh_sizes),
        "world": py(res.mesh.world if res.mesh is not None else spec.mesh.world),
        "fsdp": py(fsdp),
        "rules": rules,
        "ignore": py(tuple(ig.pattern.text for ig in spec.ignores)),
        "virtual_counts": py(
            {k: dict(sorted(v.items())) for k, v in sorted(res.virtual_counts.items())}
        ),
        "params": params,
    }
    return _env().get_template("module.py.j2").render(**ctx)
