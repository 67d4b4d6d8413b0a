#!/usr/bin/env bash
# Does a refactor of the CUDA kernels change the machine code? Compiles cpp/cuda/*.cu of REF
# (default HEAD) and of the working tree for sm_90a and compares the disassembly of every kernel.
# Identical SASS means the GPU tests of REF cover the working tree too: a way to verify
# behaviour-preserving kernel refactors on a machine without a GPU.
#   tools/sass_identity.sh [REF]
# Needs nvcc and cuobjdump (the CUDA toolkit's, or the one Triton's wheel carries:
# CUOBJDUMP=$(python3 -c "import triton, os; print(os.path.dirname(triton.__file__))")/backends/nvidia/bin/cuobjdump).
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:-HEAD}
cuobjdump=${CUOBJDUMP:-cuobjdump}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/ref"
git archive "$ref" cpp | tar -x -C "$work/ref"
flags="-arch=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr"
status=0
for src in cpp/cuda/*.cu; do
  name=$(basename "$src" .cu)
  nvcc $flags -I"$work/ref/cpp" -cubin -o "$work/$name.ref.cubin" "$work/ref/$src" &
  nvcc $flags -Icpp -cubin -o "$work/$name.new.cubin" "$src" &
  wait
  # anonymous-namespace symbols carry a hash of the source path: not a code difference
  for v in ref new; do
    "$cuobjdump" -sass "$work/$name.$v.cubin" 2>/dev/null | sed 's/_GLOBAL__N__[0-9a-f]*_/_GLOBAL__N__/g' \
      > "$work/$name.$v.sass"
  done
  if cmp -s "$work/$name.ref.sass" "$work/$name.new.sass"; then
    echo "$name: identical SASS"
  else
    echo "$name: SASS differs ($(diff "$work/$name.ref.sass" "$work/$name.new.sass" | grep -c '^[<>]') lines)"
    status=1
  fi
done
exit $status
