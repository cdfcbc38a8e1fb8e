"""IR + resolved facts -> the text of a generated module (jinja2)."""

from shardspec.codegen.render import render_module

__all__ = ["render_module"]
