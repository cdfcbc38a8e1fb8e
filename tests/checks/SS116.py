"""SS116 replicated-heads-size: a component with `heads ... replicated` split over an axis
whose size neither divides its head count nor is a multiple of it (vLLM's
QKVParallelLinear: tp % num_kv_heads == 0 or num_kv_heads % tp == 0)."""


def spec(tp: int, q: int = 64) -> str:
    return (
        f'manifest "m.json"\nmesh {{ tp: {tp} }}\n'
        "param qkv_proj.weight [qkv, hidden] {\n"
        f"    fuse qkv as q {q}, k 32, v 32\n"
        "    heads q 16, k 16 replicated, v 16 replicated\n"
        "    shard qkv over tp\n"
        "    local tp\n"
        "}\n"
    )


def manifest(q_local: int, kv_local: int) -> dict[str, list[int]]:
    return {"qkv_proj.weight": [q_local + 2 * kv_local, 8]}


CASES = [
    {
        "name": "tp 4 over 2 kv heads: each head on 2 ranks",
        "spec": spec(4),
        "manifest": manifest(16, 16),
        "expect": [],
    },
    {
        "name": "tp 2 divides 2 kv heads: split as usual",
        "spec": spec(2),
        "manifest": manifest(32, 16),
        "expect": [],
    },
    {
        "name": "tp 8 over 2 kv heads (q 128: 8 heads)",
        "spec": spec(8, q=128),
        "manifest": manifest(16, 16),
        "expect": [],
    },
    {
        "name": "tp 3 neither divides 2 kv heads nor is a multiple of them",
        "spec": spec(3, q=96),
        "manifest": manifest(32, 16),
        "expect": [
            (
                "SS116",
                5,
                "qkv_proj.weight: tp=3 neither divides the 2 heads of component 'k' of "
                "'qkv' nor is a multiple of them",
                "k 16 replicated",
                "tp sizes that work: 1, 2, 4, 6",
            ),
            (
                "SS116",
                5,
                "tp=3 neither divides the 2 heads of component 'v'",
                "v 16 replicated",
            ),
        ],
    },
]
