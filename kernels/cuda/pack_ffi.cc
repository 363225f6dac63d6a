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

// The segments between `flat` and the buffers of `parts` (pack: parts -> flat, else flat -> parts).
template <class Parts>
ffi::Error Segments(const char* what, ffi::DataType dt, void* flat, size_t flat_bytes, size_t count, Parts part,
                    bool pack, std::vector<jax_blink::cuda::Segment>* out) {
  size_t offset = 0;
  for (size_t i = 0; i < count; ++i) {
    auto [data, type, bytes, ok] = part(i);
    if (!ok) return ffi::Error::InvalidArgument(std::string(what) + ": operand or result " + std::to_string(i) + " is not a buffer");
    if (type != dt)
      return ffi::Error::InvalidArgument(std::string(what) + ": every operand and result must have one dtype");
    if (offset + bytes > flat_bytes) break;
    char* at = static_cast<char*>(flat) + offset;
    out->push_back(pack ? jax_blink::cuda::Segment{data, at, static_cast<int64_t>(bytes)}
                        : jax_blink::cuda::Segment{at, const_cast<void*>(data), static_cast<int64_t>(bytes)});
    offset += bytes;
  }
  if (offset != flat_bytes)
    return ffi::Error::InvalidArgument(std::string(what) + ": the parts' lengths do not add up to the flat buffer's (" +
                                       std::to_string(offset) + " bytes counted, " + std::to_string(flat_bytes) + " flat)");
  return ffi::Error::Success();
}

ffi::Error Run(const std::vector<jax_blink::cuda::Segment>& segments, cudaStream_t stream) {
  std::string err = jax_blink::cuda::CopySegments(segments, stream);
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(err);
}

ffi::Error Pack(cudaStream_t stream, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> flat) {
  std::vector<jax_blink::cuda::Segment> segments;
  auto part = [&](size_t i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return std::tuple<const void*, ffi::DataType, size_t, bool>{nullptr, flat->element_type(), 0, false};
    return std::tuple<const void*, ffi::DataType, size_t, bool>{b->untyped_data(), b->element_type(), b->size_bytes(), true};
  };
  if (ffi::Error e = Segments("jax_blink_pack", flat->element_type(), flat->untyped_data(), flat->size_bytes(),
                              args.size(), part, true, &segments);
      e.failure())
    return e;
  return Run(segments, stream);
}

ffi::Error Unpack(cudaStream_t stream, ffi::AnyBuffer flat, ffi::RemainingRets rets) {
  std::vector<jax_blink::cuda::Segment> segments;
  auto part = [&](size_t i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return std::tuple<const void*, ffi::DataType, size_t, bool>{nullptr, flat.element_type(), 0, false};
    return std::tuple<const void*, ffi::DataType, size_t, bool>{(*b)->untyped_data(), (*b)->element_type(),
                                                                (*b)->size_bytes(), true};
  };
  if (ffi::Error e = Segments("jax_blink_unpack", flat.element_type(), flat.untyped_data(), flat.size_bytes(),
                              rets.size(), part, false, &segments);
      e.failure())
    return e;
  return Run(segments, stream);
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
