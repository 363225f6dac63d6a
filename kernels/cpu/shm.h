// CPU back end of "jax_blink_collective_mp": the collective's ranks live in several processes of
// one machine (a jax.distributed job) and meet in a POSIX shared-memory segment per communicator.
// The program format (common/program.h), the semantics and the time budget are the CPU executor's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

// The typed-FFI handler. Binding: the CPU executor's (cpu/executor.h) plus two attributes from the
// mesh at lowering time, for messages only: Attr<Span<const int32_t>> rank_process and
// rank_device, indexed [group * nranks + rank] (-1 where the lowering did not know them), and
// Attr<int64_t> setup_timeout_ms, the budget of a communicator's set-up (its first call).
extern "C" XLA_FFI_Error* JaxBlinkCollectiveShm(XLA_FFI_CallFrame* call_frame);

// "jax_blink_after": Arg x, Arg dep, Ret out = x (aliased where XLA allows). Runs after `dep`
// exists: ties a collective's operand to the previous collective's result, so that every process
// runs a program's collectives in one order.
extern "C" XLA_FFI_Error* JaxBlinkAfterCpu(XLA_FFI_CallFrame* call_frame);

namespace jax_blink::shm {

// This process's place in the job: `job_key` (hex, from the job's key-value store: the same in
// every process of one job, different in every job) names the segments; `process_index` is
// jax.process_index(). Must be called before the first call; a second call with another key
// fails (segments of one job are named by one key).
std::string SetJob(const std::string& job_key, int process_index);

// Unlinks the segments this process created or opened that are still linked (a set-up that never
// completed) and unmaps every segment when nothing runs. Returns what it unlinked.
std::vector<std::string> Cleanup();

// Names of segments this process knows that are still linked (for tests).
std::vector<std::string> LinkedSegments();

}  // namespace jax_blink::shm
