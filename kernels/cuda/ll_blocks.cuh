// LL reduce-scatter and all-gather (Mode::kLLBlocks): the LL all-reduce's one hop (data and flag
// in one 8-byte store, cuda/device_kernels.cuh's ll_kernel) for the two collectives whose rank r
// needs only block r of the others' operands (reduce-scatter) or gives only its own block
// (all-gather). Included by cuda/device_kernels.cuh after the LL all-reduce, whose prologue,
// inbox, waits and line helpers it uses.
//
// ## Layout
// The operand is n blocks of B bytes (B a multiple of the element size); block j belongs to rank j.
// Rank r's inbox slot for peer s (parity k & 1) holds the LL lines of one block: line i is bytes
// [8i, 8i + 8) of that block, cut at B (zeros past it), so lines never straddle two blocks and
// hold whole elements. A block that starts off 8 bytes (B not a multiple of 8) is read and written
// a byte at a time (load_line, store_line): small calls only.
//   reduce-scatter (p.os_shape == kShapeReduceScatter): rank r writes block j of its `in` into rank
//     j's slot for r, for every j != r; then reduces block r in rank order (its own `in` for
//     itself, the slot for s for peer s) into block r of `out`. The other blocks of `out` are not
//     written (the caller keeps block r only).
//   all-gather (kShapeAllGather): rank r writes block r of its `in` into every peer's slot for r
//     (and into block r of `out` where `out` is not `in`); then copies each peer s's slot into
//     block s of `out`.
// Every rank receives from every peer in every call, so the LL all-reduce's argument for two
// inbox slots without a flag back holds unchanged (cuda/executor.cu, "One-shot all-reduce"), also
// when the communicator's one-shot sites of the three shapes interleave.
#pragma once

namespace jax_blink::cuda {
namespace {

constexpr int32_t kShapeReduceScatter = 1, kShapeAllGather = 2;

template <class E, class Op>
__global__ void __launch_bounds__(kThreads, 1) ll_blocks_kernel(const Params p) {
  __shared__ Shared sh;
  const int64_t B = p.os_block_bytes;  // bytes per block, a multiple of the element size
  const int64_t lines = (B + 7) / 8;
  const bool scatter = p.os_shape == kShapeReduceScatter;
  const uint8_t* in = static_cast<const uint8_t*>(p.in);
  uint8_t* out = static_cast<uint8_t*>(p.out);
  auto at8 = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 7u) == 0; };
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  // The element a line starts at, in the whole operand (for the error record).
  auto elem_at = [B](int block, int64_t i) {
    return (block * B + 8 * i) / static_cast<int64_t>(sizeof(typename E::S));
  };
  if (oneshot_begin(p, sh)) {
    const int n = p.nranks, me = p.rank;
    const uint32_t k = sh.k, f0 = k, f1 = k ^ p.os_site;
    const int par = static_cast<int>(k & 1u);
    const uint8_t* mine = in + me * B;
    // Sends: the peer's block (reduce-scatter) or this rank's own (all-gather), line by line.
    for (int64_t i = first; i < lines; i += stride) {
      const uint2 own = scatter ? make_uint2(0, 0) : load_line(mine, i, B, at8(mine));
      if (!scatter && out != in) store_line(out + me * B, i, B, at8(out + me * B), own);
      for (int dst = 0; dst < n; ++dst) {
        if (dst == me) continue;
        const uint2 d = scatter ? load_line(in + dst * B, i, B, at8(in + dst * B)) : own;
        uint4* line = reinterpret_cast<uint4*>(stg_data(p, sh.stg_peer[dst], par, inbox_slot(me, dst))) + i;
        sync::st_volatile_v4(line, d.x, f0, d.y, f1);
      }
    }
    bool ok = true;
    for (int64_t i = first; ok && i < lines; i += stride) {
      if (scatter) {
        LineAcc<E, Op> acc;
        for (int src = 0; ok && src < n; ++src) {
          uint2 d;
          if (src == me) {
            d = load_line(mine, i, B, at8(mine));
          } else {
            const uint4* line = reinterpret_cast<const uint4*>(stg_data(p, p.stg, par, inbox_slot(src, me))) + i;
            ok = ll_wait(p, sh, line, f0, f1, src, elem_at(me, i), &d);
          }
          if (src == 0) acc.set(d);
          else acc.add(d);
        }
        if (ok) store_line(out + me * B, i, B, at8(out + me * B), acc.get());
      } else {
        for (int src = 0; ok && src < n; ++src) {
          if (src == me) continue;
          uint2 d;
          const uint4* line = reinterpret_cast<const uint4*>(stg_data(p, p.stg, par, inbox_slot(src, me))) + i;
          ok = ll_wait(p, sh, line, f0, f1, src, elem_at(src, i), &d);
          if (ok) store_line(out + src * B, i, B, at8(out + src * B), d);
        }
      }
    }
    fail_if_a_peer_gave_up(p, sh);
  }
  oneshot_end(p, sh);
}

}  // namespace
}  // namespace jax_blink::cuda
