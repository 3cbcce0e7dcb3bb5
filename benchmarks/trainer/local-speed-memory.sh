#!/bin/bash
# The local backend's speed under its memory-saving settings on one GPU: Qwen3-1.7B shape with
# activation budget 0.5 and with micro-batch 4, SmolLM2 shape at batch 8 with CUDA graphs, from
# $D/after only (layout as in local-speed-ab.sh; reuses its /tmp/site on a warm machine). Writes
# $OUT/gpu2.log and $OUT/results2.tgz. benchmarks/trainer/README.md has the results.
set -o pipefail
D=${D:-.dev-trainer}; T=/tmp/site; R=/tmp/res2
rm -rf $R; mkdir -p $T $R/prof
[ -d $T/verl ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target $T $D/gpu/*.whl && tar xJf $D/gpu/ray-slim.tar.xz -C $T || exit 1; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu2.log
F='Loading weights\|Writing model\|USDT\|_warn_once\|acc_events\|UserWarning\|warnings.warn'
run() {
  n=$1; c=$2; t=$3; shift 3
  echo "### $n ($c): $*" | tee -a $OUT/gpu2.log
  s=$(date +%s)
  PYTHONPATH=$T:$D/$c timeout $t python3 $D/$c/benchmarks/trainer/bench.py --tokenizer-dir $D/tok "$@" \
    --profile $R/prof/$n --json $R/$n.json 2>&1 | grep -v "$F" | tee -a $OUT/gpu2.log
  echo "### $n wall $(( $(date +%s) - s )) s" | tee -a $OUT/gpu2.log
  tar czf $OUT/results2.tgz -C $R .
}
Q="--random-config qwen3-1.5b --keep-dir /tmp/m-qwen3 --batch-size 8 --prompt-len 512 --response-len 256 --steps 4 --warmup 2"
S="--random-config smollm2 --keep-dir /tmp/m-smol --prompt-len 512 --response-len 256 --steps 5 --warmup 3"
run q-after-mb8-amb05 after 120 $Q --paths compile --micro-batch-size 8 --activation-memory-budget 0.5
run s-after-b8 after 110 $S --batch-size 8 --paths compile-cg --micro-batch-size 8
run q-after-mb4 after 100 $Q --paths compile --micro-batch-size 4
echo "### done" | tee -a $OUT/gpu2.log
