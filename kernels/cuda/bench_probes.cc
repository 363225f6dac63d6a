// nanobind module `jax_blink._blink_cuda_probes`: FFI handlers that do nothing, one per binding,
// for benchmarks/xla_call_overhead.py. What a chain of them costs per call is XLA's own price of
// an FFI custom call, to set against the collective's handler plus its kernel. A measuring tool,
// so it is not in the shipped module: CMake builds it with -DJAX_BLINK_BUILD_BENCH_PROBES=ON
// (benchmarks/gpu_session.sh does, for its step overhead).
//
//   jax_blink_noop       the full binding (JAX_BLINK_BINDING), as "jax_blink_collective";
//   jax_blink_noop_lite  the light binding (JAX_BLINK_LITE_BINDING), as "jax_blink_collective_lite";
//   jax_blink_noop_min   the light binding less the rank and group operands: what dropping them
//                        would save, where the device ordinal could name the rank;
//   jax_blink_noop_bare  one operand, one result, no context, no attribute: what of XLA's price
//                        is the binding's decoding and what is the thunk's.
// Each returns at once; the caller aliases the result to the operand.
#include <nanobind/nanobind.h>

#include "cuda/gpu_binding.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

ffi::Error NoOpFull(cudaStream_t, int32_t, ffi::AnyBuffer, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                    ffi::Result<ffi::AnyBuffer>, ffi::Span<const int32_t>, int32_t, int64_t, int64_t, float) {
  return ffi::Error::Success();
}

ffi::Error NoOpLite(cudaStream_t, int32_t, ffi::AnyBuffer, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                    ffi::Result<ffi::AnyBuffer>, int64_t) {
  return ffi::Error::Success();
}

ffi::Error NoOpMin(cudaStream_t, int32_t, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>, int64_t) {
  return ffi::Error::Success();
}

ffi::Error NoOpBare(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkNoOpCuda, NoOpFull, JAX_BLINK_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkNoOpLiteCuda, NoOpLite, JAX_BLINK_LITE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkNoOpMinCuda, NoOpMin,
                              JAX_BLINK_GPU_CONTEXTS.Arg<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>().Attr<int64_t>(
                                  "comm_id"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxBlinkNoOpBareCuda, NoOpBare,
                              xla::ffi::Ffi::Bind().Arg<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>());

NB_MODULE(_blink_cuda_probes, m) {
  m.doc() = "jax_blink's no-op FFI handlers for benchmarks/xla_call_overhead.py (not part of the executor).";
  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["jax_blink_noop"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkNoOpCuda));
        d["jax_blink_noop_lite"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkNoOpLiteCuda));
        d["jax_blink_noop_min"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkNoOpMinCuda));
        d["jax_blink_noop_bare"] = nb::capsule(reinterpret_cast<void*>(&JaxBlinkNoOpBareCuda));
        return d;
      },
      "FFI target name -> no-op handler capsule, for jax.ffi.register_ffi_target(..., platform='CUDA').");
}
