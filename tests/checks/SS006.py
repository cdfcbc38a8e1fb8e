"""SS006 number-too-large: a whole number in the spec or in ``-D`` over 2**63 - 1. Every
place a number is written is a case: before, a number of over 4,300 digits was a
``ValueError`` traceback (inside lark's ``VisitError``), and smaller huge ones ran on into
the checks."""

BIG = "9" * 4000  # (a number of over 4096 digits is a token too long: SS007)
OVER = str(2**63)  # the first number refused
MAX = str(2**63 - 1)  # the last one accepted


def _case(name: str, spec: str, token: str, line: int = 1) -> dict:
    return {
        "name": name,
        "spec": spec,
        "expect": [("SS006", line, "number too large: ", token[:20], "2**63 - 1")],
    }


CASES = [
    _case("axis size", f"mesh over 8 ranks {{ dp: *  tp: {BIG} }}", BIG),
    _case("world size", f"mesh over {BIG} ranks {{ dp: * }}", BIG),
    _case("world size one past the largest", f"mesh over {OVER} ranks {{ dp: * }}", OVER),
    _case(
        "groups",
        f"mesh over 8 ranks {{ dp: * }}\nparam w [x] {{\n    fuse x as {BIG} groups of a, b\n}}",
        BIG,
        3,
    ),
    _case(
        "component size",
        f"mesh over 8 ranks {{ dp: * }}\nparam w [x] {{\n    fuse x as a {BIG}, b 4\n}}",
        BIG,
        3,
    ),
    _case(
        "heads",
        f"mesh over 8 ranks {{ dp: * }}\nparam w [x] {{\n    heads x {BIG}\n}}",
        BIG,
        3,
    ),
    _case(
        "split counts",
        f"mesh over 8 ranks {{ pp: * }}\npipeline pp {{\n    split layers.{{i}} as 1, {BIG}\n}}",
        BIG,
        3,
    ),
    _case("rope", f"hf {{\n    a -> b rope {BIG}\n}}", BIG, 2),
    _case("part size", f"hf {{\n    a -> b as q {BIG}, k\n}}", BIG, 2),
    _case("number in a part's product", f"hf {{\n    a -> b as q (h * {BIG}), k\n}}", BIG, 2),
    _case("number in a config product", f"hf {{\n    config x = h * {BIG}\n}}", BIG, 2),
    {
        "name": "-D size",
        "spec": "mesh over 8 ranks { dp: *  tp: 2 }",
        "args": ["-D", "tp=" + "9" * 5000],  # over Python's 4,300-digit limit on reading ints
        "expect": [("SS006", "<command line>:1", "-D tp: number too large", "", "2**63 - 1")],
    },
    {
        "name": "-D world",
        "spec": "mesh over 8 ranks { dp: *  tp: 2 }",
        "args": ["-D", f"world={OVER}"],
        "expect": [("SS006", "<command line>:1", "-D world: number too large", "", "2**63")],
    },
    # passing: the largest number read as a number, leading zeros, and numbers in names
    {
        "name": "the largest number is read (and the mesh check says what it thinks)",
        "spec": f"mesh over 8 ranks {{ dp: *  tp: {MAX} }}",
        "expect": [("SS010", 1, "not divisible")],
    },
    {
        "name": "leading zeros do not make a number large",
        "spec": "mesh over " + "0" * 4000 + "8 ranks { dp: *  tp: 2 }",
        "expect": [],
    },
    {
        "name": "digits in a name are no number",
        "spec": f"mesh over 8 ranks {{ dp: *  tp: 2 }}\nparam layers.{MAX}0 [x] {{}}",
        "expect": [],
    },
]
