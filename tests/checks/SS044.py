"""SS044 bad-pattern: a malformed parameter pattern."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"a.b": [8]}

CASES = [
    {
        "name": "doubled dot",
        "spec": HEAD
        + """\
param a..b [x] {}
""",
        "manifest": MANIFEST,
        "expect": [
            ("SS044", 4, "bad pattern 'a..b': empty segment", "a..b"),
            ("SS040", "m.json:3", "parameter 'a.b' [8] is matched by no rule"),
        ],
    },
    {
        "name": "partial double star, empty alternative, bad capture, repeated capture",
        "spec": HEAD
        + """\
param a.w** [x] {}
param {a,}.b [x] {}
param {1x}.b [x] {}
param {a}.{a} [a] {}
ignore a.
""",
        "manifest": MANIFEST,
        "expect": [
            ("SS044", 4, "'**' must be a whole segment", "a.w**"),
            ("SS044", 5, "empty alternative", "{a,}.b"),
            ("SS044", 6, "capture {1x} must be a name", "{1x}.b"),
            ("SS044", 7, "capture {a} appears twice", "{a}.{a}"),
            ("SS044", 8, "empty segment", "a."),
            ("SS040", "m.json:3", "parameter 'a.b' [8] is matched by no rule"),
        ],
    },
    {
        "name": "well-formed patterns",
        "spec": HEAD
        + """\
param a.*.b [x] {}
param {a,c}.b [x] {}
param **.b [x] {}
""",
        "manifest": {"a.0.b": [8], "c.b": [8], "d.b": [8]},
        "expect": [],
    },
]
