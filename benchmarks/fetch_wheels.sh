#!/usr/bin/env bash
# Download the Python packages that benchmarks/gpu.sh needs and the GPU machine lacks, as wheels, into a folder
# (default .whl in the repository root), for a machine with no network (issue 13).
#
# The GPU machine (see the device README: Python 3.12, x86-64, torch/transformers/accelerate/peft/tensorboard, no
# registry) has neither tyro nor datasets, which ppo.py imports at the top, and other versions of transformers and
# peft than requirements.txt pins (5.17.0 there in 2026-11). This fetches tyro and datasets, their requirements that
# are missing there (dill, multiprocess, docstring-parser, typeguard), and the pinned transformers and peft, built for
# CPython 3.12 on manylinux x86-64 (all pure Python except multiprocess's py312 build). --no-deps: pip resolves
# nothing, so the machine's own torch, numpy, tokenizers, pyarrow, ... stay as they are.
#
# Usage (here, where pip reaches PyPI; the default folder .whl/ is git-ignored (.gitignore), never committed):
#   bash benchmarks/fetch_wheels.sh [FOLDER]        # ~15 MB
# gpu.sh then installs FOLDER/*.whl into /tmp/site when tyro or datasets is missing.
set -euo pipefail
dest="${1:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)/.whl}"
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" \
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.24.0 peft==0.21.2
ls -l "$dest"
