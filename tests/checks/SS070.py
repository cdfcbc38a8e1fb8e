"""SS070 bad-hf-item: an hf block item that is malformed whatever the model."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST

CASES = [
    {
        "name": "glob in a map line",
        "spec": HEAD + GOOD.replace("model.layers.{i}.up ->", "model.layers.*.up ->"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            ("SS070", 9, "Hugging Face name 'model.layers.*.up': `*` is a glob", "model.layers.*"),
            ("SS071", "m.json:4", "storage unit 'layers.0.w13.up' [4, 8] is produced by no"),
            ("SS073", "hf.json:7", "unexpected HF key 'model.layers.0.up' (and 1 more like it)"),
        ],
    },
    {
        "name": "alternatives in a target",
        "spec": HEAD
        + GOOD.replace("model.norm.weight -> norm.weight", "model.norm.weight -> {norm,x}.weight"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            ("SS070", 7, "target '{norm,x}.weight': `{a,b}` alternatives are globs", "{norm"),
            ("SS071", "m.json:6", "storage unit 'norm.weight' [8]"),
            ("SS073", "hf.json:10", "unexpected HF key 'model.norm.weight'"),
        ],
    },
    {
        "name": "a capture on one side only, and a stack index that is no capture",
        "spec": HEAD
        + GOOD.replace("model.layers.{i}.gate ->", "model.layers.{i}.{j}.gate ->").replace(
            "experts.{e}.w1 -> layers.{i}.experts[e]", "experts.0.w1 -> layers.{i}.experts[e]"
        ),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            ("SS070", 8, "{j} appears only on the Hugging Face side", "model.layers.{i}.{j}"),
            ("SS070", 10, "the stack index [e] is not a capture of the Hugging Face name", "e]"),
            ("SS071", "m.json:3", "storage unit 'layers.0.experts' [2, 4, 8]"),
            ("SS071", "m.json:4", "storage unit 'layers.0.w13.gate' [4, 8] is produced by no"),
            ("SS073", "hf.json:4", "unexpected HF key 'model.layers.0.experts.0.w1' (and 1 more"),
            ("SS073", "hf.json:6", "unexpected HF key 'model.layers.0.gate' (and 1 more"),
        ],
    },
    {
        "name": "odd rope size, bad ties and a config bound twice",
        "spec": HEAD
        + """\
hf "hf.json" {
    model.norm.weight -> norm.weight
    model.layers.{i}.gate -> layers.{i}.w13.gate rope 3
    model.layers.{i}.up -> layers.{i}.w13.up
    model.layers.{i}.experts.{e}.w1 -> layers.{i}.experts[e]
    tie a.weight = a.weight
    tie b.weight = c.*
    tie d.weight = model.norm.weight
    tie e.weight = d.weight
    config hidden = hidden_size
    config hidden = hidden_size
}
""",
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            ("SS070", 8, "rope needs an even head size, got 3", "rope 3"),
            ("SS070", 11, "tie 'a.weight' to itself", "tie"),
            ("SS070", 12, "tie: a tie names two Hugging Face keys literally", "tie"),
            ("SS070", 14, "tie source 'd.weight' is itself an alias (line 13)", "d.weight"),
            ("SS070", 16, "config 'hidden' is bound twice (first at line 15)", "hidden"),
            ("SS071", "m.json:4", "storage unit 'layers.0.w13.gate' [4, 8] is produced by no"),
            ("SS073", "hf.json:6", "unexpected HF key 'model.layers.0.gate' (and 1 more"),
        ],
    },
    {
        "name": "a drop glob with braces",
        "spec": HEAD + GOOD.replace("}\n", "    drop {a,b}.x\n}\n"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [("SS070", 11, "drop '{a,b}.x': drop and keep globs take", "{a,b}")],
    },
    {
        "name": "captures, stack, rope, ties and config that are well formed",
        "spec": HEAD
        + GOOD.replace(
            "}\n", "    tie lm.weight = model.norm.weight\n    config hidden = hidden_size\n}\n"
        ),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
    {
        "name": "a malformed item is found without any manifest",
        "spec": "mesh over 2 ranks { tp: 2 }\nhf { a.** -> b }\n",
        "expect": [
            ("SS070", 2, "Hugging Face name 'a.**': `**` is a glob", "a.**"),
            ("SS079", 2, "the hf block names no HF manifest", "hf"),
        ],
    },
    {
        "name": "a component named twice in a split line's as list",
        "spec": HEAD
        + GOOD.replace(
            "    model.layers.{i}.gate -> layers.{i}.w13.gate\n"
            "    model.layers.{i}.up -> layers.{i}.w13.up\n",
            "    model.layers.{i}.gate_up -> layers.{i}.w13 as up, gate, up rope 2\n",
        ),
        "manifest": MANIFEST,
        "hf_manifest": {
            **HF,
            "tensors": {
                **{k: v for k, v in HF["tensors"].items() if not k.endswith(("gate", "up"))},
                "model.layers.0.gate_up": [8, 8],
                "model.layers.1.gate_up": [8, 8],
            },
        },
        "expect": [
            ("SS070", 8, "component 'up' is named twice in the `as` list", "up rope 2"),
            ("SS071", "m.json:4", "storage unit 'layers.0.w13.gate' [4, 8]"),
            ("SS071", "m.json:4", "storage unit 'layers.0.w13.up' [4, 8]"),
            ("SS073", "hf.json:6", "unexpected HF key 'model.layers.0.gate_up'"),
        ],
    },
    {
        "name": "a pad before rope, a pad on an `as` part, a pad to 0",
        "spec": """
            mesh over 2 ranks { tp: 2 }
            hf {
                a.weight -> b.weight pad 0 to 64 rope 16
                c.weight -> d.weight as q pad 0 to 64, k
                e.weight -> f.weight pad 0 to 0
            }
            """,
        "expect": [
            ("SS079", 2, "the hf block names no HF manifest"),
            ("SS070", 3, "`pad 0 to 64` comes before `rope`", "pad 0 to 64", "after any `rope`"),
            ("SS070", 4, "in the `as` part 'q': pad a whole tensor", "pad 0 to 64"),
            ("SS070", 5, "`pad 0 to 0`: the multiple must be at least 1", "pad 0 to 0"),
        ],
    },
]
