#!/usr/bin/env bash
# ppo.py on one GPU in bf16, no network: a random-initialised Llama-3.2-1B-shaped model (128k vocabulary), full /
# full + checkpointing / LoRA + shared backbones + checkpointing: s/update, tokens/s, phase times, MFU, peak memory
# against the planner, KL at update 0 and the ratio at learning rate 0 (issues 13, 31). At most 8 minutes for
# the benchmark (GPU_BENCH_BUDGET_S for the runs, plus start-up), the wheel install before it.
#
# Run from the repository root:
#   bash benchmarks/gpu.sh                         # GPU: size 1b, 3 modes -> $OUT (or benchmarks/results/gpu)
#   GPU_BENCH_SIZES=tiny bash benchmarks/gpu.sh    # CPU smoke test (tests/ci_test.py runs it, smaller still)
# Environment (all optional):
#   GPU_BENCH_SIZES      comma-separated sizes of gpu_bench.py (tiny, smollm2, 1b); default 1b
#   GPU_BENCH_BUDGET_S   seconds for all sizes together (a size still running then is stopped); default 420
#   GPU_BENCH_PRECISION  bf16 (default) or fp32
#   GPU_BENCH_ARGS       more gpu_bench.py flags, e.g. "--rollouts 128 --updates 4"
#   WHEELS               folder of wheels from benchmarks/fetch_wheels.sh; default .whl
#   OUT                  where the JSON, markdown table and logs go (the device tool's $OUT); default
#                        benchmarks/results/gpu
# The GPU machine lacks tyro and datasets (ppo.py imports both): when either is missing, every wheel in $WHEELS
# (fetch_wheels.sh: those two, their requirements, the pinned transformers and peft) is installed into /tmp/site,
# first on the path (pip --no-index --no-deps: nothing is fetched, nothing already there is touched).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
wheels="${WHEELS:-.whl}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! python3 -c "import tyro, datasets" 2>/dev/null; then
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "gpu.sh: tyro or datasets is missing and there are no wheels in $wheels; run benchmarks/fetch_wheels.sh" \
         "on a machine with network and carry the folder" >&2
    exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$wheels"/*.whl || exit 2
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c "import tyro, datasets; print('gpu.sh: tyro', tyro.__version__, 'and datasets', datasets.__version__, \
'from $wheels')" || exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null \
  || echo "gpu.sh: nvidia-smi not found / no GPU: the benchmark runs on the CPU"
# 480 s = 8 minutes hard stop for gpu_bench.py (not the install above); the driver stops sizes at GPU_BENCH_BUDGET_S.
# shellcheck disable=SC2086
timeout 480 python3 benchmarks/gpu_bench.py --out_dir "$out" --sizes "${GPU_BENCH_SIZES:-1b}" \
  --budget_s "${GPU_BENCH_BUDGET_S:-420}" --precision "${GPU_BENCH_PRECISION:-bf16}" ${GPU_BENCH_ARGS:-}
