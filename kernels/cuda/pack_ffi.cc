// jax_blink_pack / jax_blink_unpack: a bucket's leaves into one flat buffer and back, in one
// kernel on XLA's stream (cuda/segments.cuh), for the executor's all-reduce of a bucket
// (jax_blink/lowering/packing.py, bucket_packing="kernel"), in place of XLA's concatenation and
// slices. Off by default: measured slower than XLA's packing, which XLA fuses into the gradients'
// producers and the update (NOTES, change 29).
//
//   jax_blink_pack(x_1, ..., x_k) -> flat        flat = the x_i's elements one after another
//   jax_blink_unpack(flat) -> (x_1, ..., x_k)    the inverse, shapes from the results
//
// Every operand and result has one dtype; the lengths must add up. Neither handler keeps state
// or synchronises. Neither claims the command-buffer trait (not measured inside one yet).
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "cuda/pack.h"
#include "cuda/pack_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace jax_blink::cuda_pack {
namespace {

// One operand or result of a handler: where its bytes are, its dtype and length.
struct Part {
  void* data;
  ffi::DataType type;
  size_t bytes;
};

ffi::Error NotABuffer(const char* what, size_t i) {
  return ffi::Error::InvalidArgument(std::string(what) + ": operand or result " + std::to_string(i) + " is not a buffer");
}

// Copies between `flat` and `parts` in one kernel (pack: parts -> flat, else flat -> parts), once
// every part has flat's dtype and their lengths add up to flat's.
ffi::Error Copy(const char* what, ffi::AnyBuffer flat, const std::vector<Part>& parts, bool pack, cudaStream_t stream) {
  std::vector<jax_blink::cuda::Segment> segments;
  size_t offset = 0;
  for (const Part& p : parts) {
    if (p.type != flat.element_type())
      return ffi::Error::InvalidArgument(std::string(what) + ": every operand and result must have one dtype");
    if (offset + p.bytes <= flat.size_bytes()) {
      char* at = static_cast<char*>(flat.untyped_data()) + offset;
      segments.push_back(pack ? jax_blink::cuda::Segment{p.data, at, static_cast<int64_t>(p.bytes)}
                              : jax_blink::cuda::Segment{at, p.data, static_cast<int64_t>(p.bytes)});
    }
    offset += p.bytes;
  }
  if (offset != flat.size_bytes())
    return ffi::Error::InvalidArgument(std::string(what) + ": the parts' lengths do not add up to the flat buffer's (" +
                                       std::to_string(offset) + " bytes counted, " +
                                       std::to_string(flat.size_bytes()) + " flat)");
  std::string err = jax_blink::cuda::CopySegments(segments, stream);
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(err);
}

ffi::Error Pack(cudaStream_t stream, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> flat) {
  std::vector<Part> parts;
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return NotABuffer("jax_blink_pack", i);
    parts.push_back({b->untyped_data(), b->element_type(), b->size_bytes()});
  }
  return Copy("jax_blink_pack", *flat, parts, true, stream);
}

ffi::Error Unpack(cudaStream_t stream, ffi::AnyBuffer flat, ffi::RemainingRets rets) {
  std::vector<Part> parts;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return NotABuffer("jax_blink_unpack", i);
    parts.push_back({(*b)->untyped_data(), (*b)->element_type(), (*b)->size_bytes()});
  }
  return Copy("jax_blink_unpack", flat, parts, false, stream);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkPackCuda, Pack,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().RemainingArgs().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkUnpackCuda, Unpack,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().RemainingRets());

void AddTargets(nb::dict& d) {
  d["jax_blink_pack"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkPackCuda));
  d["jax_blink_unpack"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkUnpackCuda));
}

}  // namespace jax_blink::cuda_pack
