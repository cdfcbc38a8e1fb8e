"""SS086 dropped-model-state: a `drop` discards a Hugging Face tensor that holds a
parameter or persistent buffer of the model, which no map line fills."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST, TENSORS

# The model's norm has a persistent buffer beside its weight, and so does the checkpoint.
BUFFERS = {"norm.bias": [8], "rope.cache": [4]}
WITH_BIAS = {**HF, "tensors": {**TENSORS, "model.norm.bias": [8], "rope.cache": [4]}}


def block(*lines: str) -> str:
    """The shared hf block with ``lines`` added at its end (from line 11)."""
    return GOOD.replace("}\n", "".join(f"    {x}\n" for x in lines) + "}\n")


CASES = [
    {
        "name": "a buffer beside a mapped weight, dropped and kept",
        "spec": HEAD + block("rope.cache -> rope.cache", "drop model.norm.bias", "keep norm.bias"),
        "manifest": MANIFEST,
        "buffers": BUFFERS,
        "hf_manifest": WITH_BIAS,
        "expect": [
            (
                "SS086",
                12,
                "drop 'model.norm.bias' discards HF key 'model.norm.bias', which holds the "
                "model's buffer 'norm.bias': no map line fills it (a `keep` leaves it as it "
                "is), so load_hf leaves it as it is and export_hf omits the key",
                "model.norm.bias",
                "map it, `model.norm.bias -> norm.bias`, and delete the drop",
            )
        ],
    },
    {
        "name": "a buffer of the key's own name, dropped only",
        "spec": HEAD + block("model.norm.bias -> norm.bias", "drop rope.*"),
        "manifest": MANIFEST,
        "buffers": BUFFERS,
        "hf_manifest": WITH_BIAS,
        "expect": [
            (
                "SS086",
                12,
                "drop 'rope.*' discards HF key 'rope.cache', which holds the model's "
                "buffer 'rope.cache'",
                "rope.*",
            ),
            ("SS071", "m.json:8", "storage unit 'rope.cache' [4] is produced by no hf map line"),
        ],
    },
    {
        "name": "a parameter a map line would read, kept and its key dropped",
        "spec": HEAD + block("drop model.norm.*", "keep norm.weight"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            ("SS086", 11, "which holds the model's parameter 'norm.weight'", "model.norm.*"),
            ("SS078", 7, "map line model.norm.weight -> norm.weight produces no storage unit"),
        ],
    },
    {
        "name": "the buffers mapped",
        "spec": HEAD + block("model.norm.bias -> norm.bias", "rope.cache -> rope.cache"),
        "manifest": MANIFEST,
        "buffers": BUFFERS,
        "hf_manifest": WITH_BIAS,
        "expect": [],
    },
    {
        "name": "a dropped duplicate of a key a line reads, an ignored buffer, no such state",
        "spec": HEAD.replace("param norm", "ignore rope.*\nparam norm")
        + block("model.norm.bias -> norm.bias", "drop norm.weight", "drop rope.*", "drop x.*"),
        "manifest": MANIFEST,
        "buffers": BUFFERS,
        "hf_manifest": {
            **WITH_BIAS,
            "tensors": {**WITH_BIAS["tensors"], "norm.weight": [8], "x.inv_freq": [4]},
        },
        "expect": [],
    },
]
