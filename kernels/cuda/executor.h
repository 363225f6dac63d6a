// CUDA back end of "jax_blink_collective": communicator set-up, the kernels and their launch.
// No XLA headers here: the FFI handler (cuda/module.cc) is a thin layer over this, and the
// standalone self-test (cuda_selftest.cu) drives it directly. See cuda/executor.cu for the
// protocol, the memory-ordering and the deadlock-freedom arguments.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_blink::cuda {

enum class DType : int32_t { kF32 = 0, kF64 = 1, kBF16 = 2, kF16 = 3, kS32 = 4, kS64 = 5 };
constexpr int kNumDTypes = 6;
int DTypeSize(DType d);
const char* DTypeName(DType d);

struct Options {
  // Blocks per rank (the grid; the same on every rank of a communicator). 0: the smallest SM
  // count of the communicator's devices, or JAX_BLINK_CUDA_BLOCKS from the environment. Ranks
  // that share one GPU (the self-test's N streams of one device) need N * blocks resident at once,
  // which set-up checks.
  int blocks = 0;
  // The executor splits each tree's segment into pieces (its unit of work and of flags), at most
  // the program's chunk (clamped to [min_piece_bytes, 4 MiB]) and at least min_piece_bytes, so
  // that small operands still spread over the grid and large ones pipeline.
  int64_t min_piece_bytes = 8192;
  // One-shot all-reduce through the communicator's staging inbox (see cuda/executor.cu): a site
  // whose program is an all-reduce (every tree reduces and broadcasts, no gaps) of at most
  // ll_max_bytes per rank uses LL lines (data and flag in one store; any rank count up to 8); of
  // at most oneshot_max_bytes on 2 ranks, chunks with one release flag each. -1: the default
  // (JAX_BLINK_LL_BYTES / JAX_BLINK_ONESHOT_BYTES from the environment, else kDefault*); 0: off.
  // Never more than the communicator's staging holds (sized from the defaults at its first
  // one-shot site, within min(1% of device memory, 256 MiB)).
  int64_t ll_max_bytes = -1;
  int64_t oneshot_max_bytes = -1;
  // Blink's hybrid transfer (Mode::kHybrid): a 2-rank all-reduce site of at least host_min_bytes
  // (-1: JAX_BLINK_HOST_MIN_BYTES, else kDefaultHostMinBytes) sends the last `host_share` of its
  // elements GPU -> pinned host memory -> GPU, beside the trees over NVLink, through host_blocks
  // blocks of the same kernel (-1: JAX_BLINK_HOST_BLOCKS, else kDefaultHostBlocks) in chunks of
  // host_chunk_bytes (-1: JAX_BLINK_HOST_CHUNK_BYTES, else kDefaultHostChunkBytes). The share
  // comes from the plan (the host link's rate against the trees'); JAX_BLINK_HOST_SHARE, when
  // set, overrides it; 0: off. The host slice is at most host_max_bytes per rank (-1:
  // JAX_BLINK_HOST_MAX_BYTES, else kDefaultHostMaxBytes): the communicator's outbox, two slots
  // of it in pinned host memory per rank, made at its first hybrid site and shared by all.
  double host_share = 0.0;
  int64_t host_min_bytes = -1;
  int host_blocks = -1;
  int64_t host_chunk_bytes = -1;
  int64_t host_max_bytes = -1;
  // Who moves the host channel's bytes: 0 the SMs of its host blocks (graph-replayable), 1 copy
  // engines on side streams (faster both ways at once; not capturable), -1: JAX_BLINK_HOST_ENGINE
  // (sm|ce), else kDefaultHostEngine.
  int host_engine = -1;
  // Which stream class the communicator serves (kernels/cuda/async_ffi.cc): 0 the call's own
  // stream (XLA's compute stream), 1 the per-device side stream of the asynchronous form (small
  // grid), 2 that side stream with the whole grid (a step's last bucket). Part of
  // the communicator's key with the devices and the grid: an asynchronous site never shares a
  // communicator (its one-shot inbox, its call counters) with calls that run on another stream in
  // another order.
  int lane = 0;
};
// The limits and the host channel's defaults come from measurements: benchmarks/NOTES.md, "Where
// the CUDA executor's constants come from".
constexpr int64_t kDefaultLLMaxBytes = 512 << 10;  // LL up to here: it beats the chunked one-shot
constexpr int64_t kDefaultOneShotMaxBytes = 8 << 20;  // one-shot up to here: beyond, the trees are as fast
// Two-shot all-reduce by remote writes (3+ GPUs, cuda/two_shot.cuh) from this size per rank; 0: off
// (JAX_BLINK_TWOSHOT_MIN_BYTES overrides). Its pieces are about kTwoShotPieceBytes each
// (JAX_BLINK_TWOSHOT_PIECE_BYTES overrides).
constexpr int64_t kDefaultTwoShotMinBytes = 16 << 20;  // faster than the trees from here on 4 x H200 (NOTES, change 13)
constexpr int64_t kTwoShotPieceBytes = 1 << 20;  // fewer flag round trips beat a shorter pipeline fill (NOTES, change 16)
// Blocks of the two-shot grid that only reduce (JAX_BLINK_TWOSHOT_REDUCERS overrides; 0: every block
// pushes, reduces and broadcasts its own pieces). At most a quarter of the grid. 0: 8, 16 or 32 such
// blocks were slower on 4 x H200 at 64 MiB-1 GiB (NOTES, change 17).
constexpr int kTwoShotReducers = 0;
constexpr int64_t kDefaultHostMinBytes = int64_t{256} << 20;  // below, the host channel's fill outweighs its share
constexpr int kDefaultHostBlocks = 16;
constexpr int64_t kDefaultHostChunkBytes = 512 << 10;  // small chunks fill the channel's pipeline sooner
constexpr int64_t kDefaultHostMaxBytes = int64_t{256} << 20;
constexpr int kDefaultHostEngine = 0;  // SMs: the copy engines were faster on one machine only
constexpr int64_t kDefaultHostCEChunkBytes = 4 << 20;

