#!/usr/bin/env bash
# The LoRA-under-load runs on the GPU machine (after the staged vLLM is unpacked, from the project
# root; results to $RESULTS, else $OUT, else benchmarks/gpu/results). Each phase starts its own vLLM
# (benchmarks/gpu/lora_churn.py) and stops it:
#
#   benchmarks/gpu/lora_churn.sh before   # vLLM 0.26's LoRA defaults, CUDA_LAUNCH_BLOCKING=1: the reproducer
#   benchmarks/gpu/lora_churn.sh after    # the same load, LoRA kept off lm_head (--lora-target-modules)
#   benchmarks/gpu/lora_churn.sh probe    # before, with lora_probe/ in vLLM: names the LoRA call that faults
#   benchmarks/gpu/lora_churn.sh churn-only  # before's load without prompt_logprobs
#   benchmarks/gpu/lora_churn.sh no-churn    # before's load with 4 adapters loaded once (= --max-loras): no
#                                         # load, no slot reuse while the load runs
#   benchmarks/gpu/lora_churn.sh soak     # 200 streams, an adapter loaded every 10 s, 8 more in rotation,
#                                         # teacher-shaped prompt_logprobs beside them (SOAK_S seconds)
#
# Phases run one after another in the order given (e.g. `lora_churn.sh before after soak`); each has
# its own port and adapter folder, so phases can also run at once in separate calls (GPU_MEM=0.25
# each: SmolLM2 needs little KV cache).
set -uo pipefail
out=${RESULTS:-${OUT:-benchmarks/gpu/results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
model=${MODEL_DIR:-/tmp/smollm2}
base="--enable-lora --max-lora-rank 16 --max-loras 4 --max-cpu-loras 16 --max-model-len 4096 --gpu-memory-utilization ${GPU_MEM:-0.5} --enforce-eager"
# the fix: no LoRA wrapper on lm_head (nor embed_tokens), so prompt_logprobs never run vLLM 0.26's
# per-request LoRA logits mapping over per-token rows (docs/why-lora-target-modules.md)
targets="--lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj"
repro="--streams 128 --adapters 12 --live 8 --load-every 1 --prompt-logprobs 4 --duration ${REPRO_S:-240}"
rc=0
for phase in "$@"; do
  echo "[lora_churn $(date -u +%H:%M:%S)] $phase"
  run() { python3 benchmarks/gpu/lora_churn.py --model-dir $model --out "$out" --tag $phase \
            --adapter-dir /tmp/lora-churn-adapters-$phase "$@"; }
  case $phase in
    before) CUDA_LAUNCH_BLOCKING=1 run --port 8511 --vllm-args "$base" $repro ;;
    after)  CUDA_LAUNCH_BLOCKING=1 run --port 8512 --vllm-args "$base $targets" $repro ;;
    churn-only) CUDA_LAUNCH_BLOCKING=1 run --port 8513 --vllm-args "$base" ${repro/--prompt-logprobs 4/--prompt-logprobs 0} ;;
    probe)  CUDA_LAUNCH_BLOCKING=1 run --port 8516 --probe --vllm-args "$base" $repro ;;
    no-churn) CUDA_LAUNCH_BLOCKING=1 run --port 8515 --vllm-args "$base" --streams 128 --adapters 4 --live 4 --load-every 0 \
              --prompt-logprobs 4 --duration ${REPRO_S:-240} ;;
    soak)   run --port 8514 --vllm-args "$base $targets" --streams 200 --adapters 12 --live 9 --load-every 10 \
              --prompt-logprobs 4 --duration ${SOAK_S:-900} ;;
    *) echo "unknown phase $phase (before|after|probe|churn-only|no-churn|soak)"; rc=2 ;;
  esac
  rc=$(( rc || $? ))
done
exit $rc
