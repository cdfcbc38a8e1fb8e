#!/usr/bin/env bash
# The wheels that bench/gpu_check.py needs on the lent GPU machine and that its image lacks
# (/work/.library/device/KINDS.md: Python 3.12, torch 2.11, transformers 5.17, jinja2, no
# lark, no pydantic), downloaded into .whl/ (ignored by git) for the device tool's `carry`.
#
#     bash bench/gpu_wheels.sh          # here, once: about 15 MB into .whl/
#
# Then, on the device machine (the tool's run, with carry [".whl"]):
#
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \
#     python3 -m bench.gpu_check --out $OUT
#
# * lark, pydantic (+ pydantic-core, annotated-types, typing-inspection, typing-extensions
#   >= 4.16 that pydantic-core needs): the compiler, which the ep_sp phase (it compiles
#   tests/ep_sp_specs.py's specs) and the transfer phase (shardspec.transfer.plan_transfer)
#   run there. The versions are this project's venv's.
# * transformers 5.24.0 (pure Python): the version the CPU suite compares with (the image
#   has 5.17); its needs (huggingface-hub >= 1.31, tokenizers 0.23, safetensors 0.8, regex,
#   typer) are in the image at versions that satisfy it.
# --no-deps: each is named; one version of each (two stop the install).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl \
    lark==1.3.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 transformers==5.24.0
ls -la .whl
du -sh .whl
