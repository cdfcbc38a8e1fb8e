"""``shardspec``: argument parsing and I/O only; the work is in :mod:`shardspec.api`.

Exit status: 0 fine (warnings allowed); 1 findings with errors, or stale output under
``compile --check``; 2 input that cannot be processed (a syntax error, an unreadable or
malformed spec or manifest, bad arguments).
"""

from __future__ import annotations

import argparse
import gc
import glob
import itertools
import os
import sys
from collections.abc import Sequence

from shardspec import __version__

DEFAULT_GLOB = "specs/*.shard"


# Set by main() when the command line asks for JSON, so that even argument errors (found
# before or while parsing) come out as JSON diagnostics on stdout.
_JSON_OUTPUT = False


def _bad_argument(message: str, hint: str, code: str = "SS004") -> None:
    """Report a bad command line as a diagnostic (SS004, or ``code``): text on stderr, or
    JSON. What it quotes is capped like every finding's."""
    from shardspec.findings.codes import diag
    from shardspec.findings.diagnostics import Span, render_json, render_text

    d = diag(code, message, Span("<command line>", 1, 1), hint)
    if _JSON_OUTPUT:
        sys.stdout.write(render_json([d]))
        return
    sys.stderr.write(render_text(d) + "\n")


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as an SS004 diagnostic, with exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        _bad_argument(message, f"run `{self.prog} --help`")
        sys.exit(2)


def _define(value: str) -> tuple[str, int | str]:
    """``AXIS=N`` as (axis, N); a number over ``MAX_NUMBER`` stays text, for
    :func:`_check_defines` to report as SS006 (argparse would report it as SS004)."""
    from shardspec.frontend.limits import number_too_large

    name, eq, size = value.partition("=")
    digits = size.isascii() and size.isdigit()
    if digits and eq and name.isidentifier() and number_too_large(size):
        return name, size
    if not eq or not name.isidentifier() or not digits or int(size) < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not AXIS=N (a mesh axis and a positive whole number)"
        )
    return name, int(size)


def _add_defines(
    p: argparse.ArgumentParser,
    flag: str = "-D",
    dest: str = "defines",
    of: str = "for checks and defaults",
) -> None:
    p.add_argument(
        flag,
        dest=dest,
        action="append",
        type=_define,
        default=[],
        metavar="AXIS=N",
        help=f"override a mesh axis size (or `world=N`, the world size) {of}",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="shardspec",
        description="A declarative sharding-spec compiler for PyTorch distributed training.",
    )
    p.add_argument("--version", action="version", version=f"shardspec {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser(
        "compile",
        help="check specs and write generated/<name>.py for each",
        description="Check specs and write one Python module per spec.",
    )
    c.add_argument("specs", nargs="*", metavar="SPEC", help=f"spec files (default: {DEFAULT_GLOB})")
    c.add_argument(
        "-o",
        "--out",
        default="generated",
        metavar="DIR",
        help="output directory (default: generated)",
    )
    c.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 with a diff if an output is stale or missing",
    )
    _add_defines(c)

    lint = sub.add_parser(
        "lint",
        help="check specs and report findings",
        description="Check specs; exit 1 if any finding is an error.",
    )
    lint.add_argument(
        "specs", nargs="*", metavar="SPEC", help=f"spec files (default: {DEFAULT_GLOB})"
    )
    lint.add_argument(
        "--format",
        choices=("text", "json", "sarif"),
        default="text",
        help="output format (default: text; sarif: SARIF 2.1.0 for GitHub code scanning)",
    )
    _add_defines(lint)

    _add_fmt(sub)

    e = sub.add_parser(
        "explain",
        help="show which rule places a parameter, and every rank's shard",
        description="Show the rule that places FQN, why it wins, and "
        "every rank's local shape and global offset.",
    )
    e.add_argument("spec", metavar="SPEC")
    e.add_argument("fqn", metavar="FQN")
    e.add_argument(
        "--ranks",
        metavar="A-B",
        default=None,
        help="the ranks whose rows to show (default: the first 64 on the parameter's stage, "
        "then a summary of the rest)",
    )
    _add_defines(e)

    m = sub.add_parser(
        "manifest",
        help="write a model's parameter manifest (needs torch)",
        description="Build a model on the meta device and write every "
        "state-dict entry's name, shape and dtype as JSON.",
    )
    m.add_argument(
        "factory",
        metavar="MODULE:FUNCTION",
        help="a function that returns an nn.Module, e.g. examples.models.llama:tiny",
    )
    m.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write")
    m.add_argument(
        "--arg",
        dest="args",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a keyword argument for the factory (ints, floats, true/false, text)",
    )
    t = sub.add_parser(
        "transfer",
        help="check a trainer spec and an inference spec as a pair, and plan the weight transfer",
        description="Join TRAIN and INFER through their hf blocks: check that every element "
        "of every weight the engine holds has a source on the trainer, print the bytes each "
        "rank sends and receives, and write the plan (--plan). Exit 1 on errors.",
    )
    t.add_argument("train", metavar="TRAIN", help="the trainer's spec")
    t.add_argument("infer", metavar="INFER", help="the inference engine's spec")
    for side in ("train", "infer"):
        _add_defines(t, f"--{side}-D", f"{side}_defines", f"of the {side} spec")
    t.add_argument("--plan", metavar="FILE", help="write the plan as JSON to FILE")
    t.add_argument(
        "--format", choices=("text", "json"), default="text", help="output format (default: text)"
    )
    _add_diff(sub)
    h = sub.add_parser(
        "hf-manifest",
        help="describe a Hugging Face checkpoint (keys, shapes, config) as JSON, without weights",
        description="Read DIR's config.json and the safetensors headers of its weights "
        "(model.safetensors.index.json's files, or model.safetensors) and write the HF "
        'manifest that an `hf "FILE" { ... }` block names. No tensor data is read.',
    )
    h.add_argument("directory", metavar="DIR", help="a Hugging Face model directory")
    h.add_argument(
        "-o", "--output", metavar="FILE", help="where to write (default: standard output)"
    )
    return p


