// The tile of one CTA of the grouped wgmma kernel (kbit_ragged_dot; matmul_wgmma.cuh's grouped
// mode), found on the device from group_sizes: expert g with R_g rows (clamped prefix sums,
// negative sizes counting as 0, as ragged_schedule.cuh) owns ceil(R_g / BM) row tiles x n_tiles
// column tiles, numbered expert by expert, and within an expert by column tile, row tile fastest.
// The launch has an upper bound of CTAs, (ceil(M / BM) + min(G, M)) x n_tiles; CTA i takes tile i
// or, past the device-side count, none. No [G]-sized array: each thread owns a contiguous range of
// experts, two block-wide scans give its range's first row and first tile, and the thread whose
// range holds tile i publishes it through a few words of shared memory.
#pragma once

#include <cstdint>

#include "cuda/ragged_schedule.cuh"

namespace kbit::cuda::ragged {

struct GroupTile {
  int g, mt, nt;           // the expert, the row tile within its rows, the column tile
  int row_start, row_end;  // the expert's rows [row_start, row_end), clamped to M
  int total_rows;          // min(sum(group_sizes), M): rows from here on are zeros
  bool valid;              // false: past the last tile (the CTA only helps write the zero rows)
};

// Called by every thread of the CTA (blockDim.x a multiple of 32, at most 1024) before anything
// else uses `smem` (32 long longs and 5 ints of scratch, free again on return).
template <int BM>
__device__ inline GroupTile group_tile(const int32_t* __restrict__ group_sizes, int G, int64_t M, int n_tiles,
                                       int tile, uint8_t* smem) {
  long long* scratch = reinterpret_cast<long long*>(smem);
  int* pub = reinterpret_cast<int*>(smem + 32 * sizeof(long long));
  const int per = (G + int(blockDim.x) - 1) / int(blockDim.x);
  const int g0 = min(G, int(threadIdx.x) * per), g1 = min(G, g0 + per);
  long long local_rows = 0;
  for (int g = g0; g < g1; ++g) local_rows += max(__ldg(group_sizes + g), 0);
  long long total_rows;
  const long long rows_before = block_exclusive_scan(local_rows, scratch, total_rows);
  // the row tiles of this thread's experts, over their clamped rows
  long long local_tiles = 0, run = rows_before;
  for (int g = g0; g < g1; ++g) {
    const long long rs = min(run, (long long)M);
    run += max(__ldg(group_sizes + g), 0);
    local_tiles += (min(run, (long long)M) - rs + BM - 1) / BM;
  }
  long long total_tiles;
  const long long tiles_before = block_exclusive_scan(local_tiles, scratch, total_tiles);
  GroupTile t;
  t.total_rows = int(min(total_rows, (long long)M));
  t.valid = tile < total_tiles * n_tiles;  // (CTA-uniform)
  if (!t.valid) return t;
  long long first = tiles_before * n_tiles;
  if (tile >= first && tile < first + local_tiles * n_tiles) {
    run = rows_before;
    for (int g = g0; g < g1; ++g) {
      const long long rs = min(run, (long long)M);
      run += max(__ldg(group_sizes + g), 0);
      const long long re = min(run, (long long)M);
      const int mtg = int((re - rs + BM - 1) / BM);
      if (tile < first + (long long)mtg * n_tiles) {
        const int local = int(tile - first), nt = local / mtg;
        pub[0] = g;
        pub[1] = local - nt * mtg;
        pub[2] = nt;
        pub[3] = int(rs);
        pub[4] = int(re);
        break;
      }
      first += (long long)mtg * n_tiles;
    }
  }
  __syncthreads();
  t.g = pub[0];
  t.mt = pub[1];
  t.nt = pub[2];
  t.row_start = pub[3];
  t.row_end = pub[4];
  __syncthreads();  // (the caller may overwrite the scratch)
  return t;
}

}  // namespace kbit::cuda::ragged
