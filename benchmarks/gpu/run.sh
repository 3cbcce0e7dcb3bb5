#!/usr/bin/env bash
# The whole loop on one GPU: vLLM (GPU build, policy with LoRA; also the teacher), gateways on
# a SQLite pool, scoring (python judge, teacher logprobs) and the online trainer (LocalTrainer on
# cuda), then the publish-under-load check and/or the learning benchmark.
#
#   benchmarks/gpu/run.sh publish|learn|all|up [bench.py args...]     (up: only start vLLM)
#   benchmarks/gpu/run.sh chaos [chaos.py args...]     (kill -9 of a supervised vLLM under load: benchmarks/chaos.py)
#   benchmarks/gpu/run.sh agents [benchmarks/agents/run.py args...]   (general agents learn from the pool:
#       --preset gpu on this vLLM as policy and teacher; 128 environments per job)
#       (learn on a lease that may end first: pass --deadline-min N, so that the jobs still running at
#       N minutes are stopped and reported up to their last checkpoint)
#   benchmarks/gpu/run.sh shape2 [shape2.py args...]   (2 GPUs: vLLM on GPU 0 in dev mode, the
#                                                      veRL trainer on GPU 1; benchmarks/gpu/shape2.py)
#
# Runs on the GPU machine from the project root, once vLLM 0.26, the project's runtime wheels
# (benchmarks/gpu/wheels.sh) and the converted model in /tmp/smollm2 are in place
# (benchmarks/gpu/results/README.md, "Running it"). Results go to $OUT (the device tool's
# folder that comes back), else benchmarks/gpu/results. vLLM is started once per machine and
# left running (`/tmp/gpuloop-vllm-PORT.pid`), so later calls on the same warm machine reuse it.
set -uo pipefail
what=${1:-all}; shift || true
out=${RESULTS:-${OUT:-benchmarks/gpu/results}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 LITELLM_LOCAL_MODEL_COST_MAP=True
export NEXTSTATE_CACHE_DIR=/tmp/ns-cache NEXTSTATE_DATA_DIR=/tmp/ns-data
# PORT: a second vLLM beside the first (e.g. PORT=8601 CUDA_VISIBLE_DEVICES=1 for the learning
# benchmark on GPU 1 while shape2 reloads full weights into the one on GPU 0)
port=${PORT:-8501}; url=http://127.0.0.1:$port/v1; model=/tmp/smollm2; pidf=/tmp/gpuloop-vllm-$port.pid; vlog=/tmp/vllm-$port.log
log() { echo "[gpu $(date -u +%H:%M:%S)] $*"; }

up() { python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$url/models" >/dev/null 2>&1; }
# shape2: vLLM on its own GPU, with the development endpoints (full weights are reloaded in place)
vllm_env=()
if [ "$what" = shape2 ]; then
  vllm_env=(CUDA_VISIBLE_DEVICES=${VLLM_GPU:-0} VLLM_SERVER_DEV_MODE=1)
  dev() { python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "http://127.0.0.1:$port/is_paused" >/dev/null 2>&1; }
  if up && ! dev; then
    log "vLLM on $url has no dev mode: restarting it"
    kill -- -"$(cat $pidf)" 2>/dev/null
    for _ in $(seq 60); do up || break; sleep 1; done; sleep 3
  fi
fi
if [ "$what" = chaos ]; then
  # its own vLLM (nextstate's supervisor restarts it) on a free port, beside any shared one
  log "chaos $*"
  python3 benchmarks/chaos.py --vllm-python "$(command -v python3)" --model-dir $model --out "$out/chaos.json" "$@" \
    2>&1 | tee "$out/chaos.log" | grep -v "^INFO\|Loading weights" | tail -40
  exit "${PIPESTATUS[0]}"
fi
if ! up; then
  log "starting vLLM $(python3 -c 'import vllm; print(vllm.__version__)') on $url (eager; log $vlog)"
  t0=$(date +%s)
  # LORA=0: no LoRA (vLLM 0.26 cannot reload full weights in place while LoRA wraps its layers)
  # LoRA only on the decoder's projections, never lm_head/embed_tokens: vLLM (0.26 to 0.33, model
  # runner V2) otherwise runs a prompt_logprobs request's logits, in 1,024-row chunks, through a
  # LoRA mapping of one row per running request, and its kernels read and write past the chunk
  # (the CUDA illegal memory access in docs/why-lora-target-modules.md; lora_churn.py reproduces it).
  # LORA_TARGETS=all: vLLM's default (every supported module, lm_head included).
  targets=(--lora-target-modules ${LORA_TARGETS:-q_proj k_proj v_proj o_proj gate_proj up_proj down_proj})
  [ "${LORA_TARGETS:-}" = all ] && targets=()
  lora=(--enable-lora --max-lora-rank 16 --max-loras ${MAX_LORAS:-16} --max-cpu-loras ${MAX_CPU_LORAS:-64} "${targets[@]}")
  [ "${LORA:-1}" = 0 ] && lora=()
  # tools: the agents' "auto" tool choice is parsed from hermes' <tool_call> format, as `nextstate vllm serve` does
  # MAX_NUM_SEQS: how many requests vLLM runs at once (the rest queue). Default: 48 for `learn` (set
  # while vLLM 0.26 + LoRA died under load, before the cause above was found), vLLM's own otherwise.
  # VLLM_DTYPE: the server's compute dtype (default: float16 for `agents`, else the checkpoint's
  # bfloat16). Against an fp32 trainer (--trainer-dtype fp32) float16 serves the trained policy to
  # 0.006 nats mean |Δ log-prob| (bfloat16: 0.016-0.047; benchmarks/gpu/agreement.py), inside the 0.02 the
  # agents benchmark checks after every publish. float32 does not start with LoRA: vLLM 0.26's
  # GPU LoRA kernels take only float16/bfloat16 (an assertion in lora_shrink_op).
  [ "$what" = agents ] && : "${VLLM_DTYPE:=float16}"
  dtype=()
  [ -n "${VLLM_DTYPE:-}" ] && dtype=(--dtype "$VLLM_DTYPE")
  # WEIGHT_TRANSFER=nccl: vLLM's weight-transfer engine and dev mode, for full weights sent over NCCL
  # from another GPU (PUBLISH_ARGS="--kind full --transfer nccl" with LORA=0)
  transfer=()
  [ "${WEIGHT_TRANSFER:-}" = nccl ] && { transfer=(--weight-transfer-config '{"backend": "nccl"}'); vllm_env+=(CUDA_VISIBLE_DEVICES=${VLLM_GPU:-0} VLLM_SERVER_DEV_MODE=1); }
  seqs=()
  [ "$what" = learn ] && seqs=(--max-num-seqs 48)
  [ -n "${MAX_NUM_SEQS:-}" ] && seqs=(--max-num-seqs "$MAX_NUM_SEQS")
  # supervised as `nextstate vllm serve` is: a vLLM that dies is started again after 1, 2, 4 ... 30 s,
  # at most VLLM_RESTARTS (5) times in a row (one that served 2 minutes starts the count again); the
  # jobs' gateways and online trainers load their active versions into the new server. The pid
  # file holds the supervisor's, which leads the process group (kill -- -PID stops both).
  setsid nohup bash -c 'limit=$1; shift; n=0
    while :; do
      t=$(date +%s); "$@"; rc=$?
      [ $(( $(date +%s) - t )) -ge 120 ] && n=0
      n=$((n + 1))
      [ $n -gt "$limit" ] && { echo "[supervisor] vLLM exited ($rc); gave up after $limit restarts in a row"; exit "$rc"; }
      d=$(( 1 << (n - 1) )); [ $d -gt 30 ] && d=30
      echo "[supervisor] vLLM exited ($rc); restarting in $d s ($n/$limit)"; sleep $d
    done' vllm-supervisor "${VLLM_RESTARTS:-5}" \
    env "${vllm_env[@]}" python3 -m vllm.entrypoints.openai.api_server --model $model --served-model-name smollm2 \
    "${lora[@]}" "${dtype[@]}" "${transfer[@]}" --enable-auto-tool-choice --tool-call-parser hermes \
    --max-model-len 4096 --gpu-memory-utilization ${GPU_MEM:-0.35} "${seqs[@]}" \
    --enforce-eager --port $port >$vlog 2>&1 &
  echo $! >$pidf
  echo "${VLLM_DTYPE:-bfloat16}" >/tmp/gpuloop-vllm-$port.dtype  # what the agents benchmark records it served in
  # a vLLM that exits while starting (the supervisor's first restart line) fails the start at once,
  # with its log: waiting out the supervisor's restarts spent a lease's last minutes with nothing shown
  for _ in $(seq 600); do
    up && break; kill -0 "$(cat $pidf)" 2>/dev/null || break
    grep -q '^\[supervisor\] vLLM exited' $vlog && break; sleep 0.5
  done
  up || { log "vLLM did not come up"; tail -60 $vlog; cp $vlog "$out/vllm-$port.log"
          kill -- -"$(cat $pidf)" 2>/dev/null; rm -f $pidf; exit 3; }
  log "vLLM up in $(( $(date +%s) - t0 )) s"
else
  log "vLLM already up on $url"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

rc=0
if [ "$what" = shape2 ]; then
  log "shape2 $*"
  python3 benchmarks/gpu/shape2.py --upstream $url --model-dir $model --out "$out" --trainer-gpu ${TRAINER_GPU:-1} "$@" \
    2>&1 | tee "$out/shape2.log" | grep -v "^INFO\|Loading weights\|Writing model\|HTTP Request" | tail -120
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { log "shape2 failed ($rc); vLLM log tail:"; tail -30 $vlog; }
fi

if [ "$what" = publish ] || [ "$what" = all ]; then
  log "publish under load"
  # with WEIGHT_TRANSFER=nccl the publisher is the trainer's end of the NCCL group: a GPU of its own
  gpu=(); [ "${WEIGHT_TRANSFER:-}" = nccl ] && gpu=(CUDA_VISIBLE_DEVICES=${TRAINER_GPU:-1})
  env "${gpu[@]}" python3 benchmarks/gpu/publish_load.py --upstream $url --model-dir $model --out "$out" \
    ${PUBLISH_ARGS:-} 2>&1 | tee "$out/publish_load.log" | grep -v "^INFO" | tail -40
fi
if [ "$what" = agents ]; then
  log "agents benchmark $*"
  python3 -m benchmarks.agents.run --preset gpu --upstream $url --teacher $url --model-dir $model --out "$out" \
    --server-dtype "$(cat /tmp/gpuloop-vllm-$port.dtype 2>/dev/null || echo unknown)" "$@" \
    2>&1 | tee "$out/agents${TAG:+-$TAG}.log" | grep -v "^INFO\|Loading weights\|Writing model\|HTTP Request" | tail -80
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { log "agents benchmark failed ($rc); vLLM log tail:"; tail -30 $vlog; }
fi
if [ "$what" = learn ] || [ "$what" = all ]; then
  log "learning benchmark $*"
  # one vLLM is policy and teacher: the GPU build serves prompt_logprobs beside live chats
  # engine deaths during the run: the supervisor's restarts of this vLLM, written into the run's JSON
  deaths0=$(grep -c '^\[supervisor\] vLLM exited' $vlog); mark=$(mktemp); sleep 1
  python3 benchmarks/learning/bench.py --upstream $url --teacher $url --model-dir $model --out "$out" "$@" \
    2>&1 | tee "$out/learn${TAG:+-$TAG}.log" | grep -v "^INFO\|Loading weights\|Writing model" | tail -80
  deaths=$(( $(grep -c '^\[supervisor\] vLLM exited' $vlog) - deaths0 ))
  find "$out" -maxdepth 1 -name '*.json' -newer "$mark" -print0 | xargs -0 -r python3 -c '
import json, sys
deaths = int(sys.argv[1])
for path in sys.argv[2:]:
    with open(path) as f:
        doc = json.load(f)
    if "results" not in doc:
        continue
    doc["engine_deaths"], doc["jobs"] = deaths, doc.get("config", {}).get("jobs")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(path, "engine_deaths", deaths, "jobs", doc["jobs"])' "$deaths"
  log "vLLM engine deaths during the learning run: $deaths"
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader
exit ${rc:-0}