def _add_fmt(sub) -> None:
    f = sub.add_parser(
        "fmt",
        help="rewrite specs in the one canonical layout",
        description="Rewrite each spec in the canonical layout (docs/commands.md, `shardspec "
        "fmt`), comments kept; a file already in it is not touched, and a spec with a syntax "
        "error is reported and left as it is.",
    )
    f.add_argument("specs", nargs="*", metavar="SPEC", help=f"spec files (default: {DEFAULT_GLOB})")
    f.add_argument(
        "--check",
        action="store_true",
        help="write nothing; list the files that would change and exit 1 if any would",
    )
    f.add_argument(
        "--diff",
        action="store_true",
        help="write nothing; print a diff of what would change and exit 1 if anything would",
    )


def _split_defines(defines: list[tuple[str, int]]) -> tuple[dict[str, int], int | None]:
    sizes = dict(defines)
    world = sizes.pop("world", None)
    return sizes, world


def _repeated_define(defines: list[tuple[str, int]], flag: str = "-D") -> str | None:
    seen: dict[str, int] = {}
    for name, size in defines:
        if seen.get(name, size) != size:
            return f"{flag} {name} is given twice, as {seen[name]} and {size}"
        seen[name] = size
    return None


def _specs(given: list[str]) -> list[str]:
    """The spec paths to work on: those given (each once), or ``specs/*.shard``."""
    if not given:
        return sorted(glob.glob(DEFAULT_GLOB))
    seen: set[str] = set()
    out = []
    for path in given:
        key = os.path.normcase(os.path.abspath(path))
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


def _bad_define(
    spec_axes: dict[str, list[str]], sizes: dict[str, int], flag: str = "-D"
) -> str | None:
    for path, axes in spec_axes.items():
        for name in sizes:
            if name not in axes:
                known = ", ".join(axes)
                return f"{flag} {name}: spec {path} has no mesh axis {name!r} (axes: {known})"
    return None


def _print_diags(outcome, fmt: str = "text") -> None:
    from shardspec.findings.diagnostics import attach_sources, render_all_text, render_json

    diags = attach_sources(outcome.diagnostics, outcome.sources)
    if fmt == "json":
        sys.stdout.write(render_json(diags))
    elif diags:
        sys.stderr.write(render_all_text(diags))


def _print_sarif(outcome, paths: list[str], sizes: dict[str, int], world: int | None) -> None:
    from shardspec.api import silenced_findings
    from shardspec.findings.diagnostics import attach_sources
    from shardspec.findings.sarif import render_sarif

    diags = attach_sources(outcome.diagnostics, outcome.sources)
    silenced = attach_sources(silenced_findings(paths, sizes, world), outcome.sources)
    sys.stdout.write(render_sarif(diags, silenced, successful=not outcome.input_error))


