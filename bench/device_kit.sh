#!/usr/bin/env bash
# Wheels for an offline GPU machine that has its own Python, PyTorch, transformers, safetensors,
# PyYAML, pytest and pillow but not the rest of our stack (docs/gpu.md, "On an offline GPU
# machine"). Run it where PyPI is reachable; it fills a folder with what `bench/bench_gpu.py
# --no-ray` and the `gpu` tests need beyond that machine's packages: pydantic (the config tree)
# with its compiled core, and open_clip with ftfy (the CLIP reward's gpu test).
#
#   bash bench/device_kit.sh [PYTHON_VERSION (default 3.12)] [FOLDER (default .whl)]
#
# Ray (79 MB as a wheel) and DeepSpeed are left out: the bench's weight_sync section and the
# Ray and DeepSpeed tests need a full `make` environment (requirements.txt) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-3.12}"
out="${2:-.whl}"
mkdir -p "$out"
pin() {  # the version requirements.txt pins for package $1
    grep -E "^$1==" requirements.txt | cut -d= -f3
}
get() {
    python3 -m pip download -q --no-deps --only-binary=:all: \
        --python-version "$py" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$out" "$@"
}
get "pydantic==$(pin pydantic)"
core=$(unzip -p "$out"/pydantic-"$(pin pydantic)"-*.whl '*/METADATA' |
    sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
get "pydantic-core==$core" annotated-types typing-inspection \
    "open_clip_torch==$(pin open_clip_torch)" ftfy wcwidth
ls -l "$out"
du -sh "$out"
