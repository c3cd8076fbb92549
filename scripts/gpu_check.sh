#!/usr/bin/env bash
# GPU check of the vLLM / SGLang / TensorRT-LLM adapters and of placement: for every installed
# engine, the adapter tests on the real engine, every actor's device for hybrid and standalone
# placement (`polyrl placement`: probe actors started with the run's own Ray options report the
# GPU Ray gave them; TensorRT-LLM's engine starters also place stand-ins of its Ray workers in
# their bundles), then 2-step GRPO runs (`polyrl train`) in hybrid and standalone placement in
# bf16 and, where the model allows, hybrid with FP8 rollout. Prints one PASS / FAIL / SKIP line
# per check and exits non-zero if any check failed.
#
#   scripts/gpu_check.sh [MODEL_DIR]
#   scripts/gpu_check.sh --quick [--json PATH]   # torch only, a few minutes (gpu_quick_check.py)
#   scripts/gpu_check.sh --loop [--device cpu] [--json PATH]   # whole training loops without Ray,
#                                                # <= 8 minutes on a GPU (gpu_loop.py; CI runs --device cpu)
#   scripts/gpu_check.sh --profile [--device cpu] [--json PATH]  # torch.profiler over the bf16
#                                                # packed training step (MFU, top kernels) and the
#                                                # built-in engine's decode (gpu_profile.py; ~1-2 minutes)
#
# MODEL_DIR: a local Hugging Face decoder directory (e.g. Qwen2.5-0.5B-Instruct). Default: the
# bundled tiny model, copied to a temp dir with its config converted for older transformers
# (adds `torch_dtype`, top-level `rope_theta`). FP8 needs every linear layer to be whole 128x128
# blocks (hidden, intermediate and KV sizes multiples of 128): the tiny model is not, so its FP8
# checks are skipped with the reason; pass a real model to run them.
#
# Environment: ENGINES (default "vllm sglang trtllm"), GPU_CHECK_TIMEOUT (total seconds, default
# 1500), GPU_CHECK_STEP_TIMEOUT (seconds per check, default 600). Needs one GPU; installed
# engines only (`pip install "polyrl[vllm]"` etc.); engines that are not installed are skipped.
# Standalone placement needs 2 GPUs (a policy rank and a rollout replica); with one GPU its
# checks are skipped with the reason. The model is local: nothing is downloaded.
# Documented in docs/gpu_engines.md.
set -u
cd "$(dirname "$0")/.."

# --quick: the device-sized check (minutes, torch alone: no Ray, engines or network), for a lent
# accelerator: the built-in engine, DDP / FSDP2 steps, the weight sync over the device group, FP8
# and a bf16 step's MFU (scripts/gpu_quick_check.py says what each check proves)
if [ "${1:-}" = "--quick" ]; then
  shift
  exec "${PYTHON:-python3}" scripts/gpu_quick_check.py "$@"
fi

# --loop: `polyrl train ray.enabled=false` end to end (the bundled task must be learned; a random
# ~0.5B Qwen2's rollout and training throughput, MFU, weight-sync time and log-prob gap). Torch
# and polyrl's pure-Python dependencies only: a device image without them gets the directory
# scripts/gpu_carry.sh builds (build/gpu_carry, carried with the working tree), put on PYTHONPATH here
if [ "${1:-}" = "--loop" ]; then
  shift
  if [ -d build/gpu_carry ]; then
    export PYTHONPATH="$PWD/build/gpu_carry${PYTHONPATH:+:$PYTHONPATH}"
  fi
  exec "${PYTHON:-python3}" scripts/gpu_loop.py "$@"
fi

# --profile: where the bf16 training step (0.5B-shaped, packed) and the decode spend their time,
# with the MFU against the issue's 40% goal; torch and the carried packages only, as --loop
if [ "${1:-}" = "--profile" ]; then
  shift
  if [ -d build/gpu_carry ]; then
    export PYTHONPATH="$PWD/build/gpu_carry${PYTHONPATH:+:$PYTHONPATH}"
  fi
  exec "${PYTHON:-python3}" scripts/gpu_profile.py "$@"
fi

TOTAL=${GPU_CHECK_TIMEOUT:-1500}
PER_CHECK=${GPU_CHECK_STEP_TIMEOUT:-600}
ENGINES=${ENGINES:-"vllm sglang trtllm"}
deadline=$((SECONDS + TOTAL))
failures=0
work=$(mktemp -d /tmp/polyrl-gpu-check.XXXXXX)

declare -A MODULE=([vllm]=vllm [sglang]=sglang [trtllm]=tensorrt_llm)

if [ $# -ge 1 ]; then
  model=$1
else
  model="$work/tiny-arith"
  cp -r polyrl/assets/tiny-arith "$model"
  python - "$model/config.json" <<'EOF'
import json, sys
path = sys.argv[1]
cfg = json.load(open(path))
cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
rope = cfg.get("rope_parameters") or {}
if "rope_theta" in rope:
    cfg.setdefault("rope_theta", rope["rope_theta"])
json.dump(cfg, open(path, "w"), indent=2)
EOF
fi

fp8_reason=$(python - "$model/config.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
sizes = {"hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
         "kv size": head * c.get("num_key_value_heads", c["num_attention_heads"])}
bad = [f"{k}={v}" for k, v in sizes.items() if v % 128]
print(f"not whole 128x128 FP8 blocks: {', '.join(bad)}" if bad else "")
EOF
)

budget() {  # seconds for the next check, or 0 when the total timeout is spent
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 30 ]; then echo 0; elif [ "$left" -lt "$PER_CHECK" ]; then echo "$left"; else echo "$PER_CHECK"; fi
}

