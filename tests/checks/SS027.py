"""SS027 name-indexed-dim: a dimension indexed by a name capture (per-expert local modules)."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  ep: 2 }\nfsdp dp_shard\n'
MANIFEST = {f"local_experts.{j}.w1.weight": [16, 8] for j in range(2)}

CASES = [
    {
        "name": "name-indexed dim over a non-local axis",
        "spec": HEAD
        + """\
param local_experts.{expert}.w1.weight [expert, ffn, hidden] {
    shard expert over ep
}
""",
        "manifest": MANIFEST,
        "expect": [
            (
                "SS027",
                5,
                "dimension 'expert' is indexed by module name, so it can only be sharded "
                "over local axes, not 'ep'",
                "ep",
                "add `local ep`",
            )
        ],
    },
    {
        "name": "capture that is no dimension",
        "spec": HEAD
        + """\
param local_experts.{e}.w1.weight [ffn, hidden] {}
""",
        "manifest": MANIFEST,
        "expect": [("SS027", 4, "capture {e} names no dimension of the rule", "{e}.w1")],
    },
    {
        "name": "name-indexed dim fused",
        "spec": HEAD
        + """\
param local_experts.{expert}.w1.weight [expert, ffn, hidden] {
    fuse expert as a, b
}
""",
        "manifest": MANIFEST,
        "expect": [("SS027", 5, "dimension 'expert' is indexed by module name", "expert")],
    },
    {
        "name": "name-indexed dim over a local axis",
        "spec": HEAD
        + """\
param local_experts.{expert}.w1.weight [expert, ffn, hidden] {
    local ep
    shard expert over ep
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "plain wildcard instead of a capture",
        "spec": HEAD
        + """\
param local_experts.*.w1.weight [ffn, hidden] {}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "heads of a dimension indexed by module name",
        "spec": HEAD
        + """\
param local_experts.{expert}.w1.weight [expert, ffn, hidden] {
    local ep
    shard expert over ep
    heads expert 1
}
""",
        "manifest": MANIFEST,
        "expect": [("SS027", 7, "heads: dimension 'expert' is indexed by module name", "expert 1")],
    },
]