// How a site runs (SiteMode): the tree kernel, one of the one-shot kernels, or the tree kernel
// with a host-channel slice beside it (hybrid).
enum class Mode : int32_t { kTree = 0, kLL = 1, kOneShot = 2, kHybrid = 3, kTwoShot = 4, kLLBlocks = 5 };
constexpr int kNumModes = 6;
const char* ModeName(Mode m);

// One call site's state for one rank: opaque. Lives until Release().
struct Site;

// Creates a call site for all ranks at once (self-test; no rendezvous): devices[r] is rank r's
// CUDA device (repeats allowed: ranks as streams of one GPU). `comm_id` only names it in errors.
// On success returns "" and sets (*sites)[r]. Makes (or reuses) the communicator of the ordered
// device set: peer access, kernels loaded on every device, per-device error records.
std::string CreateSite(const std::vector<int>& devices, const int32_t* program, int64_t len,
                       int esize, const Options& opt, int64_t comm_id, std::vector<Site*>* sites);

// FFI path: rank `rank` on `device` joins call site (comm_id, group); blocks on the host until
// every rank of the program has joined (or `timeout_ms` passed), then all share one Site set.
// Later calls find the site with FindSite without any rendezvous.
// `opt` is taken from the rank that completes the group (every rank passes the same: it comes
// from the same lowered call).
std::string JoinSite(int64_t comm_id, int32_t group, int rank, int device, const int32_t* program,
                     int64_t len, int esize, int64_t timeout_ms, const Options& opt, Site** site);
Site* FindSite(int64_t comm_id, int device);  // nullptr when this device has not joined yet

