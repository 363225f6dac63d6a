// The FFI binding every "jax_blink_collective*" handler shares with the lowering
// (collectives._collective_call): one list, so that a name or type changes in one place.
//
//   JAX_BLINK_OPERANDS       the operand, the rank and group buffers (int32 scalars), the result;
//   JAX_BLINK_CALL_ATTRS     what the full binding carries per call: the schedule program, the op
//                            (0 sum, 1 max, 2 min), the comm_id (one per call site), the time budget
//                            in ms and the hybrid transfer's host share (the CPU back ends accept
//                            and ignore it: on host devices all memory is host memory);
//   JAX_BLINK_PROCESS_ATTRS  where the ranks live, for ranks in several processes (shared memory,
//                            CUDA IPC): every rank's process and device, and the set-up's budget.
// Each back end puts its own contexts (stream, device ordinal, run id) in front.
#pragma once

#include "xla/ffi/api/ffi.h"

#define JAX_BLINK_OPERANDS                      \
  .Arg<xla::ffi::AnyBuffer>()                   \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   \
      .Ret<xla::ffi::AnyBuffer>()

#define JAX_BLINK_CALL_ATTRS                        \
  .Attr<xla::ffi::Span<const int32_t>>("program")   \
      .Attr<int32_t>("op")                          \
      .Attr<int64_t>("comm_id")                     \
      .Attr<int64_t>("timeout_ms")                  \
      .Attr<float>("host_share")

#define JAX_BLINK_PROCESS_ATTRS                          \
  .Attr<xla::ffi::Span<const int32_t>>("rank_process")   \
      .Attr<xla::ffi::Span<const int32_t>>("rank_device")  \
      .Attr<int64_t>("setup_timeout_ms")
