"""SS117 replicated-heads-layout: `heads ... replicated` on a dimension that is not fused
(or fused in groups), with a named size, or not split over exactly one local axis."""

HEAD = 'manifest "m.json"\nmesh { tp: 4 }\n'
QKV = """\
param qkv_proj.weight [qkv, hidden] {
    fuse qkv as q 64, k 32, v 32
    heads k 16 replicated
    shard qkv over tp
    local tp
}
"""
MANIFEST = {"qkv_proj.weight": [16 + 16 + 8, 8]}

CASES = [
    {
        "name": "a fused component over one local axis",
        "spec": HEAD + QKV,
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "not local: no DTensor placement holds a head on several ranks",
        "spec": HEAD + QKV.replace("    local tp\n", ""),
        "manifest": {"qkv_proj.weight": [128, 8]},
        "expect": [
            (
                "SS117",
                5,
                "'qkv' is split over tp; replicated heads need one axis that the module "
                "holds locally",
                "k 16 replicated",
                "`local tp`",
            ),
            ("SS031", 6, "no DTensor placements describe this layout"),
        ],
    },
    {
        "name": "a plain dimension",
        "spec": HEAD
        + "param k_proj.weight [kv, hidden] {\n    heads kv 16 replicated\n"
        + "    shard kv over tp\n    local tp\n}\n",
        "manifest": {"k_proj.weight": [16, 8]},
        "expect": [
            ("SS117", 4, "'kv' is not a fused dimension", "kv 16 replicated", "fuse the dimension"),
        ],
    },
    {
        "name": "groups",
        "spec": HEAD
        + QKV.replace("q 64, k 32, v 32", "4 groups of q 16, k 8, v 8").replace(
            "heads k 16 replicated", "heads qkv 8, k 8 replicated"
        ),
        "manifest": {"qkv_proj.weight": [32, 8]},
        "expect": [
            ("SS117", 5, "'qkv' is fused in groups", "k 8 replicated", "without groups"),
            ("SS035", 5, "heads of 'k' are given twice"),
        ],
    },
    {
        "name": "a named size",
        "spec": HEAD + QKV.replace("k 16 replicated", "k head_dim replicated"),
        "manifest": {"qkv_proj.weight": [32, 8]},
        "expect": [
            ("SS117", 5, "must be a number", "k head_dim replicated", "as a number"),
            ("SS035", 5, "head_dim"),
        ],
    },
]
