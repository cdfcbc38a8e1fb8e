"""SS022 duplicate-dim: a rule names the same dimension twice."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'

CASES = [
    {
        "name": "hidden twice",
        "spec": HEAD
        + """\
param w [hidden, hidden] {}
""",
        "manifest": {"w": [8, 8]},
        "expect": [("SS022", 4, "dimension 'hidden' is named twice", "hidden]")],
    },
    {
        "name": "distinct names",
        "spec": HEAD
        + """\
param w [out, hidden] {}
""",
        "manifest": {"w": [8, 8]},
        "expect": [],
    },
]
