// CUDA back end of "jax_blink_collective_ipc": every collective (all-reduce, all-gather,
// reduce-scatter, broadcast, reduce) whose ranks live in several processes (one process per GPU,
// or processes sharing a GPU), through CUDA IPC.
//
// Set-up (once per call site, at trace time, from jax_blink/distributed.py): every local rank
// registers a region on its GPU (an inbox of 2 parities x the slots its collective needs, and one
// flag per peer), exports its IPC handle through the job's key-value store, and opens its peers'
// handles (never per call). Per call: one kernel pushes this rank's data into the inboxes of the
// ranks that need it and stores this call's number into flag [rank] of every rank; a second
// kernel waits for every rank's flag in its own region (time budget on %globaltimer) and reduces
// (in rank order, so ranks get the same bits) or copies its inbox into the result. Layouts and
// the flag protocol: cuda/ipc.cu.
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

// The collective of a call site, as jax_blink/distributed.py numbers them (IPC_COLLECTIVES).
// Operand and result have the same size; all_gather's operand holds this rank's piece at piece
// [rank] (and its result every rank's piece in rank order), reduce_scatter's result holds the
// reduction of piece [rank] there (its other pieces are left as they were).
enum class Collective : int32_t { kAllReduce = 0, kAllGather = 1, kReduceScatter = 2, kBroadcast = 3, kReduce = 4 };
constexpr int kNumCollectives = 5;

// Registers rank `rank` of (comm_id, group) on CUDA device `device`: allocates its region for
// `kind` (rooted at `root`: broadcast, reduce) over operands of `bytes` bytes among `nranks`
// ranks; `processes` (every rank's process index, or empty) names ranks in error messages.
// Returns the payload its peers need (the IPC handle, this process's pid, the region's address)
// in `payload`, or an error message.
std::string Create(int64_t comm_id, int32_t group, int32_t rank, int32_t nranks, int64_t bytes,
                   int device, Collective kind, int32_t root, const std::vector<int32_t>& processes,
                   std::vector<uint8_t>* payload);

// Opens peer `peer`'s region for local rank (comm_id, group, rank) from its payload: through
// cudaIpcOpenMemHandle, or the address itself when the peer lives in this process (then the two
// devices need peer access, or to be the same device). Returns an error message where CUDA refuses
// (processes in separate containers, no peer access...).
std::string Open(int64_t comm_id, int32_t group, int32_t rank, int32_t peer,
                 const std::vector<uint8_t>& payload);

// Whether a rank of this call site is registered on `device` (set-up done in this process).
bool Registered(int64_t comm_id, int device);

// The error of every collective of this process whose wait ran past its budget, naming the rank
// and process it waited for ("" if none). Sticky: such a collective fails from then on.
std::string CheckAll();

// Frees every region and closes every opened handle (no call may be running).
void ReleaseAll();

// For every collective that failed (a wait ran past its budget) or went stale: closes its handles of the peers'
// regions and frees its own, keeping its error record, so that it still fails with its message
// and holds no memory. Returns an error message where CUDA refuses ("" if none); none may be
// running. Also releases the collectives that Open marked stale (a peer's region replaced).
std::string ReleaseFailed();

}  // namespace jax_blink::cuda_ipc
