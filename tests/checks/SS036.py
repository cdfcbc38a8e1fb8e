"""SS036 unpaired-tp-cut: within a block, a colwise module's output stays cut on the
features over an axis and no rowwise module reads it, or the converse."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
# A Qwen2-like model: two layers of attention, an MLP, an embedding and a head.
MANIFEST = {
    **{f"layers.{i}.attn.{p}.weight": [16, 16] for i in (0, 1) for p in ATTN},
    **{f"layers.{i}.mlp.{p}.weight": [32, 16] for i in (0, 1) for p in ("gate", "up")},
    **{f"layers.{i}.mlp.down.weight": [16, 32] for i in (0, 1)},
    "embed.weight": [64, 16],
    "head.weight": [64, 16],
}
MODULES = {f: ("embedding" if f.startswith("embed") else "linear") for f in MANIFEST}
MLP = (
    "param layers.*.mlp.{gate,up}.weight [ffn, hidden] {\n    shard ffn over tp\n}\n"
    "param layers.*.mlp.down.weight [hidden, ffn] {\n    shard ffn over tp\n}\n"
)
ENDS = (
    "param embed.weight [vocab, hidden] {\n    shard vocab over tp\n}\n"
    "param head.weight [vocab, hidden] {\n    shard vocab over tp\n"
    "    style colwise output replicate\n}\n"
)
QKV_REPLICATED = "param layers.*.attn.{q,k,v}_proj.weight [out, hidden] {}\n"
QKV_COLWISE = "param layers.*.attn.{q,k,v}_proj.weight [out, hidden] {\n    shard out over tp\n}\n"
O_ROWWISE = "param layers.*.attn.o_proj.weight [hidden, heads] {\n    shard heads over tp\n}\n"
O_REPLICATED = "param layers.*.attn.o_proj.weight [hidden, heads] {}\n"

CASES = [
    {
        "name": "q, k, v replicated over tp while o_proj is sharded over it",
        "spec": HEAD + QKV_REPLICATED + O_ROWWISE + MLP + ENDS,
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS036",
                5,
                "in layers.0.attn (and 1 more like it), o_proj reads its input as features cut "
                "over tp (rowwise, size 2), but no module there cuts its output that way: "
                "k_proj, q_proj, v_proj are replicated over tp",
                "layers.*.attn.o_proj.weight",
                "shard the out dimension of k_proj, q_proj, v_proj over tp too (colwise), or "
                "keep o_proj replicated over tp",
            )
        ],
    },
    {
        "name": "q, k, v cut over tp while o_proj is replicated over it",
        "spec": HEAD + QKV_COLWISE + O_REPLICATED + MLP + ENDS,
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS036",
                4,
                "in layers.0.attn (and 1 more like it), k_proj, q_proj, v_proj cut their "
                "output on the features over tp (colwise, size 2), but no module there reads "
                "features cut that way: o_proj is replicated over tp and would read a rank's "
                "columns as the whole",
                "layers.*.attn.{q,k,v}_proj.weight",
                "shard the in dimension of o_proj over tp (rowwise)",
            )
        ],
    },
    {
        "name": "an MLP whose down projection is replicated",
        "spec": HEAD
        + QKV_COLWISE
        + O_ROWWISE
        + "param layers.*.mlp.{gate,up}.weight [ffn, hidden] {\n    shard ffn over tp\n}\n"
        + "param layers.*.mlp.down.weight [hidden, ffn] {}\n"
        + ENDS,
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [("SS036", 10, "in layers.0.mlp (and 1 more like it), gate, up cut", "")],
    },
    {
        "name": "a head whose logits stay cut over tp",
        "spec": HEAD
        + QKV_COLWISE
        + O_ROWWISE
        + MLP
        + "param embed.weight [vocab, hidden] {\n    shard vocab over tp\n}\n"
        + "param head.weight [vocab, hidden] {\n    shard vocab over tp\n}\n",
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS036",
                19,
                "in the model, head cuts its output on the features over tp (colwise, size "
                "2), but no module there reads features cut that way: the output leaves the "
                "model cut",
                "head.weight",
                "`style colwise output replicate`",
            )
        ],
    },
    {
        "name": "colwise then rowwise in every block",
        "spec": HEAD + QKV_COLWISE + O_ROWWISE + MLP + ENDS,
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "attention replicated over tp, the MLP cut (Phi3's spec)",
        "spec": HEAD + QKV_REPLICATED + O_REPLICATED + MLP + ENDS,
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "loss parallelism: the head's logits stay a DTensor",
        "spec": HEAD
        + QKV_COLWISE
        + O_ROWWISE
        + MLP
        + "param embed.weight [vocab, hidden] {\n    shard vocab over tp\n}\n"
        + "param head.weight [vocab, hidden] {\n    shard vocab over tp\n"
        + "    style colwise dtensor\n}\n",
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "sequence parallelism: activations cut on the sequence between blocks",
        "spec": HEAD
        + "param layers.*.attn.{q,k,v}_proj.weight [out, hidden] {\n    shard out over tp\n"
        + "    style colwise input sequence\n}\n"
        + "param layers.*.attn.o_proj.weight [hidden, heads] {\n    shard heads over tp\n"
        + "    style rowwise output sequence\n}\n"
        + MLP
        + ENDS,
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "MLA: low-rank projections replicated, their up-projections cut",
        "spec": HEAD
        + "param attn.{q_a,kv_a}.weight [rank, hidden] {}\n"
        + "param attn.{q_b,kv_b}.weight [out, rank] {\n    shard out over tp\n}\n"
        + "param attn.wo.weight [hidden, heads] {\n    shard heads over tp\n}\n",
        "manifest": {
            "attn.q_a.weight": [8, 16],
            "attn.kv_a.weight": [8, 16],
            "attn.q_b.weight": [16, 8],
            "attn.kv_b.weight": [16, 8],
            "attn.wo.weight": [16, 16],
        },
        "modules": {f"attn.{p}.weight": "linear" for p in ("q_a", "kv_a", "q_b", "kv_b", "wo")},
        "expect": [],
    },
    {
        "name": "Megatron style: q, k, v hold their own tp shards, o_proj is rowwise",
        "spec": HEAD
        + "param layers.*.attn.{q,k,v}_proj.weight [out, hidden] {\n    shard out over tp\n"
        + "    local tp\n}\n"
        + O_ROWWISE
        + MLP
        + ENDS,
        "manifest": {
            **MANIFEST,
            **{f"layers.{i}.attn.{p}.weight": [8, 16] for i in (0, 1) for p in ATTN[:3]},
        },
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "a block with a module that runs its own forward (style none)",
        "spec": HEAD
        + QKV_REPLICATED
        + O_ROWWISE
        + "param layers.*.attn.rope.weight [out] {\n    shard out over tp\n    style none\n}\n"
        + MLP
        + ENDS,
        "manifest": {
            **MANIFEST,
            "layers.0.attn.rope.weight": [16],
            "layers.1.attn.rope.weight": [16],
        },
        "modules": {
            **MODULES,
            "layers.0.attn.rope.weight": "Rope",
            "layers.1.attn.rope.weight": "Rope",
        },
        "expect": [],
    },
    {
        "name": "tp of size 1",
        "spec": HEAD + QKV_REPLICATED + O_ROWWISE + MLP + ENDS,
        "manifest": MANIFEST,
        "modules": MODULES,
        "args": ["-D", "tp=1"],
        "expect": [],
    },
    {
        "name": "a manifest without module kinds (not checked)",
        "spec": HEAD + QKV_REPLICATED + O_ROWWISE + MLP + ENDS,
        "manifest": MANIFEST,
        "expect": [],
    },
]

# Views: a module is judged over the axes of its own view only. The expert view's module
# is no reader of the dense view's tp cut (it cannot be sharded over tp: SS104), so the
# finding neither names it as one nor hints to shard it over tp.
FOLDED_HEAD = (
    'manifest "m.json"\n'  # line 1
    "mesh dense over 4 ranks { fsdp: *  tp: 2 }\n"
    "mesh expert { ep: 2  efsdp: * }\n"
    "fsdp fsdp\n"
    "fsdp efsdp\n"  # line 5
)
MOE = {f"layers.{i}.moe.{p}.weight": [16, 16] for i in (0, 1) for p in ("gate", "proj")}
MOE_MODULES = dict.fromkeys(MOE, "linear")
PROJ_EXPERT = "param layers.*.moe.proj.weight [out, hidden] {\n    view expert\n}\n"

CASES += [
    {
        "name": "views: a router's cut logits, beside a module of the expert view",
        "spec": FOLDED_HEAD
        + "param layers.*.moe.gate.weight [expert, hidden] {\n    shard expert over tp\n}\n"
        + PROJ_EXPERT,
        "manifest": MOE,
        "modules": MOE_MODULES,
        "expect": [
            (
                "SS036",
                6,
                "in layers.0.moe (and 1 more like it), gate cuts its output on the features "
                "over tp (colwise, size 2), but no module there reads features cut that way: "
                "the output leaves layers.0.moe cut",
                "layers.*.moe.gate.weight",
                "keep gate replicated over tp, or gather the output with `style colwise "
                "output replicate`",
            )
        ],
    },
    {
        "name": "views: a rowwise router, beside a module of the expert view",
        "spec": FOLDED_HEAD
        + "param layers.*.moe.gate.weight [expert, hidden] {\n    shard hidden over tp\n}\n"
        + PROJ_EXPERT,
        "manifest": MOE,
        "modules": MOE_MODULES,
        "expect": [
            (
                "SS036",
                6,
                "in layers.0.moe (and 1 more like it), gate reads its input as features cut "
                "over tp (rowwise, size 2), but no module there cuts its output that way",
                "layers.*.moe.gate.weight",
                "keep gate replicated over tp, or state `input replicate`",
            )
        ],
    },
    {
        "name": "views: the router whole over tp, beside a module of the expert view",
        "spec": FOLDED_HEAD
        + "param layers.*.moe.gate.weight [expert, hidden] {\n    view dense\n}\n"
        + PROJ_EXPERT,
        "manifest": MOE,
        "modules": MOE_MODULES,
        "expect": [],
    },
]
