"""SS021 dims-rank-mismatch: the rule names a different number of dimensions than the
tensor has, or none at all."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
# TransformerEngine's GroupedLinear keeps all GEMMs of a layer's experts in one
# [num_gemms, out, in] tensor.
GROUPED = {"layers.0.moe.experts.fc1.weight": [8, 64, 32]}

CASES = [
    {
        "name": "2-D rule on a 3-D grouped experts tensor",
        "spec": HEAD
        + """\
param layers.*.moe.experts.fc1.weight [out, in] {
    shard out over tp
}
""",
        "manifest": GROUPED,
        "expect": [
            (
                "SS021",
                4,
                "the rule names 2 dimension(s) ['out', 'in'], but the tensor has 3: "
                "shape [8, 64, 32]",
                "out, in",
            )
        ],
    },
    {
        "name": "3-D rule on the grouped experts tensor",
        "spec": HEAD
        + """\
param layers.*.moe.experts.fc1.weight [gemm, out, in] {
    shard out over tp
}
""",
        "manifest": GROUPED,
        "expect": [],
    },
    {
        "name": "one finding for many layers",
        "spec": HEAD
        + """\
param layers.*.w [out, in] {}
""",
        "manifest": {f"layers.{i}.w": [8] for i in range(3)},
        "expect": [("SS021", 4, "layers.0.w (and 2 more): the rule names 2 dimension(s)")],
    },
    {
        "name": "no dimension list",
        "spec": HEAD
        + """\
param w {
    shard out over tp
}
""",
        "manifest": {"w": [8, 8]},
        "expect": [("SS021", 4, "does not name the parameter's dimensions", "w {")],
    },
    {
        "name": "replicate may leave out the dimensions",
        "spec": HEAD
        + """\
param w replicate
""",
        "manifest": {"w": [8, 8]},
        "expect": [],
    },
    {
        "name": "scalar with an empty dimension list",
        "spec": HEAD
        + """\
param scale [] {}
""",
        "manifest": {"scale": []},
        "expect": [],
    },
]
