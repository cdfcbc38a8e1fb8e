"""SS108 expert-group-tokens: ranks of one EP group that hold the same tokens in another view."""

MANIFEST = {"moe.experts.w1": [8, 4, 8], "attn.wq.weight": [8, 8], "norm.weight": [8]}
MODULES = {"moe.experts.w1": "Experts", "attn.wq.weight": "linear"}
RULES = (
    "param moe.experts.w1 [expert, ffn, hidden] {\n    shard expert over ep\n"
    "    style expert_parallel\n}\n"
    "param attn.wq.weight [out, hidden] {\n    shard out over tp\n}\n"
)


def spec(expert: str, norm: str = "") -> str:
    return (
        'manifest "m.json"\nmesh dense over 8 ranks { fsdp: *  tp: 2 }\n'
        f"mesh expert {{ {expert} }}\nfsdp fsdp\nfsdp efsdp\n"
        + RULES
        + f"param norm.weight [dim] {{{norm}}}\n"
    )


CASES = [
    {
        "name": "ep pairs tp ranks",
        "spec": spec("efsdp: *  ep: 2"),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS108",
                7,
                "ranks 0 and 1 are in one EP group over 'ep', but view 'dense' gives them the "
                "same tokens (they differ only in tp",
                "ep",
                "put ep before the expert view's fsdp axis",
            )
        ],
    },
    {
        "name": "ep pairs fsdp ranks",
        "spec": spec("ep: 2  efsdp: *"),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "ep pairs tp ranks of a sequence-parallel view",
        "spec": spec("efsdp: *  ep: 2", "\n    style sequence_parallel\n"),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "ep pairs tp ranks of a view whose norms cut heads, not tokens",
        "spec": spec("efsdp: *  ep: 2", "\n    style sequence_parallel input heads\n"),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [("SS108", 7, "ranks 0 and 1 are in one EP group over 'ep'", "ep")],
    },
]
