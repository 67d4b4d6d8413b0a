// kbit_matmul dispatch: the fused tensor-core kernels where they apply (matmul_wgmma.cuh for
// bf16 and fp16 at kWgmmaMinRows..kWgmmaMaxRows rows, from kWgmmaEarlyMinRows for the products
// wgmma_rule_rows calls early, and to kWgmmaWideBitsMaxRows at bits 5; matmul_fused.cuh
// otherwise), the generic SIMT kernel (matmul_generic.cu) elsewhere; plus the build information
// of the module.
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "cuda/common.cuh"

namespace kbit::cuda {

std::string launch_matmul_generic(const MatmulArgs& a, cudaStream_t stream);
namespace fused {
template <int BITS>
std::string launch_fused_bits(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning);
}  // namespace fused
namespace wgmma {
template <int BITS>
std::string launch_wgmma_bits(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning);
}  // namespace wgmma

// Rows of x for which bf16 (and, since session 42, fp16) products take the wgmma kernel
// (matmul_wgmma.cuh) instead of matmul_fused.cuh's; fitted on bf16 products, whose alternatives
// in matmul_fused.cuh are the faster (fp16 has no scaled-weights N-split path), so fp16 takes
// the same rows. Measured on an H200 (bits 4, the ten benchmark shapes;
// benchmarks/results/matmul_wgmma_h200_s22.md): at M = 128 it takes 0.64-0.88x the time of the
// mma.sync kernels on 9 of 10 shapes (Llama-3-70B gate/up 148 against 231 us), at M = 64 it wins
// on half of them, and at M = 512 and 4096 dequantize + cuBLAS is faster on most (session 23 made
// the kernel 0.89-0.97x faster again at M = 128, matmul_wgmma_h200_s23.md). Session 25 (H100,
// benchmarks/results/wgmma_bm256_h100_s25.md) gave it copies by TMA and a 256-row tile above 128
// rows: at M = 256 and 512 it then takes 0.52-0.79x the time of dequantize + cuBLAS on the five
// shapes measured (bits 4; Llama-3-70B gate/up, M = 512: 451 against 570 us), at M = 1024
// 0.93-0.99x, at M = 4096 1.1-1.2x, so it stops at 512. Session 27 (H100, C++ harness sweep,
// benchmarks/results/wgmma_tiles_h100_s27.md) gave it a 128-column tile for small layers and
// timed it against matmul_fused.cuh's own choice at 32, 48 and 64 rows, 13 shapes x bits 2, 4, 5:
// on N >= 4096 it takes a median 0.87x the time at 48 rows (slower on 7 of 39, at most 1.14x:
// Qwen3 gate/up) and 0.86x at 64 (slower on 2, 1.03x), but 1.18x at 32 (the N-split tiling's
// 32-row block); on N = 2048-2560 (Qwen3 down and o, GLM-4.7 down, Llama-3-70B qkv at TP 4)
// it is slower on 7 of 12 at 48 rows and 5 of 12 at 64 (up to 1.29x), except at bits 5, where
// it is faster on all four (0.79-0.94x; matmul_fused.cuh's 128 KiB bits-5 table leaves its
// N-split tiling few stages). So bf16 products of N >= 4096, and of bits 5, take it from 33
// rows, others from 65. Session 32 (H200, bench_matmul.py, benchmarks/results/
// wgmma_split_last_h200_s32.md) split its last round of tiles, after which at M = 768 and 1024
// it takes 0.67-0.98x the time of dequantize + dense dot at bits 2 and 4 on all ten shapes (at
// 2048: 0.85-1.15x, slower on 10 of 20), but 0.81-1.19x at bits 5, slower on 11 of 20 (then on
// the 128-row tile; session 33's 256-row tile for bits 5 read 0.89-1.17x, slower on 7 of 12:
// benchmarks/results/bits5_tables_h200_s33.md). So bits 2-4 take it up to 1024 rows, bits 5 up
// to 512. Session 37 (H200, harness "rows" without PDL, M = 17..64, both kernels timed on every
// case: the 10 benchmark shapes and Llama-3-70B's per-device layers at TP 2 and 4, bits 2-5;
// benchmarks/results/wgmma_dispatch_h200_s37.md): after sessions 34 and 36 sped up its cluster sum
// and its start, the wgmma kernel was the faster one at every M >= 40 (N = 2048 layers at bits
// 2-4 included: GLM-4.7 down, M = 40, bits 2: 17.3 against 21.1 us; Llama-3-70B q/k/v at TP 4,
// M = 64: 1.68x faster), and at 17..32 on the wide layers of at most ~50 M weights (Qwen3 gate/up
// at bits 2, M = 17: 9.5 against 15.1 us, where the fused kernel's 16-row blocks leave 160 items
// for 132 SMs; Llama-3-70B q/k/v and o at TP 2) and at bits 5 from N = 2560. Elsewhere at 17..32
// the fused kernel was (up to 1.31x faster: GLM-4.7 down at bits 4; the Llama gate/up and down
// layers by 1.05-1.18x). The rule below is within 0.26 % of the faster kernel on (geometric)
// average over those 448 cases and 22 % at worst (Llama-3-70B q/k/v at TP 4, bits 2, M = 17..32);
// the previous one (from 33 where N >= 4096 or bits 5, else 65) was 4.2 % and 68 % off.
// Session 38 (H200, harness "rows" without PDL, both kernels timed on the ten shapes and
// Llama-3-70B's layers at TP 2 and 4, bits 2-5, M = 17..64: 408 cases; benchmarks/results/
// wgmma_pairs_h200_s38.md) split the 64-row, 128-column tile's chunks over two warpgroup pairs
// (WgConfig::kGroups): 0.81-0.90x the time (geometric means) on the Llama-3-70B down, o and
// q/k/v layers at M = 17..64. Now the wgmma kernel wins at 17..32 on every N of 2560..8192 (the
// Llama-3-70B layers at TP 1-4: 0.62-0.98x the fused kernel's time) but Llama-3-8B down (K
// 14336, N 4096) at bits 3-4 (1.15x), at bits 5 on every N (N = 2048: 0.88-0.98x), and still on
// the wide layers of at most 48 Mi weights; the fused kernel keeps the Llama gate/up layers
// (N >= 14336, by 1.04-1.12x) and N = 2048 at bits 2-4 (by up to 1.10x). The rule below is
// within 0.15 % of the faster kernel on (geometric) average over those cases and 9 % at worst
// (Qwen3 down, bits 2, M = 17); session 37's rule was 2.0 % and 61 % off on the same data
// (Llama-3-70B q/k/v at TP 4, bits 2), and taking every N of 2560..8192 from 17 rows 0.37 % and
// 17 % (Llama-3-8B down at bits 3; benchmarks/results/wgmma_pairs_s38_fit.py).
// Session 48 re-scored it on that session's kernels (H200, harness "rows" graph-timed with PDL, as
// JAX runs them, both kernels on every case; benchmarks/results/dispatch_s48_check.py): 0.48 % off
// the faster kernel on average over 168 cases at M = 17..32, 8.3 % at worst (Qwen3 q, bits 2), and
// the wgmma kernel the faster on every case at 48 and 64. Left as it is.
// The environment overrides the range for every N and bits (KBIT_JAX_WGMMA_MIN_M / _MAX_M, read
// once per process; MIN_M=0: never).
constexpr int kWgmmaMinRows = 33, kWgmmaEarlyMinRows = 17, kWgmmaMaxRows = 1024, kWgmmaWideBitsMaxRows = 512;
// Early: bits 5 at any N; else N >= 2560 with K * N <= 48 Mi weights, or N of 5120..8192.
constexpr int kWgmmaEarlyBits = 5, kWgmmaEarlyMinN = 2560;
constexpr int64_t kWgmmaEarlyMaxWeights = int64_t(48) << 20;
constexpr int kWgmmaEarlyBandMinN = 5120, kWgmmaEarlyBandMaxN = 8192;
int env_or(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : fallback;
}
std::pair<int, int> wgmma_rule_rows(int64_t n, int64_t k, int bits) {
  const bool early = bits >= kWgmmaEarlyBits ||
                     (n >= kWgmmaEarlyMinN && (k * n <= kWgmmaEarlyMaxWeights ||
                                               (n >= kWgmmaEarlyBandMinN && n <= kWgmmaEarlyBandMaxN)));
  return {early ? kWgmmaEarlyMinRows : kWgmmaMinRows, bits >= kWgmmaEarlyBits ? kWgmmaWideBitsMaxRows : kWgmmaMaxRows};
}

// The module has the wgmma kernel (CMake compiled the sm_90a target: KBIT_WGMMA) and the current
// device runs it (compute capability 9.0; sm_90a code runs nowhere else).
bool wgmma_available() {
#if defined(KBIT_WGMMA)
  static std::atomic<int> cache[kMaxDevices];  // 0: unknown, 1: yes, 2: no
  const int dev = current_device();
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0, minor = 0;
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess;
    v = ok && major == 9 && minor == 0 ? 1 : 2;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v == 1;
#else
  return false;
#endif
}

std::pair<int, int> wgmma_rows_here(int64_t n, int64_t k, int bits) {
  static const int forced_min = env_or("KBIT_JAX_WGMMA_MIN_M", -1), forced_max = env_or("KBIT_JAX_WGMMA_MAX_M", -1);
  const auto [rule_min, rule_max] = wgmma_rule_rows(n, k, bits);
  const int lo = forced_min >= 0 ? forced_min : rule_min;
  if (!wgmma_available() || lo <= 0) return {0, 0};
  return {lo, forced_max >= 0 ? forced_max : rule_max};
}

// bf16 or fp16 activations, the fragment layout and 16-byte rows (N % 16 == 0); tuning->variant 3
// forces it where it applies, 0..2 and -2 keep matmul_fused.cuh's kernels.
bool use_wgmma(const MatmulArgs& a, const MatmulTuning* tuning) {
  if ((a.dtype != DType::kBF16 && a.dtype != DType::kF16) || a.layout != kbit::kFragment || a.n % 16 != 0 ||
      !wgmma_available())
    return false;
  if (tuning && tuning->variant != -1) return tuning->variant == 3;
  const auto [lo, hi] = wgmma_rows_here(a.n, a.k, a.bits);
  return lo > 0 && a.m >= lo && a.m <= hi;
}

// The fused kernel needs 16-bit activations (float32 activations keep float32 accuracy on the
// generic path) and the fragment layout; any B, M, K (multiple of 32) and N.
std::string matmul_path(const MatmulArgs& a) {
  if (a.dtype == DType::kF32) return "generic (float32 activations)";
  if (a.layout != kbit::kFragment) return "generic (layout 0: planes; convert to the fragment layout for speed)";
  return "fused";
}

std::string launch_matmul(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) {
  if (a.batch == 0 || a.m == 0 || a.n == 0) return std::string();  // nothing to write
  const bool fused = matmul_path(a) == "fused" && !(tuning && tuning->force_generic);
  if (!fused) return launch_matmul_generic(a, stream);
  if (use_wgmma(a, tuning))
    return KBIT_BITS_SWITCH(a.bits, BITS, [&] { return wgmma::launch_wgmma_bits<BITS>(a, stream, tuning); });
  return KBIT_BITS_SWITCH(a.bits, BITS, [&] { return fused::launch_fused_bits<BITS>(a, stream, tuning); });
}

std::string compiled_archs() {
#ifdef __CUDA_ARCH_LIST__
  // nvcc defines the list as compute capabilities times ten (900 for sm_90).
  constexpr int archs[] = {__CUDA_ARCH_LIST__};
  std::string out;
  for (int a : archs) out += (out.empty() ? "" : ",") + std::to_string(a / 10);
  return out;
#else
  return "unknown";
#endif
}

std::string compiled_cuda_version() {
  return std::to_string(__CUDACC_VER_MAJOR__) + "." + std::to_string(__CUDACC_VER_MINOR__);
}

}  // namespace kbit::cuda
