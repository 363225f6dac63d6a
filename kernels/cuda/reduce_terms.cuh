// The reduction of the copy-engine all-reduce (cuda/async_ce.cc through LaunchReduceTerms):
// out = srcs[0] op srcs[1] op ... elementwise, in that order, over terms that copy engines have
// already brought into local memory. No flags, no peers: every block reduces its own 16-byte-aligned
// share of [0, elems) with the executor's combine_range (so the sums are those of the other
// kernels, bit for bit). Included by cuda/device_kernels.cuh after the data movers it uses.
#pragma once

namespace jax_blink::cuda {
namespace {

// LaunchReduceTerms's kernel: block b reduces its 16-byte-aligned share of [0, elems).
struct ReduceTermsArgs {
  void* out;
  const void* src[kMaxRanks];
  int nsrc;
  int64_t elems;
};
template <class E, class Op>
__global__ void __launch_bounds__(kThreads) reduce_terms_kernel(const ReduceTermsArgs a) {
  using S = typename E::S;
  constexpr int64_t kAlign = 16 / sizeof(S);
  const int64_t per = ((a.elems + gridDim.x - 1) / gridDim.x + kAlign - 1) / kAlign * kAlign;
  const int64_t lo = min(a.elems, static_cast<int64_t>(blockIdx.x) * per), hi = min(a.elems, lo + per);
  if (hi <= lo) return;
  const S* rest[kMaxRanks];
  for (int k = 1; k < a.nsrc; ++k) rest[k - 1] = static_cast<const S*>(a.src[k]) + lo;
  combine_range<E, Op>(static_cast<S*>(a.out) + lo, static_cast<const S*>(a.src[0]) + lo, rest, a.nsrc - 1, nullptr,
                       0, hi - lo);
}

}  // namespace
}  // namespace jax_blink::cuda
