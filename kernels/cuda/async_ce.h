// The copy-engine form of the asynchronous all-reduce (cuda/async_ce.cc), chosen by
// JAX_BLINK_ASYNC_ENGINE=ce when a site is set up: what async_ffi.cc's start handler calls.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cuda/executor.h"

namespace jax_blink::cuda_async {

// JAX_BLINK_ASYNC_ENGINE: unset, "" or "sm" -> false (the executor's kernel), "ce" -> true (copy
// engines); anything else -> an error message naming the value and what it takes.
std::string AsyncEngineIsCopyEngines(bool* ce);

// The pieces each chunk is cut into, so that reductions and copies overlap
// (JAX_BLINK_CE_PIECE_BYTES overrides).
constexpr int64_t kDefaultPieceBytes = int64_t{16} << 20;
// The first of JAX_BLINK_ASYNC_ENGINE, JAX_BLINK_CE_PIECE_BYTES, JAX_BLINK_CE_SCATTER and
// JAX_BLINK_CE_GATHER whose value is not understood, as an error message; "" when all are fine.
// No GPU needed.
std::string CheckCopyEngineEnvironment();

// One call of rank `rank` of `nranks` (one process, one GPU each) of call site `comm_id`: a
// reduce-scatter and an all-gather whose transfers are copy-engine copies (cudaMemcpyPeerAsync, one
// stream per peer, in pieces of JAX_BLINK_CE_PIECE_BYTES; each phase pulls, or pushes with
// JAX_BLINK_CE_SCATTER=push / JAX_BLINK_CE_GATHER=push: read when the site's first call makes its
// group) and whose
// reduction is a kernel of `blocks` blocks (0: every SM), all ordered by `side`, which must already
// follow XLA's stream. The ranks meet on the host at every call (every wait within `timeout_ms`),
// so that each waits on its peers' events of the same call. `in` and `out` must stay untouched
// until `side` has passed what this enqueues. Returns "" or an error; after a rank timed out the
// collective fails from then on (until ResetCopyEngines).
std::string StartWithCopyEngines(int64_t comm_id, int rank, int nranks, int device, jax_blink::cuda::DType dtype,
                                 int32_t op, const void* in, void* out, int64_t elems, int esize, int blocks,
                                 cudaStream_t side, int64_t timeout_ms);

// Forgets every copy-engine collective (its call counts, a recorded time-out, its events), so that
// the next call starts afresh. Only when no collective runs (module reset(), after every GPU has
// been waited for).
std::string ResetCopyEngines();

}  // namespace jax_blink::cuda_async
