// An identity custom call for benchmarks/boundary_probe.py: any number of operands, each result
// aliased to its operand (input_output_aliases), so that it costs no copy and no kernel. It stands
// in for a collective's start at the gradients' place, to see how XLA's fusions react to a custom
// call that takes a bucket's leaves as they are rather than packed. Built by the probe at its first
// use: with -DPROBE_CUDA (nvcc) for the CUDA platform, without it (g++) for the host.
#include <cstring>

#include "xla/ffi/api/ffi.h"
#ifdef PROBE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ffi = xla::ffi;

namespace {

// Copies an operand to its result only where XLA did not alias them (it aliases them unless the
// operand is still needed elsewhere, in which case it copies before the call itself).
template <typename Copy>
ffi::Error Identity(ffi::RemainingArgs args, ffi::RemainingRets rets, Copy copy) {
  if (args.size() != rets.size()) return ffi::Error::InvalidArgument("operands and results differ in number");
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("a non-buffer operand");
    if (in->untyped_data() != (*out)->untyped_data()) {
      ffi::Error e = copy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
      if (e.failure()) return e;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

#ifdef PROBE_CUDA
static ffi::Error CudaIdentity(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return Identity(args, rets, [stream](void* dst, const void* src, size_t n) {
    cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream);
    return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
  });
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(BoundaryProbeIdentity, CudaIdentity,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().RemainingArgs().RemainingRets());
#else
static ffi::Error HostIdentity(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return Identity(args, rets, [](void* dst, const void* src, size_t n) {
    std::memcpy(dst, src, n);
    return ffi::Error::Success();
  });
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(BoundaryProbeIdentity, HostIdentity, ffi::Ffi::Bind().RemainingArgs().RemainingRets());
#endif
