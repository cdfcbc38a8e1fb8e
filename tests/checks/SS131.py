"""SS131 key-layout-mismatch: the spec's checkpoint key layout cannot store a fused
parameter as declared (other components than the trainer's hooks present, or a fused tensor
stored whole that a rank holds in several pieces)."""

HEAD = 'manifest "m.json"\nmesh over 4 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
QKV = {"attn.qkv_linear.wqkv.weight": [128, 8]}
W13 = {"ffn.w13.weight": [16, 8]}


def qkv(keys: str, fuse: str) -> str:
    return (
        HEAD
        + keys
        + f"param attn.qkv_linear.wqkv.weight [qkv, hidden] {{\n    {fuse}\n"
        + "    shard qkv over tp\n}\n"
    )


def w13(keys: str, shard: str) -> str:
    return (
        HEAD
        + keys
        + f"param ffn.w13.weight [ffn, hidden] {{\n    fuse ffn as gate, up\n{shard}}}\n"
    )


TT = "checkpoint keys torchtitan\n"

CASES = [
    {
        "name": "torchtitan's hooks write three keys, the fuse line declares two",
        "spec": qkv(TT, "fuse qkv as 2 groups of q 32, kv 32"),
        "manifest": QKV,
        "expect": [
            (
                "SS131",
                6,
                "`checkpoint keys torchtitan` stores this fused parameter's components as wq, "
                "wk, wv",
                "fuse qkv",
                "declare 3 components in the hooks' order (wq, wk, wv)",
            )
        ],
    },
    {
        "name": "q, k and v in whole groups over tp",
        "spec": qkv(TT, "fuse qkv as 2 groups of q 32, k 16, v 16"),
        "manifest": QKV,
        "expect": [],
    },
    {
        "name": "two components in shardspec's own layout",
        "spec": qkv("", "fuse qkv as 2 groups of q 32, kv 32"),
        "manifest": QKV,
        "expect": [],
    },
    {
        "name": "torchtitan stores w13 whole, tp cuts gate and up apart",
        "spec": w13(TT, "    shard ffn over tp\n    shard hidden over dp_shard\n"),
        "manifest": W13,
        "expect": [
            (
                "SS131",
                6,
                "ffn.w13.weight: `checkpoint keys torchtitan` stores this fused tensor whole "
                "(its optimizer state at least), but rank 0 holds dimension 'ffn' as 2 "
                "separate pieces",
                "fuse ffn",
                "drop `checkpoint keys`",
            )
        ],
    },
    {
        "name": "w13 whole on every tp rank",
        "spec": w13(TT, "    shard hidden over (tp, dp_shard)\n"),
        "manifest": W13,
        "expect": [],
    },
]