def _status(outcome) -> int:
    if outcome.input_error:
        return 2
    return 1 if outcome.errors else 0


def _check_defines(args, paths, flag: str = "-D") -> int | None:
    """SS006/SS004 for bad ``-D`` values (``flag``: the option as the user wrote it)."""
    from shardspec.findings.diagnostics import clip
    from shardspec.frontend.limits import NUMBER_HINT

    for name, size in args.defines:
        if isinstance(size, str):
            _bad_argument(
                f"{flag} {name}: number too large: {clip(size)} ({len(size)} digits)",
                NUMBER_HINT,
                "SS006",
            )
            return 2
    twice = _repeated_define(args.defines, flag)
    if twice:
        _bad_argument(twice, "give each axis once")
        return 2
    sizes, _ = _split_defines(args.defines)
    if not sizes:
        return None
    from shardspec.frontend.parse import parse_file

    axes = {}
    for p in paths:
        spec, _ = parse_file(p)
        if spec is not None and spec.mesh is not None:
            meshes = spec.views or (spec.mesh,)  # every view's axes
            axes[p] = list(dict.fromkeys(a.name.text for m in meshes for a in m.axes))
    bad = _bad_define(axes, sizes, flag)
    if bad:
        _bad_argument(bad, f"{flag} takes a mesh axis of every spec given, or world")
        return 2
    return None


def cmd_lint(args) -> int:
    from shardspec.api import lint_specs

    paths = _specs(args.specs)
    if not paths:
        _bad_argument(f"no specs given and none match {DEFAULT_GLOB}", "name the spec files")
        return 2
    bad = _check_defines(args, paths)
    if bad is not None:
        return bad
    sizes, world = _split_defines(args.defines)
    _, outcome = lint_specs(paths, sizes, world)
    if args.format == "sarif":
        _print_sarif(outcome, paths, sizes, world)
        return _status(outcome)
    _print_diags(outcome, args.format)
    if args.format != "json" and not outcome.diagnostics:
        # One line on success, so a quiet run is told from one that checked nothing.
        sys.stdout.write(f"shardspec lint: {len(paths)} spec(s) checked, no findings\n")
    return _status(outcome)


def cmd_fmt(args) -> int:
    import difflib

    from shardspec.findings.diagnostics import attach_sources, render_all_text
    from shardspec.frontend.fmt import format_file
    from shardspec.frontend.textfile import replace_text

    paths = _specs(args.specs)
    if not paths:
        _bad_argument(f"no specs given and none match {DEFAULT_GLOB}", "name the spec files")
        return 2
    write = not (args.check or args.diff)
    failed = changed = 0
    diags, sources = [], {}
    for path in paths:
        got = format_file(path)
        if got.formatted is None or got.text is None:
            failed += 1
            diags += got.diagnostics
            if got.text is not None:
                sources[path] = got.text
            continue
        if not got.changed:
            continue
        changed += 1
        if args.diff:
            before, after = got.text.splitlines(True), got.formatted.splitlines(True)
            sys.stdout.writelines(difflib.unified_diff(before, after, path, path))
        if args.check:
            sys.stdout.write(f"would reformat: {path}\n")
        if write:
            try:
                replace_text(path, got.formatted)
            except OSError as e:
                failed += 1
                sys.stderr.write(
                    f"{path}:1:1: error SS002 [unreadable-input]: cannot write the spec: "
                    f"{e.strerror or e}\n  hint: check the file's folder is writable\n"
                )
                continue
            sys.stdout.write(f"reformatted: {path}\n")
    sys.stderr.write(render_all_text(attach_sources(diags, sources)))
    verb = "reformatted" if write else "would be reformatted"
    left = len(paths) - changed - failed
    sys.stderr.write(
        f"shardspec fmt: {changed} file(s) {verb}, {left} already formatted"
        + (f", {failed} not formatted (see above)" if failed else "")
        + "\n"
    )
    if failed:
        return 2
    return 1 if changed and not write else 0


