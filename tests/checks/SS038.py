"""SS038 custom-module-style: torch's colwise or rowwise style on a module whose class runs
a forward of its own (the manifest's `class` and `forward`)."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"tok.weight": [16, 8], "head.weight": [16, 8]}
MODULES = {"tok.weight": "embedding", "head.weight": "linear"}
EMBEDDING = "torch.nn.modules.sparse.Embedding"
LINEAR = "torch.nn.modules.linear.Linear"
VOCAB = "models.VocabParallelEmbedding"  # an nn.Embedding with a forward of its own
HEAD_RULE = (
    "param head.weight [vocab, hidden] {\n    shard vocab over tp\n"
    "    style colwise output replicate\n}\n"
)
TOK = "param tok.weight [vocab, hidden] {\n    shard vocab over tp\n}\n"


def case(name: str, spec: str, tok: dict | None, expect: list, head: str = LINEAR) -> dict:
    """A case on the two-module manifest (``tok``: the embedding's fields; None records no
    classes, as older manifests)."""
    out = {"name": name, "spec": HEAD + spec, "manifest": MANIFEST, "modules": MODULES}
    if tok is not None:
        out["fields"] = {"tok.weight": tok, "head.weight": {"class": head}}
    return out | {"expect": expect}


CASES = [
    case(
        "a vocab-parallel embedding given the derived rowwise style",
        TOK + HEAD_RULE,
        {"class": VOCAB},
        [
            (
                "SS038",
                4,
                "tok.weight gets torch's rowwise style (derived from its placements), but its "
                "module VocabParallelEmbedding (models.VocabParallelEmbedding) runs its own "
                "forward(), not torch's Linear or Embedding forward that torch's rowwise style "
                "wraps",
                "tok.weight",
                "state `style none` if the module's forward handles its shards itself",
            )
        ],
    ),
    case(
        "a stated rowwise style on it",
        TOK.replace("tp\n}", "tp\n    style rowwise\n}") + HEAD_RULE,
        {"class": VOCAB},
        [("SS038", 6, "tok.weight gets torch's rowwise style (stated)", "rowwise")],
    ),
    case(
        "a Linear subclass with its own forward",
        "param tok.weight [vocab, hidden] {}\n" + HEAD_RULE,
        {"class": EMBEDDING},
        [("SS038", 7, "head.weight gets torch's colwise style (stated)", "colwise")],
        head="models.Fp8Linear",
    ),
    case(
        "style none: its forward handles the shards",
        TOK.replace("tp\n}", "tp\n    style none\n}") + HEAD_RULE,
        {"class": VOCAB},
        [],
    ),
    case("torch's own Embedding and Linear", TOK + HEAD_RULE, {"class": EMBEDDING}, []),
    case(
        "a subclass that inherits torch's forward",
        TOK + HEAD_RULE,
        {"class": "models.NamedEmbedding", "forward": EMBEDDING},
        [],
    ),
    case(
        "the custom embedding replicated over tp",
        "param tok.weight [vocab, hidden] {}\n" + HEAD_RULE,
        {"class": VOCAB},
        [],
    ),
    case("a manifest without classes (not checked)", TOK + HEAD_RULE, None, []),
]
