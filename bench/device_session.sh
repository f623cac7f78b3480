#!/usr/bin/env bash
# One GPU session on an offline CUDA machine, prepared to run once within a few minutes
# (docs/gpu.md, "One device session"): the wheels of bench/device_kit.sh plus the project's own
# wheel, DeepSpeed's, a slimmed Ray (bench/device_kit.sh --ray) installed into /tmp/site; then,
# each under its own time limit and each writing its log to $OUT whatever the others do:
#   1. the machine: nvidia-smi, Python, torch, CUDA, NCCL;
#   2. NCCL with two processes on one GPU (what fractional Ray GPU shares give the weight sync);
#   3. a short Ray job per weight sync (tiny random Show-o, a rollout actor and a learner rank
#      sharing the GPU with fractional num_gpus): `auto` (the collective) and `object_store`;
#   4. the `gpu` tests;
#   5. bench/bench_gpu.py at 256 and 512 px (its JSON to $OUT/bench_gpu.json; its sections in
#      bench/gpu_rollout.py, gpu_learner.py, gpu_weight_sync.py, gpu_common.py);
#   6. bench/bench_reward_gpu.py: the reward models at full size (CLIP ViT-H-14 and ViT-L-14,
#      Mask2Former Swin-S), its JSON to $OUT/bench_reward_gpu.json;
#   7. bench/bench_gpu_shrinkage.py: trajectory shrinkage s = 1, 2, 4 on the learner at 512 px,
#      its JSON to $OUT/bench_gpu_shrinkage.json.
#
#   SECTIONS=env,nccl,ray,tests,bench,reward,shrinkage bash bench/device_session.sh \
#       [BENCH_TIMEOUT_S (default 300)] [BUDGET_SCALE (default 0.55)]
# SECTIONS (default: all of them) picks the steps; the install always runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/device_out}"
mkdir -p "$OUT"
bench_timeout="${1:-300}"
budget_scale="${2:-0.55}"
sections=",${SECTIONS:-env,nccl,ray,tests,bench,reward,shrinkage},"
want() { [[ $sections == *",$1,"* ]]; }
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0)) s] $*"; }

say "installing the wheels into /tmp/site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
tar -C /tmp/site -xJf .whl/ray_slim.tar.xz || exit 1
mkdir -p /tmp/site/ray/dashboard/client/build/static  # the slimmed Ray has no dashboard front end
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
export MASKGRPO_CACHE_DIR=/tmp/maskgrpo-cache

want env && say "1. the machine"
want env && {
    nvidia-smi
    python3 - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", ".".join(map(str, torch.cuda.nccl.version())), "cudnn", torch.backends.cudnn.version())
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))
import ray, deepspeed, pydantic, open_clip, transformers
print("ray", ray.__version__, "deepspeed", deepspeed.__version__, "pydantic", pydantic.__version__,
      "open_clip", open_clip.__version__, "transformers", transformers.__version__)
EOF
} >"$OUT/env.txt" 2>&1
want env && tail -4 "$OUT/env.txt"

if want nccl; then
    say "2. NCCL, two processes on one GPU"
    timeout 60 python3 -m bench.nccl_same_gpu >"$OUT/nccl_same_gpu.txt" 2>&1
    echo "rc $?" >>"$OUT/nccl_same_gpu.txt"
    tail -3 "$OUT/nccl_same_gpu.txt"
fi

want ray && say "3. Ray jobs on the GPU (tiny random Show-o, fractional GPU shares)"
# from the repository root: the checkout's maskgrpo_ray/ is a whole package (its actors and
# learner reach the top-level folders), so the workers run the checkout's code
for sync in auto object_store; do
    want ray || break
    (timeout 100 python3 -m maskgrpo_ray.cli train \
        --config configs/showo_tiny_random.yaml \
        --run-dir "/tmp/ray_$sync" \
        --set rollout.num_gpus_per_actor=0.4 --set learner.num_gpus_per_worker=0.4 \
        --set learner.weight_sync=$sync --set train.steps=3 \
        --set logging.progress_bar=false) >"$OUT/ray_job_$sync.log" 2>&1
    echo "rc $?" >>"$OUT/ray_job_$sync.log"
    cp "/tmp/ray_$sync/metrics.jsonl" "$OUT/ray_job_${sync}_metrics.jsonl" 2>/dev/null
    tail -2 "$OUT/ray_job_$sync.log"
done

if want tests; then
    say "4. the gpu tests"
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=200 \
        tests/test_gpu.py tests/test_bench_gpu.py tests/test_rewards_clip.py \
        >"$OUT/gpu_tests.log" 2>&1
    echo "rc $?" >>"$OUT/gpu_tests.log"
    tail -3 "$OUT/gpu_tests.log"
fi
if want bench; then
    say "5. bench/bench_gpu.py (timeout ${bench_timeout} s, budget scale ${budget_scale})"
    timeout "$bench_timeout" python3 -m bench.bench_gpu --budget-scale "$budget_scale" \
        --out "$OUT/bench_gpu.json" >"$OUT/bench_gpu.log" 2>&1
    echo "rc $?" >>"$OUT/bench_gpu.log"
    tail -30 "$OUT/bench_gpu.log"
fi
if want reward; then
    say "6. bench/bench_reward_gpu.py"
    timeout 200 python3 -m bench.bench_reward_gpu --out "$OUT/bench_reward_gpu.json" \
        >"$OUT/bench_reward_gpu.log" 2>&1
    echo "rc $?" >>"$OUT/bench_reward_gpu.log"
    tail -30 "$OUT/bench_reward_gpu.log"
fi
if want shrinkage; then
    say "7. bench/bench_gpu_shrinkage.py"
    timeout 200 python3 -m bench.bench_gpu_shrinkage --out "$OUT/bench_gpu_shrinkage.json" \
        >"$OUT/bench_gpu_shrinkage.log" 2>&1
    echo "rc $?" >>"$OUT/bench_gpu_shrinkage.log"
    tail -12 "$OUT/bench_gpu_shrinkage.log"
fi
say "done"
