#!/usr/bin/env bash
# On the GPU machine: build the standalone kernel harness (no JAX) and time or profile the fused
# matmul. Logs, reports and CSV exports go to $OUT (or ./gpu_out).
#   tools/kernel_profile.sh test                 the harness's correctness checks (every kernel
#                                                 against a float64 reference; each case named
#                                                 before it runs, so a hang names itself;
#                                                 KBIT_HARNESS_TEST_WGMMA=1: of the matmul cases
#                                                 only the wgmma kernel's, a short run;
#                                                 KBIT_HARNESS_TEST_VARIANTS="2 3": only those
#                                                 tiling variants')
#   tools/kernel_profile.sh sel                  harness timings (ten shapes x bits x M 1, 4, 16)
#   tools/kernel_profile.sh layers               a Llama-3-70B layer's products per device at
#                                                 TP 1, 2, 4 (M = 1): the decode step's matmul time
#                                                 (KBIT_HARNESS_NO_SWEEP=1: without each product's
#                                                 cluster-size sweep, ~1 s a run, for A/B rounds)
#   tools/kernel_profile.sh prefetch             those products after an idle gap, with and without
#                                                 an L2 prefetch of their weights before the gap
#   tools/kernel_profile.sh chain                a Llama-3-8B layer's products and norms in one CUDA
#                                                 graph: plain launches against a chain of
#                                                 programmatic dependent launches
#   tools/kernel_profile.sh repeat BITS DTYPE B M K N KS VARIANT REPS   one test case launched
#                                                 REPS times, every run checked (the harness's
#                                                 "repeat": a hunt for intermittent failures)
#   tools/kernel_profile.sh host                 host time of one launch and of its parts
#   tools/kernel_profile.sh rows                 M = 17..128: warp-specialized (blocks of 16 rows,
#                                                 and the N-split tiling) against the cp.async kernel
#                                                 (KBIT_HARNESS_ROWS_M="1 4 16", KBIT_HARNESS_ROWS_BITS:
#                                                 those M, bits instead)
#   tools/kernel_profile.sh split                M = 384..1024: the wgmma kernel's split last round of
#                                                 tiles against none, and above 128 rows its 256- and
#                                                 128-row tiles forced (SPLITR; KBIT_HARNESS_SPLIT_M, _BITS)
#   tools/kernel_profile.sh sweep                every cluster size (k-split) against the launcher's
#                                                 choice (M <= 16). KBIT_HARNESS_SWEEP_M="128 256 512" sweeps
#                                                 those M instead (above 128: the wgmma kernel),
#                                                 KBIT_HARNESS_SWEEP_BITS="3" those bits
#   tools/kernel_profile.sh narrow               M <= 8 in the 16-row tilings' 32-column groups against
#                                                 the launcher's choice (KBIT_HARNESS_NARROW_M, _BITS)
#   tools/kernel_profile.sh wide5                bits 5, M = 9..16: the 64-column tiling (variant 4)
#                                                 against the other tilings and the launcher's pick
#                                                 (KBIT_HARNESS_WIDE5_M)
#   tools/kernel_profile.sh tiles                bits 2..5, M = 9..16: every tiling forced beside the
#                                                 launcher's pick, with their plans (KBIT_HARNESS_TILES_M,
#                                                 _BITS)
#   tools/kernel_profile.sh balance              M <= 16: every cluster size, uniform and chunk-balanced,
#                                                 in the launcher's tiling (KBIT_HARNESS_BALANCE_M, _BITS)
#   tools/kernel_profile.sh ncu BITS K N M ...   one ncu report per (BITS K N M) quadruple:
#                                                 <tag>_details.csv (every section),
#                                                 <tag>_sass.csv (per-instruction stall samples)
#   tools/kernel_profile.sh stream [MODE]       MODE (sel) on this build and on a stream-only build
#                                                 (-DKBIT_STREAM_ONLY=1: the consumers release each
#                                                 chunk undecoded, matmul_fused_config.cuh): what the
#                                                 memory path alone takes; result lines side by side,
#                                                 e.g. KBIT_HARNESS_TILES_BITS="2 4" KBIT_HARNESS_TILES_M=1
#                                                 tools/kernel_profile.sh stream tiles
#   tools/kernel_profile.sh ab BASE [ROUNDS]     A/B on one GPU: the harness of BASE (an older
#                                                 tree's cpp/ and benchmarks/) and of this tree run
#                                                 "sel" alternately, ROUNDS (3) times each; prints
#                                                 both result lines side by side. Prepare BASE
#                                                 here and carry it, e.g.
#        mkdir -p .git/info .ab_base; echo /.ab_base/ >> .git/info/exclude
#        git archive <ref> cpp benchmarks | tar -x -C .ab_base      (then carry [".ab_base"])
#   AB_MODE=layers tools/kernel_profile.sh ab BASE 1   the same with another mode (base and new
#                                                 result lines side by side)
#   tools/kernel_profile.sh ab env:KBIT_JAX_PDL=0 2   base = this build run with that variable
#                                                 set (here: without programmatic dependent launch);
#                                                 in a chain: AB_BASE=... AB_ROUNDS=2 ... test,ab
#   tools/kernel_profile.sh test,sel,sweep       modes without arguments, one after another on
#                                                 one build
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
what=${1:-sel}; shift || true
work=${HARNESS_WORK:-/tmp/kbit_harness}  # (a separate one per concurrent build)
bin=$work/harness
mkdir -p "$work"

