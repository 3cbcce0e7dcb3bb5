#!/bin/bash
# veRL weak scaling on 2 GPUs (Qwen3-1.7B shape, full fine-tuning): one call on a
# 2-GPU machine. Runs, each in a fresh process: veRL with its fused log-prob kernels on 1 and 2
# GPUs (64 samples × (512+256) tokens per GPU, micro-batch 8), veRL's plain per-token log-prob path
# on 1 GPU, the local backend on 1 GPU at the same per-GPU batch (the reference).
# Writes to $OUT: results.json, results.md (the tables), runs.log (every run's output), console.log.
# Knobs (environment): VERL (default "--verl fused=1,2 --verl plain=1"; e.g. "--verl plain=1,2" if
# the fused kernels fail on the image), PER_GPU (64), MB (8), STEPS (3 timed, after 1 warm-up),
# BUDGET (start no run after this many seconds, 300), RUN_TIMEOUT (per run, 160).
#
# Layout (see benchmarks/trainer/README.md, section 3): this script and `git archive` of the
# code as repo/ in one folder D; the staged site (verl 0.9.1, ray 2.60, sqlalchemy, fastapi,
# pydantic, cachetools ...) in /tmp/site and the SmolLM2 tokenizer in /tmp/smollm2 (only its
# tokenizer files are used; the model is random).
set -o pipefail
D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-/tmp/verlscale-out}
mkdir -p "$OUT"
ts() { date -u +%H:%M:%S; }
fail() { echo "[$(ts)] verlscale: FAILED: $*" >&2; [ -f /tmp/vscale/runs.log ] && tail -n 80 /tmp/vscale/runs.log >&2
         cp /tmp/vscale/runs.log /tmp/vscale/results.* "$OUT"/ 2>/dev/null; exit 1; }
echo "[$(ts)] verlscale: start in $PWD, bundle $D"
if ! python3 -c "import verl, ray, sqlalchemy" 2>/dev/null; then
    for a in .dev-stage/stage/c5/assemble.sh "$D"/../.dev-stage/stage/c5/assemble.sh; do
        [ -f "$a" ] && { echo "[$(ts)] sourcing $a"; source "$a"; break; }
    done
fi
# the bundle's ray-slim loses the exec bit of Ray's binaries (gcs_server, raylet)
[ -d /tmp/site/ray/core/src ] && chmod -R a+x /tmp/site/ray/core/src
export PYTHONPATH=$D/repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
python3 -c "import verl, ray, sqlalchemy, hydra, tensordict, cachetools, fastapi, torch, transformers as t; \
print('verl', verl.__version__, 'ray', ray.__version__, 'torch', torch.__version__, 'transformers', t.__version__)" \
    || fail "the staged packages do not import (source the staging assemble.sh first)"
[ -f /tmp/smollm2/tokenizer.json ] || fail "no /tmp/smollm2/tokenizer.json (assemble.sh converts the model there)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || fail "needs 2 GPUs"
rm -rf /tmp/vscale
python3 "$D/repo/benchmarks/trainer/verl_gpu.py" all --out /tmp/vscale --models qwen3-1.5b --scaling weak \
    --per-gpu-batch "${PER_GPU:-64}" --micro-batch-size "${MB:-8}" ${VERL:---verl fused=1,2 --verl plain=1} \
    --steps "${STEPS:-3}" --warmup 1 --no-push --tokenizer-dir /tmp/smollm2 \
    --budget-s "${BUDGET:-300}" --run-timeout "${RUN_TIMEOUT:-160}" --prepare-timeout 150 2>&1 | tee "$OUT/console.log"
rc=$?
cp /tmp/vscale/runs.log /tmp/vscale/results.json /tmp/vscale/results.md "$OUT"/ 2>/dev/null
[ $rc -eq 0 ] || fail "verl_gpu.py all exited $rc"
[ -f /tmp/vscale/results.md ] || fail "no results"
grep -q "| verl | full, [a-z-]* | 2 |" /tmp/vscale/results.md || fail "the 2-GPU veRL run did not finish"
echo "[$(ts)] verlscale: done"
