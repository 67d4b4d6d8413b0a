#!/usr/bin/env bash
# On the GPU machine: build the standalone kernel harness (no JAX) and profile the fused matmul
# with Nsight Compute. Reports and CSV exports go to $OUT (or ./gpu_out).
#   tools/kernel_profile.sh sel                  harness timings (four shapes x bits x M 1, 4, 16)
#   tools/kernel_profile.sh ncu BITS K N M ...   one ncu report per (BITS K N M) quadruple:
#                                                 <tag>_details.csv (every section),
#                                                 <tag>_sass.csv (per-instruction stall samples)
#   EXTRA_NVCC="-DKBIT_WS_PRODUCER_WARPS=4" tools/kernel_profile.sh sel   a compile-time variant
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
what=${1:-sel}; shift || true
bin=/tmp/kbit_harness/harness
mkdir -p /tmp/kbit_harness
flags="-arch=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -lineinfo -Icpp ${EXTRA_NVCC:-}"
echo "== build harness ($flags)"
pids=()
for src in benchmarks/cuda_kernel_harness.cu cpp/cuda/*.cu; do
  nvcc $flags -c "$src" -o "/tmp/kbit_harness/$(basename "$src").o" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { echo "build failed"; exit 1; }; done
nvcc -arch=sm_90a /tmp/kbit_harness/*.o -o "$bin" || exit 1

case $what in
  sel) "$bin" sel | tee "$OUT/sel${TAG:-}.log" | grep -E "^SEL|copy" ;;
  ncu)
    while [[ $# -ge 4 ]]; do
      tag="b$1_k$2_n$3_m$4"
      ncu --clock-control none --set full --import-source no -k regex:kbit_matmul --launch-skip 3 \
        --launch-count 1 -f -o "/tmp/kbit_harness/$tag" "$bin" one "$1" "$2" "$3" "$4" 6 > "/tmp/kbit_harness/${tag}_ncu.log" 2>&1
      tail -3 "/tmp/kbit_harness/${tag}_ncu.log"
      ncu -i "/tmp/kbit_harness/$tag.ncu-rep" --page details --csv > "$OUT/${tag}_details.csv"
      ncu -i "/tmp/kbit_harness/$tag.ncu-rep" --page source --print-source sass --csv > "$OUT/${tag}_sass.csv"
      shift 4
    done ;;
esac
