#!/usr/bin/env bash
# On the GPU machine: build, run the GPU tests, compute-sanitizer (memcheck + racecheck) on a
# representative workload, then the benchmark. Logs and results go to $OUT (or ./gpu_out).
#   tools/gpu_check.sh [build|test|sanitize|verify|bench|all] [bench args...]   (verify: test + sanitize)
#     PYTEST_WORKERS=N: the GPU tests in N processes (pytest-xdist; 4 on one H100 take about
#     0.6x the time of one process); SANITIZE_TOOLS ("memcheck racecheck"); SANITIZE_PARTS="wgmma
#     ...": only those parts of tools/sanitize_case.py (default: all), each in its own process and
#     log with its own SANITIZE_TIMEOUT (240 s). On an H200 memcheck takes ~140 s over all parts;
#     racecheck ~13 min (wgmma 260 s, small 132, clusters 94, wgmma_f16 88, ragged 74, wgmma64 51,
#     wide5 40, glu 7 when alone), so it needs several calls of a 10-minute limit. A part whose
#     sanitizer process segfaults (rc 139: compute-sanitizer itself has crashed, once while XLA
#     compiled, with nothing in the log) runs once more; a fault that repeats is reported.
#   tools/gpu_check.sh decode   # Llama-3-8B table (bf16, K=2..5) + Llama-3-70B K=4/K=2 on GPU 0
#   tools/gpu_check.sh tp       # Llama-3-70B tensor-parallel decode over 2 (and 4) GPUs + the
#                               # sharded matmul microbenchmark (a multi-GPU machine)
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
  parts=${SANITIZE_PARTS:-$($PY -c "import sys; sys.path.insert(0, 'tools'); import sanitize_case; print(*sanitize_case.PARTS)")}
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    for part in $parts; do
      echo "== compute-sanitizer --tool $tool: $part"
      log="$OUT/sanitize_${tool}_$part.log"
      for attempt in 1 2; do
        start=$SECONDS
        timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 3 \
          $PY tools/sanitize_case.py "$part" > "$log" 2>&1
        rc=$?
        echo "rc=$rc ($((SECONDS - start)) s; 0: clean, 3: errors, 124: timed out, 139: segfault)"
        grep -E "SUMMARY" "$log" | tail -1
        [[ $rc == 139 && $attempt == 1 ]] || break
        echo "segfault: once more"
      done
    done
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
if [[ $what == tp ]]; then
  gpus=$(nvidia-smi -L | wc -l)
  sizes=2; [[ $gpus -ge 4 ]] && sizes=2,4
  echo "== tensor-parallel decode over $sizes GPUs"
  $PY benchmarks/bench_decode.py --configs llama3-70b --weights bf16,4,2 --tp "$sizes" --batches 1 \
    --new-tokens 64 --reps 2 --out "$OUT/decode_tp" 2>&1 | grep "^| "
  echo "== sharded matmul"
  $PY benchmarks/bench_sharded.py --out "$OUT/sharded" 2>&1 | tail -20
fi
