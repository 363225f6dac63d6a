// The launches of cuda/segments.cuh: a list of copies cut into tables of kMaxSegments.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/pack.h"
#include "cuda/segments.cuh"

namespace jax_blink::cuda {

std::string CopySegments(const std::vector<Segment>& segments, cudaStream_t stream) {
  constexpr int kThreads = 256;
  constexpr int kMaxBlocksPerSegment = 264;  // 2 per SM of an H100/H200: a large leaf copies at HBM speed
  size_t i = 0;
  while (i < segments.size()) {
    SegmentTable t{};
    int64_t largest = 0;
    for (; i < segments.size() && t.count < kMaxSegments; ++i) {
      const Segment& s = segments[i];
      if (s.bytes <= 0 || s.src == s.dst) continue;
      t.src[t.count] = s.src;
      t.dst[t.count] = s.dst;
      t.bytes[t.count] = s.bytes;
      largest = std::max(largest, s.bytes);
      ++t.count;
    }
    if (t.count == 0) continue;
    // 16 bytes per thread and pass, 4 passes per block before a second block is worth it.
    const int64_t per_block = int64_t(kThreads) * 16 * 4;
    const int blocks = static_cast<int>(std::min<int64_t>((largest + per_block - 1) / per_block, kMaxBlocksPerSegment));
    copy_segments_kernel<<<dim3(blocks, t.count), kThreads, 0, stream>>>(t);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return std::string("launching the packing copy: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
  }
  return {};
}

}  // namespace jax_blink::cuda