def cmd_compile(args) -> int:
    from shardspec.api import compile_specs

    paths = _specs(args.specs)
    if not paths:
        _bad_argument(f"no specs given and none match {DEFAULT_GLOB}", "name the spec files")
        return 2
    bad = _check_defines(args, paths)
    if bad is not None:
        return bad
    sizes, world = _split_defines(args.defines)
    try:
        outcome = compile_specs(
            paths, args.out, check_only=args.check, overrides=sizes, world=world
        )
    except OSError as e:
        where = e.filename or args.out
        sys.stderr.write(
            f"{where}:1:1: error SS002 [unreadable-input]: cannot write output: "
            f"{e.strerror or e}\n  hint: check the output directory\n"
        )
        return 2
    _print_diags(outcome)
    if outcome.errors:
        verb = "checked" if args.check else "written"
        sys.stderr.write(f"shardspec compile: nothing {verb} (fix the errors above)\n")
        return _status(outcome)
    if args.check:
        for path, diff in outcome.stale:
            sys.stdout.write(f"stale: {path}\n{diff}")
        if outcome.stale:
            sys.stderr.write(
                f"{len(outcome.stale)} generated file(s) out of date; run "
                f"`{_compile_command(args)}`\n"
            )
            return 1
        return 0
    for path in outcome.written:
        sys.stdout.write(f"wrote {path}\n")
    return 0


def _compile_command(args) -> str:
    """The ``shardspec compile`` command that rewrites what ``args`` checked."""
    parts = ["shardspec", "compile"]
    if args.out != "generated":
        parts += ["-o", args.out]
    for name, size in args.defines:
        parts += ["-D", f"{name}={size}"]
    return " ".join(parts + list(args.specs))


def cmd_explain(args) -> int:
    from shardspec.explain import explain_facts, render_text

    bad = _check_defines(args, [args.spec])
    if bad is not None:
        return bad
    sizes, world = _split_defines(args.defines)
    ranks = None
    if args.ranks is not None:
        ranks = _rank_range(args.ranks)
        if ranks is None:
            _bad_argument(
                f"--ranks {args.ranks!r} is not a rank or a range of ranks",
                "write --ranks 128 or --ranks 0-255",
            )
            return 2
    facts = explain_facts(args.spec, args.fqn, sizes, world, ranks)
    (sys.stdout if facts.status == 0 else sys.stderr).write(render_text(facts))
    return facts.status


def cmd_transfer(args) -> int:
    import json
    from pathlib import Path

    from shardspec.api import CompileOutcome, _write_all
    from shardspec.findings.diagnostics import attach_sources, render_all_text, render_json
    from shardspec.transfer import plan_json, plan_transfer, render_text

    sides = []
    for side, path in (("train", args.train), ("infer", args.infer)):
        defines = argparse.Namespace(defines=getattr(args, f"{side}_defines"))
        bad = _check_defines(defines, [path], f"--{side}-D")
        if bad is not None:
            return bad
        sides.append(_split_defines(getattr(args, f"{side}_defines")))
    (ts, tw), (es, ew) = sides
    plan = plan_transfer(args.train, args.infer, ts, es, tw, ew)
    diags = attach_sources(plan.diagnostics, plan.sources)
    if plan.status == 0 and args.plan:
        try:
            text = json.dumps(plan_json(plan), separators=(",", ":")) + "\n"
            _write_all([(Path(args.plan), text)], CompileOutcome())
        except OSError as e:
            _bad_argument(
                f"--plan {args.plan}: cannot write: {e.strerror or e}", "check the path", "SS002"
            )
            return 2
    if args.format == "json":
        out = json.loads(render_json(diags))
        doc = {"diagnostics": out, "status": plan.status}
        if plan.status == 0:
            doc["plan"] = plan_json(plan)
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
        return plan.status
    if diags:
        sys.stderr.write(render_all_text(diags))
    if plan.status == 0:
        sys.stdout.write(render_text(plan))
        if args.plan:
            sys.stdout.write(f"wrote {args.plan}\n")
    return plan.status


def _rank_range(text: str) -> range | None:
    """``128`` or ``0-255`` as a range of ranks; None for anything else."""
    lo, sep, hi = text.strip().partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()) or len(text) > 40:
        return None
    a, b = int(lo), int(hi) if sep else int(lo)
    return range(a, b + 1) if a <= b else None


def cmd_manifest(args) -> int:
    from shardspec.inputs.manifest_build import ManifestBuildError, write_manifest

    try:
        n, hooks = write_manifest(args.factory, args.output, args.args)
    except ManifestBuildError as e:
        _bad_argument(str(e), e.hint, e.code)
        return 2
    if hooks:
        sys.stderr.write(
            "warning: state-dict hooks change what state_dict() returns; the manifest lists "
            "the parameters and buffers as the model holds them (rules match those), and "
            "its state_dict section records what the hooks change:\n"
            + "".join(f"  {line}\n" for line in hooks)
            + "  a checkpoint saved from state_dict() holds the hooks' keys, which no rule "
            "places: save() refuses them unless strict=False\n"
        )
    sys.stdout.write(f"wrote {args.output} ({n} entries)\n")
    return 0


