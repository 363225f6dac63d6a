// Many buffers copied in one launch: the bucket packing of jax_blink_pack and jax_blink_unpack
// (cuda/pack.cu). A bucket's leaves go into one flat buffer for the all-reduce and back out of it,
// one kernel each way instead of XLA's concatenation and slices (bucket_packing="kernel"; NOTES,
// change 29).
//
// The table of (src, dst, bytes) triples travels by value as the kernel's parameter (under the 4 KB
// every CUDA version takes), so a launch needs no device memory of its own and no host copy. Row
// y of the grid copies segment y; its blocks stride over the segment's bytes in the widest unit
// that both pointers and the length allow (16 bytes for XLA's buffers and the packed offsets that
// keep their alignment, down to single bytes for a leaf that starts off 2 bytes).
#pragma once

#include <cstdint>

namespace jax_blink::cuda {

constexpr int kMaxSegments = 96;  // 96 x 24 bytes + 4: 2.3 KB of parameters per launch

struct SegmentTable {
  int32_t count;
  const void* src[kMaxSegments];
  void* dst[kMaxSegments];
  int64_t bytes[kMaxSegments];
};

namespace {

template <class T>
__device__ __forceinline__ void copy_units(const void* src, void* dst, int64_t units, int64_t first,
                                           int64_t stride) {
  const T* s = static_cast<const T*>(src);
  T* d = static_cast<T*>(dst);
  for (int64_t i = first; i < units; i += stride) d[i] = s[i];
}

__global__ void copy_segments_kernel(const SegmentTable t) {
  const int y = static_cast<int>(blockIdx.y);
  if (y >= t.count) return;
  const char* src = static_cast<const char*>(t.src[y]);
  char* dst = static_cast<char*>(t.dst[y]);
  const int64_t n = t.bytes[y];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uintptr_t a = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  if ((a & 15u) == 0) {
    const int64_t v = n / 16;
    copy_units<uint4>(src, dst, v, first, stride);
    copy_units<uint8_t>(src + 16 * v, dst + 16 * v, n - 16 * v, first, stride);
  } else if ((a & 7u) == 0 && n % 8 == 0) {
    copy_units<uint64_t>(src, dst, n / 8, first, stride);
  } else if ((a & 3u) == 0 && n % 4 == 0) {
    copy_units<uint32_t>(src, dst, n / 4, first, stride);
  } else if ((a & 1u) == 0 && n % 2 == 0) {
    copy_units<uint16_t>(src, dst, n / 2, first, stride);
  } else {
    copy_units<uint8_t>(src, dst, n, first, stride);
  }
}

}  // namespace
}  // namespace jax_blink::cuda
