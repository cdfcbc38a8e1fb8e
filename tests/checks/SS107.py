"""SS107 expert-on-tensor-parallel: an EP axis that tensor-parallel rules cut over too."""

MANIFEST = {"moe.experts.w1": [8, 4, 8], "attn.wq.weight": [8, 8]}
MODULES = {"moe.experts.w1": "Experts", "attn.wq.weight": "linear"}
EXPERTS = (
    "param moe.experts.w1 [expert, ffn, hidden] {{\n    shard expert over {ep}\n"
    "    style expert_parallel\n}}\n"
)
ATTN = "param attn.wq.weight [out, hidden] {\n    shard out over tp\n}\n"

CASES = [
    {
        "name": "experts over the dense tp",
        "spec": 'manifest "m.json"\nmesh over 8 ranks { dp: *  tp: 2 }\nfsdp dp\n'
        + EXPERTS.format(ep="tp")
        + ATTN,
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS107",
                5,
                "EP axis 'tp' is also the tensor-parallel axis of attn.wq.weight",
                "tp",
                "declare an expert view",
            )
        ],
    },
    {
        "name": "experts on a view of their own",
        "spec": 'manifest "m.json"\nmesh dense over 8 ranks { dp: *  tp: 2 }\n'
        "mesh expert { ep: 2  edp: * }\nfsdp dp\nfsdp edp\n" + EXPERTS.format(ep="ep") + ATTN,
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
]
