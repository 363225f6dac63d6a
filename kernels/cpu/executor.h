// CPU back end of the FFI target "jax_blink_collective": XLA host devices (one host thread each)
// meet at an in-process rendezvous per (comm_id, group) and run the schedule of common/program.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

// The typed-FFI handler (XLA_FFI_DEFINE_HANDLER_SYMBOL in cpu/executor.cc). Binding:
//   Ctx<DeviceOrdinal>, Ctx<RunId> (matches calls of one launch), Arg<AnyBuffer> x, Arg<Buffer<S32>> rank, Arg<Buffer<S32>> group,
//   Ret<AnyBuffer> out, Attr<Span<const int32_t>> program, Attr<int32_t> op,
//   Attr<int64_t> comm_id, Attr<int64_t> timeout_ms, Attr<float> host_share (ignored here: on
//   host devices all memory is host memory, there is no second channel).
extern "C" XLA_FFI_Error* JaxBlinkCollectiveCpu(XLA_FFI_CallFrame* call_frame);

namespace jax_blink::cpu {

// Drops the state of every communicator. Returns an empty string on success; when a call is in
// flight it drops nothing and returns why.
std::string ResetAll();

// Number of (comm_id, group) communicators that have state.
size_t NumComms();

// What one communicator looks like now, for tests and debugging.
struct CommStatus {
  bool exists = false;
  bool configured = false;      // has its program (from its first call)
  int nranks = 0;
  int in_flight = 0;            // calls inside the handler now
  uint64_t failures = 0;        // calls that failed since the communicator was made
  uint64_t in_place_calls = 0;  // calls whose operand was their result's buffer (donation)
  int open_calls = 0;           // calls some rank has not been through yet
  int failed_calls = 0;         // of those, failed ones (a rank never joined them)
  std::vector<uint64_t> calls;  // per rank: calls made since the communicator was made
};
CommStatus Status(int64_t comm_id, int32_t group);

const char* Version();

}  // namespace jax_blink::cpu
