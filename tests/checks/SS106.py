"""SS106 expert-parallel-style: `style expert_parallel` on something that is no stacked
expert weight cut over one EP axis (module by module)."""

HEAD = (
    'manifest "m.json"\nmesh dense over 8 ranks { fsdp: *  tp: 2 }\n'
    "mesh expert { ep: 2  efsdp: * }\nfsdp fsdp\nfsdp efsdp\n"
)
MANIFEST = {"moe.experts.w1": [8, 4, 4], "moe.experts.w2": [8, 4, 4]}
MODULES = {"moe.experts.w1": "Experts", "moe.experts.w2": "Experts"}


def rules(w1: str, w2: str = "shard expert over ep\n    style expert_parallel") -> str:
    return (
        f"param moe.experts.w1 [expert, ffn, hidden] {{\n    {w1}\n}}\n"
        f"param moe.experts.w2 [expert, hidden, ffn] {{\n    {w2}\n}}\n"
    )


CASES = [
    {
        "name": "the first dimension not cut",
        "spec": HEAD + rules("shard ffn over ep\n    style expert_parallel"),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS106",
                8,
                "the first dimension 'expert' is not cut over an expert-parallel axis",
                "expert_parallel",
                "`shard expert over ep`",
            )
        ],
    },
    {
        "name": "the EP axis is the fsdp axis",
        "spec": HEAD
        + rules(
            "shard expert over efsdp\n    style expert_parallel",
            "shard expert over efsdp\n    style expert_parallel",
        ),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            ("SS106", 7, "EP axis 'efsdp' is the view's FSDP axis", "efsdp"),
            ("SS106", 11, "EP axis 'efsdp' is the view's FSDP axis", "efsdp"),
        ],
    },
    {
        "name": "a parameter of the module without the style",
        "spec": HEAD
        + rules("shard expert over ep\n    style expert_parallel", "shard expert over ep"),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS106",
                10,
                "moe.experts.w2 has no style expert_parallel, but its module moe.experts does",
                "moe.experts.w2",
            ),
            ("SS033", 10, "no tensor-parallel style derives"),
        ],
    },
    {
        "name": "experts that do not divide over ep",
        "spec": HEAD + rules("shard expert over ep\n    style expert_parallel"),
        "manifest": {"moe.experts.w1": [6, 4, 4], "moe.experts.w2": [6, 4, 4]},
        "modules": MODULES,
        "args": ["-D", "ep=4"],
        "expect": [
            (
                "SS106",
                6,
                "moe.experts.w1: 6 experts do not divide over ep (size 4)",
                "moe.experts.w1",
            ),
            ("SS023", 7, "dimension 'expert' of size 6 does not divide over ep=4"),
            ("SS024", 7, "hold an empty local shard"),
            ("SS023", 11, "dimension 'expert' of size 6 does not divide over ep=4"),
            ("SS024", 11, "hold an empty local shard"),
        ],
    },
    {
        "name": "stacked experts over ep, with expert tensor parallelism over etp",
        "spec": HEAD.replace("{ ep: 2  efsdp: * }", "{ ep: 2  etp: 2  efsdp: * }")
        + rules("shard expert over ep\n    shard ffn over etp\n    style expert_parallel"),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "stacked experts over ep",
        "spec": HEAD + rules("shard expert over ep\n    style expert_parallel"),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
]
