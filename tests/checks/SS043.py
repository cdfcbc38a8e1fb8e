"""SS043 ambiguous-rules: two rules of equal precedence match one parameter; file order
never decides."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'

CASES = [
    {
        "name": "equal keys on one parameter",
        "spec": HEAD
        + """\
param layers.10.* [a, b] {}
param layers.*.w2 [a, b] {
    shard a over tp
}
""",
        "manifest": {"layers.10.w2": [8, 8], "layers.10.w1": [8, 8], "layers.2.w2": [8, 8]},
        "expect": [
            (
                "SS043",
                5,
                "rules 'layers.10.*' (line 4) and 'layers.*.w2' have equal precedence and "
                "both match layers.10.w2",
                "layers.*.w2",
                "2 literal segment(s)",
            )
        ],
    },
    {
        "name": "a more literal rule settles it",
        "spec": HEAD
        + """\
param layers.10.* [a, b] {}
param layers.*.w2 [a, b] {
    shard a over tp
}
param layers.10.w2 [a, b] {}
""",
        "manifest": {"layers.10.w2": [8, 8], "layers.10.w1": [8, 8], "layers.2.w2": [8, 8]},
        "expect": [],
    },
]
