#!/usr/bin/env bash
# The wheels benchmarks/gpu.py needs on a GPU machine without internet, into .whl/ (git-ignored; docs/gpu.md):
#   transformers 5.25 and what it needs, for Python 3.12 (the lent H200 ships 5.17, too old for stree);
#   the kernels stree is measured against: fla-core (pure Python) and mamba-ssm built without its CUDA extensions
#   (MAMBA_SKIP_CUDA_BUILD: its Triton ops are pure Python; benchmarks/anchors.py stands in for the extension).
# Run it from an environment with torch installed (mamba-ssm's build imports torch), e.g. the project's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .whl transformers==5.25.0
python -m pip download -q --no-deps -d .whl fla-core==0.6.0
rm -f .whl/numpy-*                                   # keep the GPU machine's own numpy
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
    python -m pip wheel -q --no-deps --no-build-isolation --no-binary :all: -w .whl mamba-ssm==2.3.2.post1
ls -l .whl
du -sh .whl
