#!/usr/bin/env bash
# On the GPU machine: build, run the GPU tests, compute-sanitizer (memcheck + racecheck) on a
# representative workload, then the benchmark. Logs and results go to $OUT (or ./gpu_out).
#   tools/gpu_check.sh [build|test|sanitize|verify|bench|all] [bench args...]   (verify: test + sanitize)
#     PYTEST_WORKERS=N: the GPU tests in N processes (pytest-xdist, on the GPU machine; with 4 on
#     one H100, session 26: 245 passed in 152 s, against over 250 s for one process);
#     SANITIZE_PARTS="wgmma ...": only those parts of tools/sanitize_case.py (racecheck over all
#     of them ran past 105 s in session 25); SANITIZE_TIMEOUT (240 s) per tool
#   tools/gpu_check.sh decode   # Llama-3-8B table (bf16, K=2..5) + Llama-3-70B K=4/K=2 on GPU 0
#   tools/gpu_check.sh tp       # Llama-3-70B tensor-parallel decode over 2 (and 4) GPUs + the
#                               # sharded matmul microbenchmark (a multi-GPU machine)
#   tools/gpu_check.sh tp-profile   # one profiled TP-2 decode, K=4 and bf16 (32 tokens, ~3 min
#                               # after the build): per-step kernel time by category and one
#                               # layer's kernels in order (benchmarks/profile_summary.py)
#   tools/gpu_check.sh tp-flags WEIGHTS FLAGS...   the TP-2 Llama-3-70B decode (WEIGHTS, e.g. 4 or
#                               # bf16,4) once per XLA_FLAGS value given ("" = none): which XLA
#                               # options shorten the step (e.g. the all-reduce implementation)
#   tools/gpu_check.sh patch-ab "P1 P2..." [bench args...]   an A/B of prepared patches on one GPU:
#                               # the benchmark on this tree, then the patches applied in order
#                               # (git apply), rebuilt, the benchmark again, both runs side by
#                               # side (render.py --compare), then pytest -m gpu tests/test_gpu.py;
#                               # the patches are reverted at the end. The environment (e.g.
#                               # KBIT_JAX_WGMMA_MAX_M) holds for both runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}   # on the GPU machine python3 is the interpreter that has jax

build() {
  echo "== build"
  KBIT_JAX_CUDA=ON $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; return 1; }
  $PY -c "import kbit_jax; print(kbit_jax.build_info())"
}
build || exit 1

if [[ $what == test || $what == verify || $what == all ]]; then
  echo "== pytest -m gpu"
  $PY -m pytest -q -p no:cacheprovider ${PYTEST_WORKERS:+-n "$PYTEST_WORKERS"} -m gpu tests 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -25
fi
if [[ $what == sanitize || $what == verify || $what == all ]]; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 3 \
      $PY tools/sanitize_case.py ${SANITIZE_PARTS:-} \
      > "$OUT/sanitize_$tool.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/sanitize_$tool.log"
  done
fi
if [[ $what == bench || $what == all ]]; then
  echo "== benchmark"
  $PY benchmarks/bench_matmul.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -80
fi
if [[ $what == decode ]]; then
  echo "== decode"
  $PY benchmarks/bench_decode.py --configs llama3-8b --reps 2 --out "$OUT/decode_8b" 2>&1 | grep "^| "
  $PY benchmarks/bench_decode.py --configs llama3-70b --weights 4,2 --batches 1,8 --new-tokens 64 \
    --reps 2 --out "$OUT/decode_70b" 2>&1 | grep "^| "
fi
if [[ $what == tp-profile ]]; then
  echo "== profiled tensor-parallel decode over 2 GPUs"
  $PY benchmarks/bench_decode.py --configs llama3-70b --weights 4,bf16 --tp 2 --batches 1 --new-tokens 32 \
    --reps 1 --profile /tmp/kbit_tp_profile --out "$OUT/decode_tp_profile" > "$OUT/decode_tp_profile.log" 2>&1
  grep "^| llama" "$OUT/decode_tp_profile.log"
  grep -E "^  (span|busy|idle) |kbit fused matmul  |one layer|^ +[0-9.]+ +[0-9.]+ +[0-9.]+  " \
    "$OUT/decode_tp_profile.log" | head -40
fi
if [[ $what == tp-flags ]]; then
  weights=$1; shift; i=0
  for flags in "$@"; do
    echo "== XLA_FLAGS='$flags'"
    XLA_FLAGS="$flags" timeout 300 $PY benchmarks/bench_decode.py --configs llama3-70b --weights "$weights" \
      --tp 2 --batches 1 --new-tokens 32 --reps 2 --out "$OUT/decode_flags_$i" > "$OUT/decode_flags_$i.log" 2>&1
    echo "rc=$?"; grep -E "^\| llama|Error|error:" "$OUT/decode_flags_$i.log" | tail -4; i=$((i + 1))
  done
fi
if [[ $what == tp ]]; then
  gpus=$(nvidia-smi -L | wc -l)
  sizes=2; [[ $gpus -ge 4 ]] && sizes=2,4
  echo "== tensor-parallel decode over $sizes GPUs"
  $PY benchmarks/bench_decode.py --configs llama3-70b --weights bf16,4,2 --tp "$sizes" --batches 1 \
    --new-tokens 64 --reps 2 --out "$OUT/decode_tp" 2>&1 | grep "^| "
  echo "== sharded matmul"
  $PY benchmarks/bench_sharded.py --out "$OUT/sharded" 2>&1 | tail -20
fi
if [[ $what == patch-ab ]]; then
  read -ra patches <<< "$1"; shift
  applied=()
  revert() {  # the applied patches, last first: the tree is as it came for the next call
    for ((i = ${#applied[@]} - 1; i >= 0; i--)); do git apply -R "${applied[i]}" || echo "cannot revert ${applied[i]}"; done
  }
  trap revert EXIT
  bench_to() {  # bench_to NAME [bench args]: $OUT/NAME/matmul.json, log $OUT/bench_NAME.log
    local name=$1; shift
    echo "== benchmark, $name"
    $PY benchmarks/bench_matmul.py --out "$OUT/$name" "$@" > "$OUT/bench_$name.log" 2>&1 \
      || { tail -20 "$OUT/bench_$name.log"; return 1; }
  }
  bench_to base "$@" || exit 1
  for p in "${patches[@]}"; do
    git apply "$p" || { echo "cannot apply $p"; exit 1; }
    applied+=("$p")
  done
  build || exit 1
  bench_to new "$@" || exit 1
  $PY benchmarks/render.py --compare "$OUT/base/matmul.json" "$OUT/new/matmul.json" | tee "$OUT/patch_ab.md"
  # the tests last: a slow test run then cannot cost the call its A/B
  echo "== pytest -m gpu tests/test_gpu.py, patched"
  $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu_patched.log" | tail -8
fi
