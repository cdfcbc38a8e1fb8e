"""SS105 pipeline-view: the pipeline axis is not an axis of every view."""

MANIFEST = {"layers.0.w": [8, 8], "layers.1.w": [8, 8]}


def spec(expert: str) -> str:
    return (
        'manifest "m.json"\nmesh dense over 8 ranks { pp: 2  fsdp: *  tp: 2 }\n'
        f"mesh expert {{ {expert} }}\nfsdp fsdp\nfsdp efsdp\n"
        "param layers.*.w [out, in] {}\npipeline pp {\n    split layers.{layer}\n}\n"
    )


CASES = [
    {
        "name": "a view without the pipeline axis",
        "spec": spec("efsdp: *  ep: 2"),
        "manifest": MANIFEST,
        "expect": [
            (
                "SS105",
                7,
                "pipeline axis 'pp' is not an axis of view 'expert'",
                "pp",
                "declare pp first in every view",
            )
        ],
    },
    {
        "name": "a pipeline axis every view shares",
        "spec": spec("pp: 2  efsdp: *  ep: 2"),
        "manifest": MANIFEST,
        "expect": [],
    },
]
