// CUDA back end of "jax_blink_collective_ipc": an all-reduce whose ranks live in several processes
// (one process per GPU, or processes sharing a GPU), through CUDA IPC.
//
// Set-up (once per call site, at trace time, from jax_blink/distributed.py): every local rank
// registers a region on its GPU (an inbox of 2 parities x nranks slots of the operand's size, and
// one flag per peer), exports its IPC handle through the job's key-value store, and opens its
// peers' handles (never per call). Per call: one kernel pushes this rank's operand into slot
// [rank] of every peer's inbox and stores this call's number into the peer's flag [rank]; a second
// kernel waits for every peer's flag in its own region (time budget on %globaltimer) and reduces
// the nranks slots in rank order, so every rank ends with the same bits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

// Binding: Ctx<PlatformStream<cudaStream_t>>, Ctx<DeviceOrdinal>, Arg x, Arg<S32> rank,
// Arg<S32> group, Ret out, Attr program (read for its element count), Attr<int32_t> op,
// Attr<int64_t> comm_id, Attr<int64_t> timeout_ms, Attr<float> host_share (ignored),
// Attr<Span<const int32_t>> rank_process, rank_device, Attr<int64_t> setup_timeout_ms (ignored:
// the set-up ran at trace time).
extern "C" XLA_FFI_Error* JaxBlinkCollectiveIpc(XLA_FFI_CallFrame* call_frame);

namespace jax_blink::cuda_ipc {

// Registers rank `rank` of (comm_id, group) on CUDA device `device`: allocates its region for
// operands of `bytes` bytes among `nranks` ranks. Returns the payload its peers need (the IPC
// handle, this process's pid, the region's address) in `payload`, or an error message.
std::string Create(int64_t comm_id, int32_t group, int32_t rank, int32_t nranks, int64_t bytes,
                   int device, std::vector<uint8_t>* payload);

// Opens peer `peer`'s region for local rank (comm_id, group, rank) from its payload: through
// cudaIpcOpenMemHandle, or the address itself when the peer lives in this process (then the two
// devices need peer access, or to be the same device). Returns an error message where CUDA refuses
// (processes in separate containers, no peer access...).
std::string Open(int64_t comm_id, int32_t group, int32_t rank, int32_t peer,
                 const std::vector<uint8_t>& payload);

// Whether a rank of this call site is registered on `device` (set-up done in this process).
bool Registered(int64_t comm_id, int device);

// Frees every region and closes every opened handle (no call may be running).
void ReleaseAll();

}  // namespace jax_blink::cuda_ipc