report() {  # name rc logfile
  if [ "$2" -eq 0 ]; then
    echo "PASS $1"
  else
    failures=$((failures + 1))
    [ "$2" -eq 124 ] && why="timed out" || why="exit $2"
    echo "FAIL $1 ($why; log: $3)"
    tail -n 15 "$3" | sed 's/^/    /'
  fi
}

GPUS=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
STANDALONE="rollout.placement=standalone rollout.num_replicas=1"

devices() {  # name engine [overrides...]: every actor on its planned device
  local name=$1 engine=$2; shift 2
  local t; t=$(budget)
  if [ "$t" -eq 0 ]; then failures=$((failures + 1)); echo "FAIL $name (total timeout ${TOTAL}s reached)"; return; fi
  local log="$work/$name.log"
  timeout "$t" python -m polyrl placement model.path="$model" rollout.backend="$engine" \
    rollout.max_model_len=256 actor.num_cpus_per_worker=1 "$@" >"$log" 2>&1
  local rc=$?
  grep -E '^(PASS|FAIL) device' "$log" | sed "s/^/  [$name] /"
  report "$name" "$rc" "$log"
}

grpo() {  # name engine [overrides...]
  local name=$1 engine=$2; shift 2
  local t; t=$(budget)
  if [ "$t" -eq 0 ]; then failures=$((failures + 1)); echo "FAIL $name (total timeout ${TOTAL}s reached)"; return; fi
  local out="$work/$name"
  mkdir -p "$out"
  timeout "$t" python -m polyrl train --output-dir "$out" \
    model.path="$model" rollout.backend="$engine" rollout.dtype=bfloat16 \
    rollout.gpu_memory_utilization=0.3 rollout.enforce_eager=true rollout.n=4 \
    rollout.response_length=16 data.train_batch_size=8 trainer.total_steps=2 \
    trainer.val_before_train=false trainer.val_every=0 trainer.save_at_end=false \
    trainer.progress_bar=false actor.param_dtype=bfloat16 actor.compute_dtype=bfloat16 \
    "$@" >"$out/log" 2>&1
  local rc=$?
  if [ "$rc" -eq 0 ]; then  # a finished run wrote summary.json with 2 steps
    python -c "import json,sys; s=json.load(open('$out/summary.json')); sys.exit(s['steps'] != 2)" \
      >>"$out/log" 2>&1 || rc=1
  fi
  report "$name" "$rc" "$out/log"
}

echo "polyrl GPU check: model $model, engines: $ENGINES, total timeout ${TOTAL}s"
python -m polyrl doctor 2>&1 | sed 's/^/    /' | head -n 20
for engine in $ENGINES; do
  if ! python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('${MODULE[$engine]}') is None)"; then
    echo "SKIP $engine: ${MODULE[$engine]} is not installed (pip install \"polyrl[$engine]\")"
    continue
  fi
  t=$(budget)
  if [ "$t" -eq 0 ]; then failures=$((failures + 1)); echo "FAIL $engine-adapter-tests (total timeout reached)"; continue; fi
  timeout "$t" python -m pytest -q -x tests/rollout/engines/test_engine_adapters_gpu.py -k "$engine" \
    >"$work/$engine-adapter-tests.log" 2>&1
  report "$engine-adapter-tests" $? "$work/$engine-adapter-tests.log"
  devices "$engine-devices-hybrid" "$engine"
  grpo "$engine-grpo-bf16" "$engine"
  if [ "$GPUS" -ge 2 ]; then
    # shellcheck disable=SC2086  # STANDALONE is two overrides
    devices "$engine-devices-standalone" "$engine" $STANDALONE
    # shellcheck disable=SC2086
    grpo "$engine-grpo-standalone" "$engine" $STANDALONE
  else
    echo "SKIP $engine-standalone: needs 2 GPUs (a policy rank and a rollout replica), found $GPUS"
  fi
  if [ -n "$fp8_reason" ]; then
    echo "SKIP $engine-grpo-fp8: model $fp8_reason (pass a model directory whose layers are)"
  else
    grpo "$engine-grpo-fp8" "$engine" rollout.quantization=fp8
  fi
done
# LoRA through vLLM's adapter path (rollout.lora_mode=adapter): the base is read from disk once,
# every sync sends only the adapter and vLLM serves it as a LoRA adapter (docs/training.md, LoRA)
if [[ " $ENGINES " == *" vllm "* ]] && python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  grpo "vllm-grpo-lora-adapter" vllm model.lora_rank=8 rollout.lora_mode=adapter
else
  echo "SKIP vllm-grpo-lora-adapter: vllm is not installed or not in ENGINES"
fi
# Standalone TP-2: the replica leader is the engine host (num_gpus=0, RAY_EXPERIMENTAL_NOSET_*,
# CUDA_VISIBLE_DEVICES = its replica's 2 ids); the probe checks torch there sees exactly 2 devices
# and the other rank holds the second; then 2 GRPO steps whose weights go through the replica
# leader (docs/gpu_engines.md, "Standalone tensor parallelism")
TP2="rollout.placement=standalone rollout.num_replicas=1 rollout.tensor_parallel_size=2"
for engine in $ENGINES; do
  if ! python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('${MODULE[$engine]}') is None)"; then
    continue  # reported above
  fi
  if [ "$GPUS" -ge 3 ]; then
    # shellcheck disable=SC2086  # TP2 is three overrides
    devices "$engine-devices-standalone-tp2" "$engine" $TP2
    # shellcheck disable=SC2086
    grpo "$engine-grpo-standalone-tp2" "$engine" $TP2
  else
    echo "SKIP $engine-standalone-tp2: needs 3 GPUs (a policy rank and a TP-2 replica), found $GPUS"
  fi
done
echo "done: $failures failed check(s); logs in $work"
[ "$failures" -eq 0 ]
