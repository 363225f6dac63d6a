// The bucket packing's copies (cuda/pack.cu, kernel in cuda/segments.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace jax_blink::cuda {

struct Segment {
  const void* src;
  void* dst;
  int64_t bytes;
};

// Enqueues every copy on `stream` (a few launches: kMaxSegments per launch); segments of no bytes
// or whose src is dst are skipped. "" or what failed.
std::string CopySegments(const std::vector<Segment>& segments, cudaStream_t stream);

}  // namespace jax_blink::cuda
