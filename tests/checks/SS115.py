"""SS115 half-sequence-parallel: norms `style sequence_parallel` (tokens cut over tp) while
a module writes the residual stream whole (a rowwise module without `output sequence`, or a
token embedding that is not `rowwise output sequence`)."""

HEAD = 'manifest "m.json"\nmesh over 4 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {
    "embed.weight": [32, 16],
    "attn.wq.weight": [16, 16],
    "attn.wo.weight": [16, 16],
    "attn_norm.weight": [16],
}
MODULES = {
    "embed.weight": "embedding",
    "attn.wq.weight": "linear",
    "attn.wo.weight": "linear",
    "attn_norm.weight": "RMSNorm",
}


def spec(embed: str, wo: str, norm: str = "\n    style sequence_parallel\n") -> str:
    return (
        HEAD
        + f"param embed.weight [vocab, hidden] {{{embed}}}\n"
        + "param attn.wq.weight [out, hidden] {\n    shard out over tp\n"
        + "    style colwise input sequence\n}\n"
        + f"param attn.wo.weight [hidden, heads] {{\n    shard heads over tp\n{wo}}}\n"
        + f"param attn_norm.weight [dim] {{{norm}}}\n"
    )


SP_EMBED = "\n    shard vocab over tp\n    style rowwise output sequence\n"
SP_WO = "    style rowwise output sequence\n"

CASES = [
    {
        "name": "sequence parallel, every writer of the residual stream says so",
        "spec": spec(SP_EMBED, SP_WO),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "a rowwise module without output sequence",
        "spec": spec(SP_EMBED, ""),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS115",
                12,
                "attn.wo.weight is rowwise without `output sequence`: its output is whole on "
                "every rank, but `style sequence_parallel` (line 15) reads the residual",
                "attn.wo.weight",
                "state `style rowwise output sequence`",
            )
        ],
    },
    {
        "name": "the token embedding not cut over tp",
        "spec": spec("", SP_WO),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS115",
                4,
                "the token embedding embed.weight is not cut over tp: its output is whole",
                "embed.weight",
                "`shard vocab over tp` too",
            )
        ],
    },
    {
        "name": "no sequence parallelism: rowwise outputs whole, as they should",
        "spec": spec("\n    shard vocab over tp\n", "", norm=""),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "a sequence_parallel rule that places nothing asks nothing (SS041 says so)",
        "spec": spec("", "", norm="").replace(
            "param attn_norm.weight [dim] {}\n",
            "param attn_norm.weight [dim] {}\n"
            "param nothing.*norm.weight [dim] {\n    style sequence_parallel\n}\n",
        ),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [("SS041", 13, "matches no parameter")],
    },
    {
        "name": "norms that cut heads, not tokens, ask nothing of rowwise modules",
        "spec": spec("", "", norm="\n    style sequence_parallel input heads\n"),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
]
