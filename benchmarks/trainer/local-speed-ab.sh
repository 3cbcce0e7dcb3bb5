#!/bin/bash
# The local backend's step speed on one GPU, two checkouts side by side: bench.py from $D/before
# and from $D/after (each a `git archive` of the code to compare) on the same machine, Qwen3-1.7B
# shape and SmolLM2 shape (random weights), with compile, micro-batch 8, fp32 master weights and
# CUDA graphs. $D (default .dev-trainer) also holds the GPU image's missing wheels as gpu/*.whl +
# gpu/ray-slim.tar.xz and SmolLM2's tokenizer and config.json as tok/. Writes $OUT/gpu.log and
# $OUT/results.tgz (one JSON and one profile per line). benchmarks/trainer/README.md has the results.
set -o pipefail
D=${D:-.dev-trainer}; T=/tmp/site; R=/tmp/res
rm -rf $T $R; mkdir -p $T $R/prof
python3 -m pip install -q --no-index --no-deps --no-compile --target $T $D/gpu/*.whl && tar xJf $D/gpu/ray-slim.tar.xz -C $T || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.log
python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)" | tee -a $OUT/gpu.log
F='Loading weights\|Writing model\|USDT\|_warn_once\|acc_events\|UserWarning\|warnings.warn'
run() {  # name, code dir, timeout, bench args...
  n=$1; c=$2; t=$3; shift 3
  echo "### $n ($c): $*" | tee -a $OUT/gpu.log
  s=$(date +%s)
  PYTHONPATH=$T:$D/$c timeout $t python3 $D/$c/benchmarks/trainer/bench.py --tokenizer-dir $D/tok "$@" \
    --profile $R/prof/$n --json $R/$n.json 2>&1 | grep -v "$F" | tee -a $OUT/gpu.log
  echo "### $n wall $(( $(date +%s) - s )) s" | tee -a $OUT/gpu.log
  tar czf $OUT/results.tgz -C $R .
}
Q="--random-config qwen3-1.5b --keep-dir /tmp/m-qwen3 --batch-size 8 --prompt-len 512 --response-len 256 --steps 4 --warmup 2"
S="--random-config smollm2 --keep-dir /tmp/m-smol --prompt-len 512 --response-len 256 --steps 5 --warmup 3"
run q-after-mb8 after 170 $Q --paths compile --micro-batch-size 8
run q-after-mb8-fp32m after 80 $Q --paths compile --micro-batch-size 8 --modes full --fp32-master
run q-before-mb8 before 130 $Q --paths compile --micro-batch-size 8
run s-after-b8 after 80 $S --batch-size 8 --paths compile-cg --micro-batch-size 8
run s-after-b16 after 80 $S --batch-size 16 --paths compile-cg --micro-batch-size 16
run s-before-b8 before 80 $S --batch-size 8 --paths compile-cg --micro-batch-size 8
run q-after-mb4 after 130 $Q --paths compile --micro-batch-size 4
echo "### done" | tee -a $OUT/gpu.log
