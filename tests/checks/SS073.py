"""SS073 hf-unexpected-key: an HF tensor that nothing consumes, drops or ties."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST, TENSORS

STRAYS = [f"model.s{c}.weight" for c in "abcdefghijklmnopqrstuvwxyz"] + [
    f"model.sz{c}.weight" for c in "abcd"
]
MANY = {**TENSORS, **{f"model.layers.{i}.extra.weight": [8] for i in range(500)}}
MANY |= {k: [8] for k in STRAYS}
KEYS = sorted(MANY)
SHOWN, REST = sorted(STRAYS)[:19], sorted(STRAYS)[19:]


def line(key: str) -> str:
    """Where ``key`` is in hf.json (tensors from line 4, sorted)."""
    return f"hf.json:{KEYS.index(key) + 4}"


CASES = [
    {
        "name": "a bias the model does not have",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "tensors": {**TENSORS, "model.norm.bias": [8]}},
        "expect": [
            (
                "SS073",
                "hf.json:10",
                "unexpected HF key 'model.norm.bias': no map line consumes it",
                '"model.norm.bias"',
                "`drop` it",
            )
        ],
    },
    {
        "name": "an expert index outside the stacked dimension",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "tensors": {**TENSORS, "model.layers.0.experts.2.w1": [4, 8]}},
        "expect": [("SS073", "hf.json:6", "unexpected HF key 'model.layers.0.experts.2.w1'")],
    },
    {
        "name": "thousands of keys are summed up",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "tensors": MANY},
        "expect": [
            (
                "SS073",
                line("model.layers.0.extra.weight"),
                "'model.layers.0.extra.weight' (and 499 more like it)",
            ),
            *[("SS073", line(k), f"unexpected HF key {k!r}: no map line") for k in SHOWN],
            ("SS073", line(REST[0]), f"11 more unexpected HF keys, such as {REST[0]!r}"),
        ],
    },
    {
        "name": "dropped and tied keys are expected",
        "spec": HEAD
        + GOOD.replace(
            "}\n", "    drop model.*.bias\n    drop **.extra.*\n    tie lm_head.weight = x\n}\n"
        ),
        "manifest": MANIFEST,
        "hf_manifest": {
            **HF,
            "tensors": {
                **TENSORS,
                "model.norm.bias": [8],
                "model.layers.3.extra.w": [1],
                "lm_head.weight": [8],
            },
        },
        "expect": [],
    },
]