def cmd_hf_manifest(args) -> int:
    from shardspec.findings.codes import diag
    from shardspec.findings.diagnostics import Span, render_text
    from shardspec.inputs.hfmanifest import (
        HFManifestError,
        build_hf_manifest,
        dump_hf_manifest,
        write_hf_manifest,
    )

    try:
        if args.output:
            n = write_hf_manifest(args.directory, args.output)
        else:
            text = dump_hf_manifest(build_hf_manifest(args.directory))
            sys.stdout.write(text)
            return 0
    except HFManifestError as e:
        hint = e.hint or "run it on a folder written by save_pretrained"
        d = diag(e.code, str(e), Span(args.directory, 1, 1), hint)
        sys.stderr.write(render_text(d) + "\n")
        return 2
    sys.stdout.write(f"wrote {args.output} ({n} tensors)\n")
    return 0


def _add_diff(sub) -> None:
    d = sub.add_parser(
        "diff",
        help="a spec change by its effect: layouts, checkpoint and HF compatibility",
        description="Compare two specs by what they do: each parameter's placements per "
        "mesh axis and its shard on a representative rank (grouped), mesh changes, whether "
        "a checkpoint saved under OLD loads under NEW (keys, global shapes, dtypes), and how "
        "the hf mapping changes. Exit status: 0 no change, 1 changed but checkpoints saved "
        "under OLD load under NEW, 2 a checkpoint-incompatible change, 3 errors in a spec "
        "or the command line (nothing compared).",
    )
    d.add_argument("old", metavar="OLD", help="the spec before the change")
    d.add_argument("new", metavar="NEW", help="the spec after the change")
    d.add_argument(
        "-m",
        "--manifest",
        metavar="FILE",
        help="the model manifest for both specs, in place of the one each names",
    )
    d.add_argument(
        "--format", choices=("text", "json"), default="text", help="output format (default: text)"
    )
    _add_defines(d)


# `shardspec diff`'s exit status for errors: 0-2 are its verdicts (see _add_diff).
DIFF_ERROR = 3


def cmd_diff(args) -> int:
    from shardspec.diff import Refusal, diff_specs, render_json_diff, render_refusal, render_text

    bad = _check_defines(args, [args.old, args.new])
    if bad is not None:
        return DIFF_ERROR
    manifest = None
    if args.manifest is not None:
        from shardspec.inputs.manifest import ManifestError, load_manifest

        try:
            manifest = load_manifest(args.manifest)
        except ManifestError as e:
            code = "SS002" if "cannot read" in str(e) else "SS003"
            _bad_argument(
                f"-m {args.manifest}: {e}", "pass a manifest made by `shardspec manifest`", code
            )
            return DIFF_ERROR
    sizes, world = _split_defines(args.defines)
    found = diff_specs(args.old, args.new, sizes, world, manifest)
    if isinstance(found, Refusal):
        (sys.stdout if args.format == "json" else sys.stderr).write(
            render_refusal(found, args.format)
        )
        return DIFF_ERROR
    sys.stdout.write(render_json_diff(found) if args.format == "json" else render_text(found))
    return int(found.status)


COMMANDS = {
    "lint": cmd_lint,
    "fmt": cmd_fmt,
    "compile": cmd_compile,
    "explain": cmd_explain,
    "manifest": cmd_manifest,
    "hf-manifest": cmd_hf_manifest,
    "transfer": cmd_transfer,
    "diff": cmd_diff,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    global _JSON_OUTPUT
    tokens = list(sys.argv[1:] if argv is None else argv)
    _JSON_OUTPUT = "--format=json" in tokens or any(
        t == "--format" and nxt == "json" for t, nxt in itertools.pairwise(tokens)
    )
    nul = next((t for t in tokens if "\0" in t), None)
    if nul is not None:  # no shell passes one; a caller in Python can, and paths cannot hold it
        _bad_argument(f"argument {nul!r} holds a NUL character", "remove it")
        return 2
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad argument (already reported)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        return DIFF_ERROR if code == 2 and tokens[:1] == ["diff"] else code
    # The compiler builds many small objects that all live until exit; the cyclic garbage
    # collector would rescan them again and again (2 s of a 100k-parameter lint).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    finally:
        if gc_was_enabled:
            gc.enable()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
