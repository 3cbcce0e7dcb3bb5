#!/bin/bash
# The local backend's step speed on one GPU (bench.py), one set of runs per call:
#
#   local-speed.sh ab       two checkouts side by side, $D/before and $D/after (each a `git archive`
#                           of the code to compare): Qwen3-1.7B and SmolLM2 shapes (random weights),
#                           compile, micro-batch 8, fp32 master weights, CUDA graphs
#   local-speed.sh memory   $D/after only, the memory-saving settings: Qwen3-1.7B shape with
#                           activation budget 0.5 and with micro-batch 4; SmolLM2 at batch 8
#
# $D (default .dev-trainer) also holds the GPU image's missing wheels as gpu/*.whl and
# gpu/ray-slim.tar.xz (installed into /tmp/site once per machine), and SmolLM2's tokenizer and
# config.json as tok/. Writes $OUT/gpu-SET.log and $OUT/results-SET.tgz (a JSON and a profile per
# line). benchmarks/trainer/README.md has the results.
set -o pipefail
set=${1:?usage: local-speed.sh ab|memory}
D=${D:-.dev-trainer}; T=/tmp/site; R=/tmp/res-$set; L=$OUT/gpu-$set.log
rm -rf $R; mkdir -p $T $R/prof
[ -d $T/verl ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target $T $D/gpu/*.whl \
    && tar xJf $D/gpu/ray-slim.tar.xz -C $T; } || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $L
PYTHONPATH=$T python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)" | tee -a $L
F='Loading weights\|Writing model\|USDT\|_warn_once\|acc_events\|UserWarning\|warnings.warn'
run() {  # name, code dir, timeout, bench args...
  n=$1; c=$2; t=$3; shift 3
  echo "### $n ($c): $*" | tee -a $L
  s=$(date +%s)
  PYTHONPATH=$T:$D/$c timeout $t python3 $D/$c/benchmarks/trainer/bench.py --tokenizer-dir $D/tok "$@" \
    --profile $R/prof/$n --json $R/$n.json 2>&1 | grep -v "$F" | tee -a $L
  echo "### $n wall $(( $(date +%s) - s )) s" | tee -a $L
  tar czf $OUT/results-$set.tgz -C $R .
}
Q="--random-config qwen3-1.5b --keep-dir /tmp/m-qwen3 --batch-size 8 --prompt-len 512 --response-len 256 --steps 4 --warmup 2"
S="--random-config smollm2 --keep-dir /tmp/m-smol --prompt-len 512 --response-len 256 --steps 5 --warmup 3"
case $set in
  ab)
    run q-after-mb8 after 170 $Q --paths compile --micro-batch-size 8
    run q-after-mb8-fp32m after 80 $Q --paths compile --micro-batch-size 8 --modes full --fp32-master
    run q-before-mb8 before 130 $Q --paths compile --micro-batch-size 8
    run s-after-b8 after 80 $S --batch-size 8 --paths compile-cg --micro-batch-size 8
    run s-after-b16 after 80 $S --batch-size 16 --paths compile-cg --micro-batch-size 16
    run s-before-b8 before 80 $S --batch-size 8 --paths compile-cg --micro-batch-size 8
    run q-after-mb4 after 130 $Q --paths compile --micro-batch-size 4 ;;
  memory)
    run q-after-mb8-amb05 after 120 $Q --paths compile --micro-batch-size 8 --activation-memory-budget 0.5
    run s-after-b8 after 110 $S --batch-size 8 --paths compile-cg --micro-batch-size 8
    run q-after-mb4 after 100 $Q --paths compile --micro-batch-size 4 ;;
  *) echo "usage: local-speed.sh ab|memory" >&2; exit 2 ;;
esac
echo "### done" | tee -a $L
