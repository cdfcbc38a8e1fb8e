"""SS040 unmatched-parameter: a parameter no rule or ignore matches, or an extra state no
ignore matches. The finding points at the entry in the manifest."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {
    "attn.fp8._extra_state": None,  # manifest line 3
    "attn.wq.bias": [8],  # line 4
    "attn.wq.weight": [8, 8],  # line 5
}

CASES = [
    {
        "name": "parameter and extra state without rules",
        "spec": HEAD
        + """\
param **.weight [out, in] {}
""",
        "manifest": MANIFEST,
        "expect": [
            (
                "SS040",
                "m.json:3",
                "extra state 'attn.fp8._extra_state' is matched by no ignore rule",
                '"attn.fp8._extra_state"',
                "ignore **._extra_state",
            ),
            ("SS040", "m.json:4", "parameter 'attn.wq.bias' [8] is matched by no rule"),
        ],
    },
    {
        "name": "extra state matched by a param rule still needs an ignore",
        "spec": HEAD
        + """\
param attn.** [x] replicate
param **.weight [out, in] {}
""",
        "manifest": MANIFEST,
        "expect": [("SS040", "m.json:3", "extra state 'attn.fp8._extra_state'")],
    },
    {
        "name": "everything covered",
        "spec": HEAD
        + """\
ignore **._extra_state
param **.weight [out, in] {}
param **.bias [out] replicate
""",
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "parameter ignored",
        "spec": HEAD
        + """\
ignore **._extra_state
ignore **.bias
param **.weight [out, in] {}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
]
