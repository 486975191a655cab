#!/usr/bin/env bash
# The checks that need a lent device machine (a CUDA GPU and its host's cores), as one script, in order of
# priority: the machine, the gpu-marked tests, the engine's thread scaling on every core, a training step's
# device time hidden behind the engine, the hot experts' overlap, the fused kernels' tests and thresholds on
# that host's CPU (the dense bf16 loops against its oneDNN included, every format's kernels per product and their
# scaling over its cores), and the engine's roofline there. Each step has its own time limit, cut to what is left of
# the whole budget (DEVICE_BUDGET_S, default 420 s); full logs go to $OUT (or /tmp/device-out), a short tail of
# each to stdout; ONLY="name ..." runs only the steps named; SCALING_ARGS and DEVICE_STEP_ARGS replace the
# scaling step's and the device step's arguments, TESTS the tests step's; SUITE_WORKERS and SUITE_LIMIT set the suite step's workers and limit, SCALING_LIMIT the scaling step's limit. Packages the machine lacks are installed from wheels in .whl/ when that folder exists.
#
#   bash bench/device_session.sh            # from the repository root on the device machine
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
deadline=$(( $(date +%s) + ${DEVICE_BUDGET_S:-420} ))

step() {  # step NAME LIMIT_S COMMAND...: run COMMAND into $OUT/NAME.txt within LIMIT_S and what is left
  local name=$1 limit=$2 left start rc
  shift 2
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then return; fi
  left=$(( deadline - $(date +%s) - 5 ))
  if (( left < 20 )); then echo "=== $name: skipped, ${left}s left"; return; fi
  (( limit > left )) && limit=$left
  echo "=== $name (limit ${limit}s)"
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
  rc=$?
  echo "rc=$rc after $(( $(date +%s) - start ))s"
  grep -v -E "Warning|warnings.warn|USDT|^\s*$" "$OUT/$name.txt" | tail -n "${TAIL:-14}"
}

machine() {
  nvidia-smi -L 2>&1
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)"
  echo "ISA: $(grep -o -w -E 'amx_bf16|amx_int8|avx512_bf16|avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  free -g | head -2
  g++ --version | head -1
  python3 - <<'EOF'
import importlib
for name in ("torch", "transformers", "peft", "trl", "datasets", "accelerate", "tokenizers", "huggingface_hub",
             "safetensors", "pyarrow", "fsspec"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001 - report, go on
        print(name, "MISSING", e)
EOF
  python3 -m moetune.cli.main doctor
}

export -f machine
mt="python3 -m moetune.cli.main"
amx=$(grep -c -w amx_bf16 /proc/cpuinfo)

TAIL=30 step machine 90 bash -c machine
step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -W ignore -m gpu tests -rfEs
# shellcheck disable=SC2086  # word splitting of the argument lists is meant
# --python-ops: the compiled per-expert sequences (kernels/ops.h) against the same engine with them in Python
TAIL=60 step scaling "${SCALING_LIMIT:-240}" $mt bench engine ${SCALING_ARGS:---threads 1 4 8 16 --workers 8 --experts 128 \
  --tokens 512 2048 --modes lora frozen --policies retain --reps 3 --python-ops}
# tests named in TESTS (default: the compiled op sequences' and the tests whose children once lost PYTHONPATH)
# shellcheck disable=SC2086
step tests 200 python3 -m pytest -q -p no:cacheprovider -W ignore -n 8 -rfEs ${TESTS:-tests/unit/engine/test_native_ops.py \
  tests/integration/test_dist_exchange.py tests/integration/test_dist_failures.py tests/integration/test_kill_saves.py}
step device_step 120 python3 bench/device_step.py --device cuda ${DEVICE_STEP_ARGS:-}
step hot_overlap 60 python3 bench/hot_overlap.py --device cuda
step kernels 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/unit/engine/test_fused_kernels.py \
  tests/unit/engine/test_fused_fp8_mxfp4.py tests/unit/engine/test_fused_bf16.py -rfEs
# dense bf16 experts: the AVX512 loops (kernels/few_rows.h) against this host's oneDNN (AMX there), per product: what
# DenseExperts.FUSED_MAX_ROWS would need an AMX-BF16 entry from
step bf16 90 python3 bench/bf16_products.py --rows 1 8 16 32 --reps 3
# every format's kernel against bf16's per product (the a8 ones on the variant the engine takes for them), and each
# kernel's speed-up from 1 to 4 and 16 of the host's cores
TAIL=40 step products 120 python3 bench/products.py --rows 8 32 128 --threads 1 4 16 --experts 16 --reps 3 \
  --formats int8 int4-g64 fp8_block int8-a8 int4-g64-a8
if (( amx > 0 )); then
  step formats 120 python3 bench/formats.py --experts 16 --tokens 128 256 512 --formats fp8_block mxfp4 \
    --fused-max-rows 100000 --threads 1 --reps 3
fi
step engine 150 $mt bench engine --experts 128 --tokens 128 512 2048 --modes lora frozen --policies retain --reps 3
# the default suite with CUDA present (paths that pick the GPU when there is one), spread over the cores
# (-v: each test's outcome is in the log as it finishes, so a run cut off by its limit still names its failures)
step suite "${SUITE_LIMIT:-300}" python3 -m pytest -v -p no:cacheprovider -W ignore -n "${SUITE_WORKERS:-8}" -rfE tests
grep -E "(FAILED|ERROR) tests/" "$OUT/suite.txt" | sed 's/^.*\(FAILED\|ERROR\)/\1/' | sort -u | head -40
