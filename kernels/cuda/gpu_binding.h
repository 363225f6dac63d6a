// The CUDA handlers' bindings: the stream and the device ordinal in front of the lists every back
// end shares (common/ffi_binding.h). module.cc registers the collective through them and
// bench_probes.cc registers handlers that do nothing through the same ones, so that what the
// benchmark measures is XLA's price of exactly the shipped bindings.
#pragma once

#include <cuda_runtime_api.h>

#include "common/ffi_binding.h"
#include "cuda/executor.h"
#include "xla/ffi/api/ffi.h"

namespace jax_blink::cuda {

// The executor's element type of an XLA buffer's; false for a type the executor does not take.
inline bool ToDType(xla::ffi::DataType dt, DType* out) {
  using xla::ffi::DataType;
  switch (dt) {
    case DataType::F32: *out = DType::kF32; return true;
    case DataType::F64: *out = DType::kF64; return true;
    case DataType::BF16: *out = DType::kBF16; return true;
    case DataType::F16: *out = DType::kF16; return true;
    case DataType::S32: *out = DType::kS32; return true;
    case DataType::S64: *out = DType::kS64; return true;
    default: return false;
  }
}

}  // namespace jax_blink::cuda

#define JAX_BLINK_GPU_CONTEXTS \
  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>().Ctx<xla::ffi::DeviceOrdinal>()

// The full binding: every attribute on every call.
#define JAX_BLINK_BINDING JAX_BLINK_GPU_CONTEXTS JAX_BLINK_OPERANDS JAX_BLINK_CALL_ATTRS

// The light binding: what a call site fixes is registered by comm_id (register_call_site).
#define JAX_BLINK_LITE_BINDING JAX_BLINK_GPU_CONTEXTS JAX_BLINK_OPERANDS.Attr<int64_t>("comm_id")
