#!/usr/bin/env bash
# The Python packages a bare GPU machine (CUDA image with PyTorch, no package index) lacks for
# bench/gpu_check.py, as wheels in .whl/ (ignored by git): carried with the check (docs/gpu.md).
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]    # the GPU machine's Python, default 3.12
# There: pip install --no-index --no-deps --target "$SITE" .whl/*.whl; PYTHONPATH="$SITE"
# (SITE: any writable folder outside the repository; docs/gpu.md has the whole command)
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
# pydantic and the rest of the config stack (the core's configs), the serving extras the tests
# import; the image has torch, numpy, numba, safetensors, sentencepiece, h5py, tqdm, pyyaml
PKGS=(
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 cachetools==8.0.2
  fastapi==0.165.0 starlette==1.10.0 anyio==4.16.0 sniffio==1.3.1 idna==3.20 orjson==3.13.0
  redis==8.1.0
)
mkdir -p .whl
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
  --platform any -d .whl "${PKGS[@]}"
du -sh .whl