// What a call must match (the handler checks these on its fast path).
int SiteRank(const Site* s);
int SiteRanks(const Site* s);
int SiteEsize(const Site* s);
int64_t SiteTotalElems(const Site* s);
// True for a two-shot site set up with JAX_BLINK_TWOSHOT_ENGINE=ce: its caller runs the copy
// engines' form (cuda/async_ce.h) on the call's stream instead of Launch.
bool SiteTwoShotOnCopyEngines(const Site* s);
// True when (program, len) equals the site's program (fast when the pointer repeats).
bool SiteProgramMatches(Site* s, const int32_t* program, int64_t len);

// One call of one rank: ONE kernel launch on `stream`, no host synchronisation, no allocation.
// `in` may equal `out`. Returns "" or a launch error. The kernel's own failures (time-outs,
// mismatches) are recorded on the device and reported by DeviceError / CheckAll.
std::string Launch(Site* s, DType dtype, int32_t op, const void* in, void* out,
                   cudaStream_t stream, int64_t timeout_ms);

// out[i] = srcs[0][i] op srcs[1][i] op ... (in that order) for i < elems, by `blocks` blocks on
// `stream` (the copy-engine form of the asynchronous all-reduce reduces what the copy engines
// brought). Every pointer 16-byte aligned for the vector path; out may alias srcs[0].
std::string LaunchReduceTerms(DType dtype, int32_t op, void* out, const void* const* srcs, int nsrc, int64_t elems,
                              int blocks, cudaStream_t stream);

// Non-empty when a kernel on `device` recorded a failure (a host read of pinned memory; cheap).
// Failures are sticky: every later kernel on that device exits at once, until ResetAll().
std::string DeviceError(int device);
// Every device's recorded failure, joined by newlines ("" when none).
std::string CheckAll();
// Waits for every device that has communicator state (cudaDeviceSynchronize: in-flight kernels
// end at the latest when their time budget runs out), then zeroes every call counter, flag,
// abort marker and error record: every site starts again at call #1 on every rank. Call it only
// while no collective is being launched.
std::string ResetAll();
// Frees everything (at exit). Sites handed out before are invalid afterwards.
void ReleaseAll();

struct CommInfo {
  std::vector<int> devices;
  int blocks = 0;
  int64_t staging_bytes = 0;  // per rank: the one-shot inbox and the host channel's landing buffer
  int64_t control_bytes = 0;  // flags, pointer tables, plans of its sites, on its largest device
  int64_t host_bytes = 0;     // pinned host memory of its host channel (the outbox), per rank
  int num_sites = 0;
  int sites_by_mode[kNumModes] = {0, 0, 0, 0, 0, 0};  // indexed by Mode: tree, ll, oneshot, hybrid, twoshot, ll-blocks
};
std::vector<CommInfo> Comms();

// Elements per piece and number of pieces of a site (tests, benchmark notes).
int64_t SiteUnits(const Site* s);
int SiteGrid(const Site* s);
Mode SiteMode(const Site* s);
int64_t SiteHostElems(const Site* s);  // elements of the host-channel slice (0 unless hybrid)
int SiteHostBlocks(const Site* s);     // blocks that drive it
bool SiteHostCopyEngines(const Site* s);  // its bytes move on copy engines (else the host blocks' SMs)

// The executor's environment variables (README "Options"): "" when every one that is set is
// understood, else a message naming the variable, its value and what it takes. Set-up (CreateSite,
// JoinSite) fails with this message: a misspelt value is never replaced by a default in silence.
std::string CheckEnvironment();
// "8388608", "512K", "16M", "1G" (binary units, case-insensitive) -> bytes; false for anything
// else (a sign, other text, overflow).
bool ParseByteCount(const char* text, int64_t* out);

const char* Version();

// "" when this build's kernels load on `device`: CUDA finds a cubin for its architecture, or
// JIT-compiles the PTX for a GPU newer than it. Else CUDA's error (no kernel image for the device,
// or the device cannot be reached): what the module's device_problem() explains.
std::string KernelImageProblem(int device);

}  // namespace jax_blink::cuda
