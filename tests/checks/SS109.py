"""SS109 unsummed-head-norm: a per-head norm's [head_dim] weight replicated over tp, beside
projections cut over tp by heads, with no `style sequence_parallel input heads`."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
# A Qwen3-like attention (4 heads of 16, hidden 64) in two layers, with per-head q/k norms
# and block norms over the hidden size.
MANIFEST = {
    **{f"layers.{i}.attn.{p}_proj.weight": [64, 64] for i in (0, 1) for p in "qkvo"},
    **{f"layers.{i}.attn.{n}_norm.weight": [16] for i in (0, 1) for n in "qk"},
    **{f"layers.{i}.{n}.weight": [64] for i in (0, 1) for n in ("attn_norm", "mlp_norm")},
}
MODULES = {f: "linear" for f in MANIFEST if "_proj" in f} | {
    f: "RMSNorm" for f in MANIFEST if "norm" in f
}
QKV = (
    "param layers.*.attn.{q,k,v}_proj.weight [out, hidden] {\n    heads out 16\n"
    "    shard out over tp\n}\n"
    "param layers.*.attn.o_proj.weight [hidden, heads] {\n    heads heads 16\n"
    "    shard heads over tp\n}\n"
)
BLOCK_NORMS = "param layers.*.*_norm.weight [dim] {}\n"
HEAD_NORMS = "param layers.*.attn.{q,k}_norm.weight [head_dim] {"


def spec(qkv: str = QKV, norms: str = "}\n", mesh: str = HEAD) -> str:
    return mesh + qkv + HEAD_NORMS + norms + BLOCK_NORMS


CASES = [
    {
        "name": "per-head norms replicated over tp with no style",
        "spec": spec(),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS109",
                12,
                "layers.0.attn.k_norm.weight (and 3 more like it) is replicated over tp, and "
                "its size 16 is the head size of layers.0.attn.k_proj.weight, which is cut "
                "over tp by heads",
                "layers.*.attn.{q,k}_norm.weight",
                "add `style sequence_parallel input heads` to its rule",
            )
        ],
    },
    {
        "name": "per-head norms with the heads style",
        "spec": spec(norms="\n    style sequence_parallel input heads\n}\n"),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "per-head norms with a token-cutting sequence-parallel style",
        "spec": spec(norms="\n    style sequence_parallel\n}\n"),
        "manifest": MANIFEST,
        "modules": MODULES,
        # (the token-cutting style also makes the rowwise o_proj a writer of the whole
        # residual stream, SS115)
        "expect": [
            ("SS109", 12, "is replicated over tp", "layers.*.attn.{q,k}_norm.weight"),
            ("SS115", 8, "layers.0.attn.o_proj.weight is rowwise without `output sequence`"),
        ],
    },
    {
        "name": "attention cut over tp without heads lines",
        "spec": spec(
            qkv="param layers.*.attn.{q,k,v}_proj.weight [out, hidden] {\n"
            "    shard out over tp\n}\n"
            "param layers.*.attn.o_proj.weight [hidden, heads] {\n    shard heads over tp\n}\n"
        ),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "attention whole over tp (heads lines, no cut)",
        "spec": spec(
            qkv="param layers.*.attn.{q,k,v,o}_proj.weight [out, hidden] {\n    heads out 16\n}\n"
        ),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "tp of size 1",
        "spec": spec(mesh=HEAD.replace("tp: 2", "tp: 1")),
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
]
