"""SS042 shadowed-rule: a rule that matches parameters but never wins any."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'

CASES = [
    {
        "name": "generic rule beaten everywhere",
        "spec": HEAD
        + """\
param attn.* [out, in] {}
param attn.wq [out, in] {
    shard out over tp
}
""",
        "manifest": {"attn.wq": [8, 8]},
        "expect": [
            (
                "SS042",
                4,
                "rule 'attn.*' never wins: 'attn.wq' (line 5) takes precedence",
                "attn.*",
            )
        ],
    },
    {
        "name": "generic rule wins elsewhere",
        "spec": HEAD
        + """\
param attn.* [out, in] {}
param attn.wq [out, in] {
    shard out over tp
}
""",
        "manifest": {"attn.wq": [8, 8], "attn.wk": [8, 8]},
        "expect": [],
    },
]
