"""SS007 token-too-long: a name, pattern, quoted path or number of more than 4096
characters. A 50 MB name used to take minutes and gigabytes (each check compiled, compared
and quoted it) and its findings echoed it whole; it is refused when read, and the finding
quotes its start and end only."""

LONG = "a" * 5000


def _case(name: str, spec: str, line: int, what: str, quote: str = "'") -> dict:
    return {
        "name": name,
        "spec": spec,
        "expect": [
            ("SS007", line, f"{what} {quote}aaaa", quote.strip("'") + "aaaa", "at most 4096")
        ],
    }


CASES = [
    _case("axis name", f"mesh over 8 ranks {{ dp: *  {LONG}: 2 }}", 1, "name"),
    _case("fsdp axis", f"mesh over 8 ranks {{ dp: * }}\nfsdp {LONG}", 2, "name"),
    _case("rule pattern", f"mesh over 8 ranks {{ dp: * }}\nparam {LONG} [x] {{}}", 2, "pattern"),
    _case("dimension", f"mesh over 8 ranks {{ dp: * }}\nparam w [{LONG}] {{}}", 2, "name"),
    _case("manifest path", f'manifest "{LONG}"', 1, "quoted string", '"'),
    _case("hf name", f"hf {{\n    {LONG} -> b\n}}", 2, "pattern"),
    _case("config product", f"hf {{\n    config x = {LONG}\n}}", 2, "product"),
    {
        "name": "a long number is a long token before it is a large number",
        "spec": "mesh over " + "0" * 5000 + "8 ranks { dp: * }",
        "expect": [("SS007", 1, "number '0000", "0000", "at most 4096 characters")],
    },
    # numbers of over 4,300 digits, which Python refuses to read, at each kind of place
    *(
        {
            "name": f"a number of 5000 digits as {where}",
            "spec": spec.replace("N", "9" * 5000),
            "expect": [("SS007", line, "number '9999", "9999", "at most 4096 characters")],
        }
        for where, spec, line in [
            ("axis size", "mesh over 8 ranks { dp: *  tp: N }", 1),
            ("world size", "mesh over N ranks { dp: * }", 1),
            ("groups", "param w [x] {\n    fuse x as N groups of a, b\n}", 2),
            ("component size", "param w [x] {\n    fuse x as a N, b 4\n}", 2),
            ("head size", "param w [x] {\n    heads x N\n}", 2),
            ("split count", "pipeline pp {\n    split layers.{i} as 1, N\n}", 2),
            ("rope", "hf {\n    a -> b rope N\n}", 2),
            ("part size", "hf {\n    a -> b as q N, k\n}", 2),
        ]
    ),
    # passing: at the bound, and long comments (not tokens)
    {
        "name": "a name of 4096 characters",
        "spec": "mesh over 8 ranks { dp: * }\nparam " + "a" * 4096 + " [x] {}",
        "expect": [],
    },
    {
        "name": "a long comment",
        "spec": f"mesh over 8 ranks {{ dp: * }}  # {LONG}",
        "expect": [],
    },
]