build() {  # build SOURCE_ROOT BINARY [FLAGS]: every translation unit in parallel, then link
  local root=$1 out=$2 objs=$work/obj_$(basename "$2") pids=()
  # (KBIT_WGMMA as in CMake's 90a build: the harness dispatches like the module)
  local flags="-gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -lineinfo -DKBIT_WGMMA=1 -I$root/cpp ${3:-}"
  echo "== build $out from $root ($flags)"
  mkdir -p "$objs"
  for src in "$root"/benchmarks/cuda_kernel_harness.cu "$root"/cpp/cuda/*.cu; do
    nvcc $flags -c "$src" -o "$objs/$(basename "$src").o" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "build failed"; return 1; }; done
  nvcc -gencode=arch=compute_90a,code=sm_90a "$objs"/*.o -o "$out"
}
build . "$bin" || exit 1

run_mode() {  # MODE [ARGS...]
local mode=$1; shift
case $mode in
  test) KBIT_HARNESS_VERBOSE=1 timeout ${HARNESS_TEST_TIMEOUT:-300} "$bin" test > "$OUT/harness_test.log" 2>&1; echo "harness test rc=$?"
        grep -E "^TESTS|^matmul:|FAIL" "$OUT/harness_test.log" | tail -5 ;;
  sel) "$bin" sel | tee "$OUT/sel${TAG:-}.log" | grep -E "^SEL|copy" ;;
  layers) "$bin" layers | tee "$OUT/layers${TAG:-}.log" ;;
  prefetch) "$bin" prefetch | tee "$OUT/prefetch${TAG:-}.log" ;;
  chain) "$bin" chain | tee "$OUT/chain${TAG:-}.log" ;;
  repeat) timeout 300 "$bin" repeat "$@" > "$OUT/repeat${TAG:-}.log" 2>&1; echo "harness repeat rc=$?"
          grep -E "^REPEAT [0-9]+ of|^repeat" "$OUT/repeat${TAG:-}.log" ;;
  host) "$bin" host | tee "$OUT/host${TAG:-}.log" ;;
  rows) "$bin" rows | tee "$OUT/rows${TAG:-}.log" | grep -E "^ROWS|copy" ;;
  split) "$bin" split | tee "$OUT/split${TAG:-}.log" | grep -E "^SPLIT|copy" ;;
  sweep) "$bin" sweep | tee "$OUT/sweep${TAG:-}.log" | grep -E "^SWEEP|^sweep|copy" ;;
  narrow) "$bin" narrow | tee "$OUT/narrow${TAG:-}.log" | grep -E "^NARROW|copy" ;;
  wide5) "$bin" wide5 | tee "$OUT/wide5${TAG:-}.log" | grep -E "^WIDE5|copy" ;;
  tiles) "$bin" tiles | tee "$OUT/tiles${TAG:-}.log" | grep -E "^TILES|copy" ;;
  balance) "$bin" balance | tee "$OUT/balance${TAG:-}.log" | grep -E "^BALANCE|copy" ;;
  ncu)
    while [[ $# -ge 4 ]]; do
      tag="b$1_k$2_n$3_m$4"
      ncu --clock-control none --set full --import-source no -k regex:kbit_matmul --launch-skip 3 \
        --launch-count 1 -f -o "$work/$tag" "$bin" one "$1" "$2" "$3" "$4" 6 > "$work/${tag}_ncu.log" 2>&1
      tail -3 "$work/${tag}_ncu.log"
      ncu -i "$work/$tag.ncu-rep" --page details --csv > "$OUT/${tag}_details.csv"
      ncu -i "$work/$tag.ncu-rep" --page source --print-source sass --csv > "$OUT/${tag}_sass.csv"
      shift 4
    done ;;
  ab)
    base=${1:-${AB_BASE:?BASE directory}}; rounds=${2:-${AB_ROUNDS:-3}}; ab=${AB_MODE:-sel}
    base_cmd=("$work/base")
    if [[ $base == env:* ]]; then  # this build, with one environment variable set for the base
      base_cmd=(env "${base#env:}" "$bin")
    else
      build "$base" "$work/base" || exit 1
    fi
    a=(); b=()
    for ((i = 0; i < rounds; ++i)); do  # alternate, so slow drift of the GPU hits both alike
      "${base_cmd[@]}" "$ab" > "$work/${ab}_base_$i.log"; b+=("$work/${ab}_base_$i.log")
      "$bin" "$ab" > "$work/${ab}_new_$i.log"; a+=("$work/${ab}_new_$i.log")
    done
    cat "${b[@]}" > "$OUT/${ab}_base.log"; cat "${a[@]}" > "$OUT/${ab}_new.log"
    paste <(grep -E "^[A-Z]+ " "$OUT/${ab}_base.log") <(grep -E "^[A-Z]+ " "$OUT/${ab}_new.log") ;;
  stream)
    sm=${1:-sel}
    build . "$work/stream" -DKBIT_STREAM_ONLY=1 || exit 1
    "$bin" "$sm" > "$OUT/${sm}_real.log"; "$work/stream" "$sm" > "$OUT/${sm}_stream.log"
    paste <(grep -E "^[A-Z]+ " "$OUT/${sm}_real.log") <(grep -E "^[A-Z]+ " "$OUT/${sm}_stream.log") ;;
  none) ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
}
# Modes without arguments may be chained on one build: tools/kernel_profile.sh test,sel,sweep
IFS=, read -ra modes <<< "$what"
if [[ ${#modes[@]} -gt 1 ]]; then
  for m in "${modes[@]}"; do echo "== $m"; run_mode "$m"; done
else
  run_mode "$what" "$@"
fi
