// Standalone self-test and micro-benchmark of the CUDA executor (no JAX, no Python).
//
// Build from the repository root, through CMake (the flags of the shipped executor; `native`: the
// GPUs of this machine):
//   cmake -S . -B /tmp/jb-selftest -DJAX_BLINK_BUILD_SELFTEST=ON -DJAX_BLINK_CUDA=ON -DJAX_BLINK_CUDA_ARCHS=native
//   cmake --build /tmp/jb-selftest --target cuda_selftest && /tmp/jb-selftest/cuda_selftest
// or with nvcc alone (one line):
//   nvcc -std=c++17 -O3 -arch=native -lineinfo -Ikernels -o /tmp/cuda_selftest tests/native/cuda_selftest.cu kernels/cuda/executor.cu kernels/cuda/pack.cu
// benchmarks/gpu_session.sh builds it through CMake (steps selftest, stbench, sanitizer, hybrid).
//
// Modes:
//   (none)     every test: N ranks as N streams of GPU 0 (small grids, all blocks resident), then,
//              with 2+ GPUs, 2 ranks on GPUs 0 and 1. Prints one PASS/FAIL line per test and a
//              summary; exits 1 on any failure.
//   --filter S only the tests whose names contain S.
//   --quick    a few small cases only (for compute-sanitizer: memcheck needs no concurrency, but
//              tools that serialise kernels make cross-rank waits time out on one GPU, so --quick
//              uses 2 GPUs when there are 2).
//   --bench    2 ranks on GPUs 0 and 1 (or 2 streams of GPU 0 when there is one GPU), sizes 1 KiB ..
//              1 GiB, one-hop star trees (rank r roots half r of the data), time per call from CUDA
//              events over back-to-back launches (stream) and over a captured CUDA graph of calls
//              (graph, up to 16 MiB), algbw = bytes/time, busbw = algbw * 2(n-1)/n = algbw.
//              Options: --dtype f32|bf16, --chunk BYTES (program chunk, default 512 KiB),
//              --min/--max BYTES (sizes, default 1 KiB .. 1 GiB), --mode auto|tree|ll|oneshot|hybrid
//              (the kernel: auto takes the executor's limits; a forced mode that does not fit the
//              staging runs the trees, and the table's mode column says so); hybrid: --host-share F
//              (default 0.071), --host-blocks H, --host-chunk BYTES, --host-engine sm|ce (the host
//              column: share/blocks).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/program.h"
#include "cuda/executor.h"
#include "cuda/pack.h"

using namespace jax_blink;
using jax_blink::cuda::DType;
using jax_blink::cuda::Mode;

#define CK(expr)                                                                                     \
  do {                                                                                               \
    cudaError_t e_ = (expr);                                                                         \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
                   cudaGetErrorString(e_));                                                          \
      std::exit(2);                                                                                  \
    }                                                                                                \
  } while (0)

namespace {

int g_failures = 0, g_passes = 0;
int64_t g_comm_id = 1000;

std::string g_filter;  // --filter: run only the tests whose names contain it
bool Wanted(const std::string& name) { return g_filter.empty() || name.find(g_filter) != std::string::npos; }

// Sizes on the command line: 65536, 64K, 64M, 1G.
int64_t ParseBytes(const char* text) {  // the executor's reading (16M, 512K, ...); exits on anything else
  int64_t v = 0;
  if (!cuda::ParseByteCount(text, &v)) {
    std::fprintf(stderr, "not a byte count: '%s' (examples: 8388608, 512K, 16M, 1G)\n", text);
    std::exit(2);
  }
  return v;
}

void Report(bool ok, const std::string& name, const std::string& detail) {
  static auto last = std::chrono::steady_clock::now();
  const auto now = std::chrono::steady_clock::now();
  const double s = std::chrono::duration<double>(now - last).count();
  last = now;
  std::printf("%s  %-58s [%5.1f s] %s\n", ok ? "PASS" : "FAIL", name.c_str(), s, detail.c_str());
  std::fflush(stdout);
  (ok ? g_passes : g_failures)++;
}

// ---------------------------------------------------------------------------------------------
// Programs by hand.

struct TreeSpec {
  int root;
  int phases;
  int64_t off, len;
  std::vector<int> parent;
};

std::vector<int32_t> MakeProgram(int n, int64_t chunk, int64_t total, const std::vector<TreeSpec>& trees) {
  std::vector<int32_t> w = {kProgramVersion, n, static_cast<int32_t>(trees.size()), static_cast<int32_t>(chunk),
                            static_cast<int32_t>(total)};
  for (const TreeSpec& t : trees) {
    w.push_back(t.root);
    w.push_back(t.phases);
    w.push_back(static_cast<int32_t>(t.off));
    w.push_back(static_cast<int32_t>(t.len));
    for (int p : t.parent) w.push_back(p);
  }
  return w;
}

std::vector<int> StarParents(int n, int root) {
  std::vector<int> p(n, root);
  p[root] = -1;
  return p;
}
std::vector<int> ChainParents(int n, int root) {  // root <- root+1 <- root+2 ... (mod n)
  std::vector<int> p(n);
  for (int i = 0; i < n; ++i) p[(root + i) % n] = i == 0 ? -1 : (root + i - 1) % n;
  return p;
}

// n ranks, one tree per rank (rank r roots 1/n of the data), all one hop: the NVSwitch plan.
std::vector<TreeSpec> SplitStars(int n, int64_t total, int esize, int phases = 3) {
  std::vector<TreeSpec> t;
  const int64_t align = std::max(1, 16 / esize);
  int64_t at = 0;
  for (int r = 0; r < n; ++r) {
    int64_t len = r == n - 1 ? total - at : (total / n) / align * align;
    t.push_back({r, phases, at, len, StarParents(n, r)});
    at += len;
  }
  return t;
}

// n blocks of `block` elements, block r a star rooted at rank r: the program of a reduce-scatter
// (phases 1) or an all-gather (phases 2) on a switch, which the LL blocks kernel takes.
std::vector<TreeSpec> OwnedBlocks(int n, int64_t block, int phases) {
  std::vector<TreeSpec> t;
  for (int r = 0; r < n; ++r) t.push_back({r, phases, r * block, block, StarParents(n, r)});
  return t;
}

// DGX-1V-like: three spanning trees over the NVLink graph of 8 V100s (roots 0, 6, 3).
std::vector<TreeSpec> Dgx1vTrees(int64_t total) {
  const std::vector<int> a = {-1, 0, 3, 0, 0, 1, 7, 4};
  const std::vector<int> b = {4, 5, 6, 2, 7, 6, -1, 6};
  const std::vector<int> c = {3, 2, 3, -1, 0, 6, 7, 3};
  const int64_t l0 = total / 3 / 4 * 4, l1 = total / 4 / 4 * 4;
  return {{0, 3, 0, l0, a}, {6, 3, l0, l1, b}, {3, 3, l0 + l1, total - l0 - l1, c}};
}

// ---------------------------------------------------------------------------------------------
// Host-side element values.

int Esize(DType d) { return cuda::DTypeSize(d); }

float Bf16ToF(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t FToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

double Get(DType d, const uint8_t* p, int64_t i) {
  switch (d) {
    case DType::kF32: { float v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case DType::kF64: { double v; std::memcpy(&v, p + 8 * i, 8); return v; }
    case DType::kBF16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return Bf16ToF(v); }
    case DType::kF16: { __half_raw r; std::memcpy(&r.x, p + 2 * i, 2); return __half2float(__half(r)); }
    case DType::kS32: { int32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case DType::kS64: { int64_t v; std::memcpy(&v, p + 8 * i, 8); return static_cast<double>(v); }
  }
  return 0;
}
void Put(DType d, uint8_t* p, int64_t i, double x) {
  switch (d) {
    case DType::kF32: { float v = static_cast<float>(x); std::memcpy(p + 4 * i, &v, 4); break; }
    case DType::kF64: { std::memcpy(p + 8 * i, &x, 8); break; }
    case DType::kBF16: { uint16_t v = FToBf16(static_cast<float>(x)); std::memcpy(p + 2 * i, &v, 2); break; }
    case DType::kF16: { __half_raw r = __half_raw(__float2half_rn(static_cast<float>(x))); std::memcpy(p + 2 * i, &r.x, 2); break; }
    case DType::kS32: { int32_t v = static_cast<int32_t>(x); std::memcpy(p + 4 * i, &v, 4); break; }
    case DType::kS64: { int64_t v = static_cast<int64_t>(x); std::memcpy(p + 8 * i, &v, 8); break; }
  }
}
double RoundTo(DType d, double x) {
  uint8_t tmp[8];
  Put(d, tmp, 0, x);
  return Get(d, tmp, 0);
}
double Combine(int op, double a, double b) {
  if (op == 0) return a + b;
  if (op == 1) return a >= b ? a : b;
  return a <= b ? a : b;
}

// The program's semantics in double, one rounding to the dtype per hop (common/program.h).
std::vector<std::vector<double>> Reference(int n, const std::vector<TreeSpec>& trees,
                                           const std::vector<std::vector<double>>& in, int op, DType d) {
  std::vector<std::vector<double>> out = in;
  for (const TreeSpec& t : trees) {
    std::vector<int> order;  // post-order: children before parents
    std::vector<std::pair<int, bool>> st = {{t.root, false}};
    while (!st.empty()) {
      auto [v, done] = st.back();
      st.pop_back();
      if (done) { order.push_back(v); continue; }
      st.push_back({v, true});
      for (int c = n - 1; c >= 0; --c)
        if (t.parent[c] == v) st.push_back({c, false});
    }
    for (int64_t i = t.off; i < t.off + t.len; ++i) {
      if (t.phases & kPhaseReduce)
        for (int r : order) {
          double acc = in[r][i];
          for (int c = 0; c < n; ++c)
            if (t.parent[c] == r) acc = Combine(op, acc, out[c][i]);
          out[r][i] = RoundTo(d, acc);
        }
      if (t.phases & kPhaseBroadcast)
        for (auto it = order.rbegin(); it != order.rend(); ++it)
          if (t.parent[*it] >= 0) out[*it][i] = out[t.parent[*it]][i];
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// One rank's buffers and stream.

struct Rank {
  int device = 0;
  cudaStream_t stream = nullptr;
  uint8_t* in = nullptr;
  uint8_t* out = nullptr;
  size_t bytes = 0;
};

std::vector<Rank> MakeRanks(const std::vector<int>& devices, size_t bytes) {
  std::vector<Rank> ranks(devices.size());
  for (size_t r = 0; r < devices.size(); ++r) {
    ranks[r].device = devices[r];
    ranks[r].bytes = bytes;
    CK(cudaSetDevice(devices[r]));
    CK(cudaStreamCreateWithFlags(&ranks[r].stream, cudaStreamNonBlocking));
    CK(cudaMalloc(&ranks[r].in, std::max<size_t>(bytes, 16)));
    CK(cudaMalloc(&ranks[r].out, std::max<size_t>(bytes, 16)));
  }
  return ranks;
}

void FreeRanks(std::vector<Rank>& ranks) {
  for (Rank& r : ranks) {
    CK(cudaSetDevice(r.device));
    CK(cudaStreamSynchronize(r.stream));
    CK(cudaFree(r.in));
    CK(cudaFree(r.out));
    CK(cudaStreamDestroy(r.stream));
  }
  ranks.clear();
}

void SyncAll(const std::vector<Rank>& ranks) {
  for (const Rank& r : ranks) {
    CK(cudaSetDevice(r.device));
    CK(cudaStreamSynchronize(r.stream));
  }
}

std::string AnyDeviceError() { return cuda::CheckAll(); }

// Inputs and poison are written with cudaMemcpy / cudaMemset on the legacy stream, which the
// ranks' non-blocking streams do not wait for: finish them before the first launch.
void Settle(const std::vector<Rank>& ranks) {
  for (const Rank& r : ranks) {
    CK(cudaSetDevice(r.device));
    CK(cudaDeviceSynchronize());
  }
}

// Options that make an all-reduce site run in `mode` (the limits allow it; the staging decides).
// kHybrid: the host channel at any size, with the share / chunk already in `opt` or 30% in
// chunks of 16 KiB (so that small tests still have several chunks per host block).
void ForceMode(cuda::Options* opt, Mode mode) {
  opt->ll_max_bytes = mode == Mode::kLL || mode == Mode::kLLBlocks ? int64_t{1} << 40 : 0;
  opt->oneshot_max_bytes = mode == Mode::kOneShot ? int64_t{1} << 40 : 0;
  if (mode == Mode::kHybrid) {
    opt->host_min_bytes = 0;
    if (!(opt->host_share > 0)) opt->host_share = 0.3;
    if (opt->host_chunk_bytes <= 0) opt->host_chunk_bytes = 16 << 10;
  } else {
    opt->host_share = 0;
  }
}

// Set-up of a site that must run in `mode`: "" or what went wrong.
std::string MakeSites(const std::vector<int>& devices, const std::vector<int32_t>& prog, int esize,
                      cuda::Options opt, Mode mode, std::vector<cuda::Site*>* sites) {
  ForceMode(&opt, mode);
  std::string err = cuda::CreateSite(devices, prog.data(), static_cast<int64_t>(prog.size()), esize, opt, ++g_comm_id, sites);
  if (err.empty() && cuda::SiteMode((*sites)[0]) != mode)
    err = std::string("the site runs in mode ") + cuda::ModeName(cuda::SiteMode((*sites)[0])) + ", not " + cuda::ModeName(mode);
  return err;
}

// ---------------------------------------------------------------------------------------------
// A correctness case.

struct Case {
  std::string name;
  std::vector<int> devices;
  DType dtype = DType::kF32;
  int op = 0;
  int64_t total = 0;
  int64_t chunk = 1 << 16;
  std::vector<TreeSpec> trees;
  bool alias = false;     // in == out (donation)
  bool real = false;      // random reals with a tolerance (else small integers, exact)
  int blocks = 0;         // 0: chosen from the ranks per GPU
  int64_t min_piece = 8192;
  bool reverse_launch = false;
  uint64_t alias_ranks = 0;  // these ranks only: in == out (the others not)
  Mode mode = Mode::kTree;   // the kernel the site must run (the case fails if it does not)
  double host_share = 0;     // kHybrid: 0 = ForceMode's default
  int host_blocks = -1;
  int host_engine = 0;       // kHybrid: 0 SMs, 1 copy engines
  bool roots_only = false;   // reduce-only trees: only the root's result is checked (kLLBlocks, as a
                             // reduce-scatter, leaves the other ranks' `out` there as it was: poison)
  bool Aliased(int r) const { return alias || ((alias_ranks >> r) & 1u); }
};

int BlocksFor(const std::vector<int>& devices, int want) {
  if (want > 0) return want;
  int most = 0;
  for (int d : devices) most = std::max<int>(most, std::count(devices.begin(), devices.end(), d));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, devices[0]));
  return most == 1 ? 0 : std::max(1, std::min(16, (sms - 4) / most));
}

// The host channel's engine is fixed per communicator (by its first hybrid site), and a
// communicator is an ordered device set with a grid: copy-engine cases get one block less, so
// that they have a communicator of their own.
int BlocksForEngine(const std::vector<int>& devices, int want, int host_engine) {
  int b = BlocksFor(devices, want);
  if (host_engine != 1) return b;
  if (b == 0) CK(cudaDeviceGetAttribute(&b, cudaDevAttrMultiProcessorCount, devices[0]));
  return b - 1;
}

bool RunCase(const Case& c) {
  if (!Wanted(c.name)) return true;
  const int n = static_cast<int>(c.devices.size());
  const int es = Esize(c.dtype);
  std::vector<int32_t> prog = MakeProgram(n, c.chunk, c.total, c.trees);
  cuda::Options opt;
  opt.blocks = BlocksForEngine(c.devices, c.blocks, c.host_engine);
  opt.min_piece_bytes = c.min_piece;
  opt.host_share = c.host_share;
  opt.host_blocks = c.host_blocks;
  opt.host_engine = c.host_engine;
  std::vector<cuda::Site*> sites;
  std::string err = MakeSites(c.devices, prog, es, opt, c.mode, &sites);
  if (!err.empty()) { Report(false, c.name, "set-up: " + err); return false; }
  const size_t bytes = static_cast<size_t>(c.total) * es;
  std::vector<Rank> ranks = MakeRanks(c.devices, bytes);
  std::mt19937_64 rng(12345 + c.total);
  std::vector<std::vector<double>> in(n, std::vector<double>(c.total));
  std::vector<std::vector<uint8_t>> host(n, std::vector<uint8_t>(std::max<size_t>(bytes, 1)));
  const bool is_int = c.dtype == DType::kS32 || c.dtype == DType::kS64;
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < c.total; ++i) {
      double v;
      if (c.real) v = std::uniform_real_distribution<double>(-1, 1)(rng);
      else if (is_int) v = static_cast<double>(rng() % 16);  // >= 0: the 0xFF poison (-1) is never right
      else v = static_cast<double>(static_cast<int>(rng() % 17) - 8);
      Put(c.dtype, host[r].data(), i, v);
      in[r][i] = Get(c.dtype, host[r].data(), i);
    }
    CK(cudaSetDevice(ranks[r].device));
    CK(cudaMemcpy(ranks[r].in, host[r].data(), bytes, cudaMemcpyHostToDevice));
    if (c.Aliased(r)) { CK(cudaFree(ranks[r].out)); ranks[r].out = ranks[r].in; }
    else CK(cudaMemset(ranks[r].out, 0xFF, bytes));  // NaN / -1 poison
  }
  Settle(ranks);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    const int r = c.reverse_launch ? n - 1 - i : i;
    err = cuda::Launch(sites[r], c.dtype, c.op, ranks[r].in, ranks[r].out, ranks[r].stream, 5000);
    if (!err.empty()) break;
  }
  SyncAll(ranks);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (err.empty()) err = AnyDeviceError();
  if (!err.empty()) {
    for (int r = 0; r < n; ++r) if (c.Aliased(r)) ranks[r].out = nullptr;
    Report(false, c.name, err);
    cuda::ResetAll();
    for (Rank& r : ranks) { CK(cudaSetDevice(r.device)); if (r.out) CK(cudaFree(r.out)); r.out = nullptr; CK(cudaFree(r.in)); r.in = nullptr; CK(cudaStreamDestroy(r.stream)); }
    return false;
  }
  std::vector<std::vector<uint8_t>> got(n, std::vector<uint8_t>(std::max<size_t>(bytes, 1)));
  for (int r = 0; r < n; ++r) {
    CK(cudaSetDevice(ranks[r].device));
    CK(cudaMemcpy(got[r].data(), ranks[r].out, bytes, cudaMemcpyDeviceToHost));
  }
  auto ref = Reference(n, c.trees, in, c.op, c.dtype);
  double tol = 0;
  if (c.real) {
    tol = c.dtype == DType::kF64 ? 1e-12 : c.dtype == DType::kF32 ? 2e-6 : c.dtype == DType::kF16 ? 4e-3 : 3e-2;
    tol *= n * 2;
  }
  int64_t wrong = 0;
  std::string first;
  std::vector<int> reduced_at(c.roots_only ? c.total : 0, -1);  // the root of a reduce-only tree
  for (const TreeSpec& t : c.trees)
    if (c.roots_only && t.phases == kPhaseReduce) std::fill_n(reduced_at.begin() + t.off, t.len, t.root);
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < c.total; ++i) {
      if (c.roots_only && reduced_at[i] >= 0 && reduced_at[i] != r) continue;
      const double g = Get(c.dtype, got[r].data(), i), want = ref[r][i];
      const bool ok = c.real ? std::fabs(g - want) <= tol : g == want;
      if (!ok && wrong++ == 0) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "rank %d elem %lld: got %.9g want %.9g", r, static_cast<long long>(i), g, want);
        first = buf;
      }
    }
  // Bitwise identical across ranks wherever the program broadcasts.
  int64_t differ = 0;
  for (const TreeSpec& t : c.trees) {
    if (!(t.phases & kPhaseBroadcast)) continue;
    for (int r = 1; r < n; ++r)
      if (std::memcmp(got[r].data() + t.off * es, got[0].data() + t.off * es, t.len * es) != 0) ++differ;
  }
  for (int r = 0; r < n; ++r) if (c.Aliased(r)) ranks[r].out = nullptr;
  for (Rank& r : ranks) { CK(cudaSetDevice(r.device)); if (r.out) CK(cudaFree(r.out)); r.out = nullptr; }
  for (Rank& r : ranks) { CK(cudaFree(r.in)); CK(cudaStreamDestroy(r.stream)); }
  char detail[256];
  std::snprintf(detail, sizeof detail, "%s, %d ranks, %lld elems (%lld by host), %lld units, grid %d+%d, %.1f ms%s%s",
                cuda::ModeName(c.mode), n, static_cast<long long>(c.total),
                static_cast<long long>(cuda::SiteHostElems(sites[0])),
                static_cast<long long>(cuda::SiteUnits(sites[0])), cuda::SiteGrid(sites[0]),
                cuda::SiteHostBlocks(sites[0]), ms, wrong ? "; " : "", first.c_str());
  std::string d = detail;
  if (wrong) d += " (" + std::to_string(wrong) + " wrong)";
  if (differ) d += "; ranks not bitwise identical in " + std::to_string(differ) + " (tree, rank) pairs";
  Report(wrong == 0 && differ == 0, c.name, d);
  return wrong == 0 && differ == 0;
}

// ---------------------------------------------------------------------------------------------
// Chained calls: int32 sums, out of call i is the input of call i+1 (ping-pong), exact with
// wrap-around: after call 1 every rank holds S = sum of inputs; after call j, n^(j-1) * S.

// switch_alias (stream mode only): rank 0 runs every third call in place (in == out), so its
// parent-side pull/push choice changes from call to call while its peers stay out of place.
// `blocks`: the communicator's grid (0: chosen from the ranks per GPU). The two-shot kernel takes
// one-hop stars only (a switch's program), so its runs get one star per rank.
bool RunChained(const std::string& name, const std::vector<int>& devices, int64_t total, int calls, bool graph,
                bool switch_alias = false, Mode mode = Mode::kTree, int host_engine = 0, int blocks = 0) {
  if (!Wanted(name)) return true;
  const int n = static_cast<int>(devices.size());
  auto trees = SplitStars(n, total, 4);
  if (n > 2 && mode != Mode::kTwoShot)
    trees = {{0, 3, 0, total / 2, ChainParents(n, 0)}, {n - 1, 3, total / 2, total - total / 2, StarParents(n, n - 1)}};
  std::vector<int32_t> prog = MakeProgram(n, 4096, total, trees);
  cuda::Options opt;
  opt.blocks = BlocksForEngine(devices, blocks, host_engine);
  opt.host_engine = host_engine;
  opt.min_piece_bytes = 1024;
  std::vector<cuda::Site*> sites;
  std::string err = MakeSites(devices, prog, 4, opt, mode, &sites);
  if (!err.empty()) { Report(false, name, err); return false; }
  const size_t bytes = total * 4;
  std::vector<Rank> ranks = MakeRanks(devices, bytes);
  std::vector<uint32_t> sum(total, 0);
  std::vector<std::vector<int32_t>> h(n, std::vector<int32_t>(total));
  std::mt19937 rng(7);
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < total; ++i) { h[r][i] = static_cast<int32_t>(rng()); sum[i] += static_cast<uint32_t>(h[r][i]); }
    CK(cudaSetDevice(devices[r]));
    CK(cudaMemcpy(ranks[r].in, h[r].data(), bytes, cudaMemcpyHostToDevice));
    CK(cudaMemset(ranks[r].out, 0xFF, bytes));
  }
  Settle(ranks);
  float ms = 0;
  int done_calls = 0;
  std::vector<uint8_t*> cur(n);  // where each rank's current value is (stream mode)
  for (int r = 0; r < n; ++r) cur[r] = ranks[r].in;
  cudaEvent_t e0, e1;
  CK(cudaSetDevice(devices[0]));
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  if (!graph) {
    CK(cudaEventRecord(e0, ranks[0].stream));
    for (int i = 0; i < calls && err.empty(); ++i)
      for (int r = 0; r < n && err.empty(); ++r) {
        uint8_t* src = cur[r];
        uint8_t* dst = (switch_alias && r == 0 && i % 3 == 1) ? src : (src == ranks[r].in ? ranks[r].out : ranks[r].in);
        err = cuda::Launch(sites[r], DType::kS32, 0, src, dst, ranks[r].stream, 5000);
        cur[r] = dst;
      }
    done_calls = calls;
    CK(cudaSetDevice(devices[0]));
    CK(cudaEventRecord(e1, ranks[0].stream));
  } else {
    // Capture `per` calls per rank into one graph per rank, replay it calls/per times.
    const int per = 10;
    std::vector<cudaGraphExec_t> execs(n);
    for (int r = 0; r < n && err.empty(); ++r) {
      CK(cudaSetDevice(devices[r]));
      CK(cudaStreamBeginCapture(ranks[r].stream, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < per && err.empty(); ++i) {
        const bool even = i % 2 == 0;
        err = cuda::Launch(sites[r], DType::kS32, 0, even ? ranks[r].in : ranks[r].out,
                           even ? ranks[r].out : ranks[r].in, ranks[r].stream, 5000);
      }
      cudaGraph_t g;
      CK(cudaStreamEndCapture(ranks[r].stream, &g));
      CK(cudaGraphInstantiate(&execs[r], g, 0));
      CK(cudaGraphDestroy(g));
    }
    CK(cudaSetDevice(devices[0]));
    CK(cudaEventRecord(e0, ranks[0].stream));
    for (int k = 0; k < calls / per && err.empty(); ++k)
      for (int r = 0; r < n; ++r) {
        CK(cudaSetDevice(devices[r]));
        CK(cudaGraphLaunch(execs[r], ranks[r].stream));
      }
    done_calls = calls / per * per;
    CK(cudaSetDevice(devices[0]));
    CK(cudaEventRecord(e1, ranks[0].stream));
    SyncAll(ranks);
    for (auto& x : execs) CK(cudaGraphExecDestroy(x));
  }
  SyncAll(ranks);
  CK(cudaSetDevice(devices[0]));
  CK(cudaEventElapsedTime(&ms, e0, e1));
  if (err.empty()) err = AnyDeviceError();
  int64_t wrong = 0;
  if (err.empty()) {
    std::vector<uint32_t> want = sum;
    for (int j = 1; j < done_calls; ++j)
      for (auto& v : want) v *= static_cast<uint32_t>(n);
    std::vector<int32_t> got(total);
    for (int r = 0; r < n; ++r) {
      CK(cudaSetDevice(devices[r]));
      uint8_t* at = graph ? (done_calls % 2 ? ranks[r].out : ranks[r].in) : cur[r];
      CK(cudaMemcpy(got.data(), at, bytes, cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < total; ++i) wrong += static_cast<uint32_t>(got[i]) != want[i];
    }
  } else {
    cuda::ResetAll();
  }
  FreeRanks(ranks);
  char d[200];
  std::snprintf(d, sizeof d, "%d ranks, %lld elems, %d calls, %.2f us/call%s", n, static_cast<long long>(total),
                done_calls, 1000.0 * ms / std::max(done_calls, 1), wrong ? ", WRONG ELEMENTS" : "");
  Report(err.empty() && wrong == 0, name, err.empty() ? d : err);
  return err.empty() && wrong == 0;
}

// ---------------------------------------------------------------------------------------------
// Several sites of one communicator, called in turns (one-shot sites share the communicator's
// inbox and call counter; tree sites have their own): int32 sums, exact, as RunChained.

bool RunInterleaved(const std::string& name, const std::vector<int>& devices, int rounds, bool graph) {
  if (!Wanted(name)) return true;
  const int n = static_cast<int>(devices.size());
  struct One { int64_t total; Mode mode; double share = 0; int host_blocks = -1; std::vector<cuda::Site*> sites;
               std::vector<Rank> ranks; std::vector<uint32_t> sum; };
  std::vector<One> all;
  all.push_back({1001, Mode::kLL});
  all.push_back({20000, Mode::kTree});
  if (n == 2) all.push_back({300001, Mode::kOneShot});
  all.push_back({5, Mode::kLL});
  if (n == 2) all.push_back({4096, Mode::kOneShot});
  // Two hybrid sites with different shares and host block counts share the communicator's host
  // channel: its call counters must stay in lockstep across them.
  if (n == 2) all.push_back({200003, Mode::kHybrid, 0.3, 4});
  if (n == 2) all.push_back({150001, Mode::kHybrid, 0.6, 7});
  cuda::Options opt;
  opt.blocks = BlocksFor(devices, 0);
  opt.min_piece_bytes = 1024;
  std::mt19937 rng(11);
  for (One& o : all) {
    std::vector<int32_t> prog = MakeProgram(n, 2048, o.total, SplitStars(n, o.total, 4));
    cuda::Options one = opt;
    one.host_share = o.share;
    one.host_blocks = o.host_blocks;
    one.host_engine = 0;
    std::string err = MakeSites(devices, prog, 4, one, o.mode, &o.sites);
    if (!err.empty()) { Report(false, name, err); return false; }
    o.ranks = MakeRanks(devices, o.total * 4);
    o.sum.assign(o.total, 0);
    std::vector<int32_t> h(o.total);
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < o.total; ++i) { h[i] = static_cast<int32_t>(rng()); o.sum[i] += static_cast<uint32_t>(h[i]); }
      CK(cudaSetDevice(devices[r]));
      CK(cudaMemcpy(o.ranks[r].in, h.data(), o.total * 4, cudaMemcpyHostToDevice));
      CK(cudaMemset(o.ranks[r].out, 0xFF, o.total * 4));
    }
    Settle(o.ranks);
  }
  // Every site's calls go on one stream per rank (the first site's), in the same order everywhere.
  std::string err;
  auto enqueue = [&](int calls_per_site) {
    for (int i = 0; i < calls_per_site && err.empty(); ++i)
      for (One& o : all)
        for (int r = 0; r < n && err.empty(); ++r) {
          const bool even = i % 2 == 0;
          err = cuda::Launch(o.sites[r], DType::kS32, 0, even ? o.ranks[r].in : o.ranks[r].out,
                             even ? o.ranks[r].out : o.ranks[r].in, all[0].ranks[r].stream, 5000);
        }
  };
  int done = 0;
  if (!graph) {
    enqueue(rounds);
    done = rounds;
  } else {
    const int per = 10;
    std::vector<cudaGraphExec_t> execs(n);
    for (int r = 0; r < n && err.empty(); ++r) {
      CK(cudaSetDevice(devices[r]));
      CK(cudaStreamBeginCapture(all[0].ranks[r].stream, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < per && err.empty(); ++i)
        for (One& o : all) {
          const bool even = i % 2 == 0;
          err = cuda::Launch(o.sites[r], DType::kS32, 0, even ? o.ranks[r].in : o.ranks[r].out,
                             even ? o.ranks[r].out : o.ranks[r].in, all[0].ranks[r].stream, 5000);
        }
      cudaGraph_t g;
      CK(cudaStreamEndCapture(all[0].ranks[r].stream, &g));
      CK(cudaGraphInstantiate(&execs[r], g, 0));
      CK(cudaGraphDestroy(g));
    }
    for (int k = 0; k < rounds / per; ++k)
      for (int r = 0; r < n; ++r) { CK(cudaSetDevice(devices[r])); CK(cudaGraphLaunch(execs[r], all[0].ranks[r].stream)); }
    done = rounds / per * per;
    SyncAll(all[0].ranks);
    for (auto& x : execs) CK(cudaGraphExecDestroy(x));
  }
  SyncAll(all[0].ranks);
  if (err.empty()) err = AnyDeviceError();
  int64_t wrong = 0;
  if (err.empty())
    for (One& o : all) {
      std::vector<uint32_t> want = o.sum;
      for (int j = 1; j < done; ++j)
        for (auto& v : want) v *= static_cast<uint32_t>(n);
      std::vector<uint32_t> got(o.total);
      for (int r = 0; r < n; ++r) {
        CK(cudaSetDevice(devices[r]));
        CK(cudaMemcpy(got.data(), done % 2 ? o.ranks[r].out : o.ranks[r].in, o.total * 4, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < o.total; ++i) wrong += got[i] != want[i];
      }
    }
  else
    cuda::ResetAll();
  for (One& o : all) FreeRanks(o.ranks);
  char d[200];
  std::snprintf(d, sizeof d, "%d ranks, %zu sites (ll/tree/oneshot) in turns, %d calls each%s", n, all.size(), done,
                wrong ? ", WRONG ELEMENTS" : "");
  Report(err.empty() && wrong == 0, name, err.empty() ? d : err);
  return err.empty() && wrong == 0;
}

// ---------------------------------------------------------------------------------------------
// A rank that skips a call: its peers must time out (500 ms budget) with a record naming the
// device, tree and chunk; the skipped rank's next call must fail fast; reset() must recover.

bool RunSkipped(const std::string& name, const std::vector<int>& devices, int skip, Mode mode = Mode::kTree,
                int host_engine = 0) {
  if (!Wanted(name)) return true;
  const int n = static_cast<int>(devices.size());
  const int64_t total = 1 << 16;
  auto trees = SplitStars(n, total, 4);
  std::vector<int32_t> prog = MakeProgram(n, 4096, total, trees);
  cuda::Options opt;
  opt.blocks = BlocksForEngine(devices, 0, host_engine);
  opt.host_engine = host_engine;
  std::vector<cuda::Site*> sites;
  std::string err = MakeSites(devices, prog, 4, opt, mode, &sites);
  if (!err.empty()) { Report(false, name, err); return false; }
  const char* where_word = (mode == Mode::kTree || mode == Mode::kHybrid) ? "chunk" : "one-shot";
  std::vector<Rank> ranks = MakeRanks(devices, total * 4);
  for (Rank& r : ranks) { CK(cudaSetDevice(r.device)); CK(cudaMemset(r.in, 0, total * 4)); }
  Settle(ranks);
  bool ok = true;
  std::string detail;
  // Call 1: everyone (must work).
  for (int r = 0; r < n; ++r) cuda::Launch(sites[r], DType::kF32, 0, ranks[r].in, ranks[r].out, ranks[r].stream, 500);
  SyncAll(ranks);
  if (!AnyDeviceError().empty()) { ok = false; detail = "the first (full) call failed: " + AnyDeviceError(); }
  // Call 2: rank `skip` does not take part.
  auto t0 = std::chrono::steady_clock::now();
  if (ok) {
    for (int r = 0; r < n; ++r)
      if (r != skip) cuda::Launch(sites[r], DType::kF32, 0, ranks[r].in, ranks[r].out, ranks[r].stream, 500);
    SyncAll(ranks);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int present = skip == 0 ? 1 : 0;
    std::string rec = cuda::DeviceError(devices[present]);
    if (rec.empty() || rec.find("timed out") == std::string::npos || rec.find(where_word) == std::string::npos) {
      ok = false;
      detail = "no time-out record on GPU " + std::to_string(devices[present]) + " (got: '" + rec + "')";
    } else if (s > 3.0) {
      ok = false;
      detail = "the time-out took " + std::to_string(s) + " s with a 0.5 s budget";
    } else {
      char b[64];
      std::snprintf(b, sizeof b, "timed out in %.2f s: ", s);
      detail = b + rec.substr(0, 200) + "...";
    }
  }
  // The skipped rank's next call: must end quickly with an error on its GPU, never hang.
  if (ok) {
    auto t1 = std::chrono::steady_clock::now();
    cuda::Launch(sites[skip], DType::kF32, 0, ranks[skip].in, ranks[skip].out, ranks[skip].stream, 5000);
    SyncAll(ranks);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    if (cuda::DeviceError(devices[skip]).empty()) { ok = false; detail += " | skipped rank's next call: no error on its GPU"; }
    else if (s > 1.0) { ok = false; detail += " | skipped rank's next call took " + std::to_string(s) + " s (no fast failure)"; }
    else detail += " | next call of the skipped rank failed in " + std::to_string(static_cast<int>(s * 1000)) + " ms";
  }
  // Reset, then a full call must work again.
  if (ok) {
    err = cuda::ResetAll();
    if (!err.empty()) { ok = false; detail += " | reset: " + err; }
    for (int r = 0; r < n && ok; ++r) cuda::Launch(sites[r], DType::kF32, 0, ranks[r].in, ranks[r].out, ranks[r].stream, 2000);
    SyncAll(ranks);
    if (ok && !AnyDeviceError().empty()) { ok = false; detail += " | after reset: " + AnyDeviceError(); }
  }
  cuda::ResetAll();
  FreeRanks(ranks);
  Report(ok, name, detail);
  return ok;
}

// ---------------------------------------------------------------------------------------------

std::vector<Case> OneGpuCases(bool quick) {
  std::vector<Case> cs;
  auto same = [](int n) { return std::vector<int>(n, 0); };
  // 2 ranks, star split (each rank roots half): the one-hop plan.
  cs.push_back({"1gpu 2r star-split f32 sum real, odd size", same(2), DType::kF32, 0, (1 << 20) + 3, 1 << 15,
                SplitStars(2, (1 << 20) + 3, 4), false, true});
  cs.back().min_piece = 4096;
  // Chain of 4, many small pieces.
  cs.push_back({"1gpu 4r chain f32 sum, many pieces", same(4), DType::kF32, 0, 100003, 512,
                {{0, 3, 0, 100003, ChainParents(4, 0)}}});
  cs.back().min_piece = 512;
  if (quick) return cs;
  // Every dtype x op on a 4-rank star rooted at 2, plus a second tree with another root.
  const DType all[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16, DType::kS32, DType::kS64};
  for (DType d : all)
    for (int op = 0; op < 3; ++op) {
      const int64_t total = 50000;
      std::string nm = std::string("1gpu 4r two trees ") + cuda::DTypeName(d) + (op == 0 ? " sum" : op == 1 ? " max" : " min");
      cs.push_back({nm, same(4), d, op, total, 1024,
                    {{2, 3, 0, 30000, StarParents(4, 2)}, {1, 3, 30000, 20000, ChainParents(4, 1)}}});
      cs.back().min_piece = 1024;
    }
  // Unaligned segments, gaps at both ends and between: scalar paths.
  cs.push_back({"1gpu 3r unaligned segments + gaps bf16 sum", same(3), DType::kBF16, 0, 10007, 100,
                {{1, 3, 3, 4001, StarParents(3, 1)}, {2, 3, 4009, 5001, ChainParents(3, 2)}}});
  cs.back().min_piece = 256;
  cs.push_back({"1gpu 3r unaligned segments f32 real reversed launch", same(3), DType::kF32, 0, 77777, 1000,
                {{0, 3, 1, 40000, ChainParents(3, 0)}, {2, 3, 40001, 37775, StarParents(3, 2)}}, false, true});
  cs.back().reverse_launch = true;
  cs.back().min_piece = 512;
  // Broadcast only (rank 1 roots a chain 1 <- 2 <- 0), and reduce only (depth 2).
  cs.push_back({"1gpu 3r broadcast-only f16", same(3), DType::kF16, 0, 65536, 4096,
                {{1, 2, 0, 65536, {2, -1, 1}}}});
  cs.push_back({"1gpu 4r reduce-only depth 2 f32", same(4), DType::kF32, 0, 65536, 2048,
                {{0, 1, 0, 65536, {-1, 0, 1, 1}}}});
  cs.back().min_piece = 2048;
  // Mixed phases in one program: allreduce, broadcast-only, reduce-only trees.
  cs.push_back({"1gpu 4r mixed phases s64 max", same(4), DType::kS64, 1, 30000, 1000,
                {{0, 3, 0, 10000, StarParents(4, 0)}, {3, 2, 10000, 10000, ChainParents(4, 3)},
                 {1, 1, 20000, 10000, {1, -1, 1, 2}}}});
  cs.back().min_piece = 1024;
  // DGX-1V-like 8 ranks, 3 trees of depth up to 3.
  cs.push_back({"1gpu 8r dgx1v 3 trees f32 sum real", same(8), DType::kF32, 0, 600000, 8192,
                Dgx1vTrees(600000), false, true});
  cs.push_back({"1gpu 8r dgx1v 3 trees s32 max", same(8), DType::kS32, 1, 200000, 2048, Dgx1vTrees(200000)});
  cs.back().min_piece = 2048;
  // The planner's all-reduce forms (rings, reduce-scatter + all-gather over the trees, shallow
  // trees) on the DGX-1 presets: generated from jax_blink/planning/forms.py.
#include "form_cases.inc"
  cs.push_back({"1gpu 8r chain depth 7 f64 sum", same(8), DType::kF64, 0, 123457, 4096,
                {{5, 3, 0, 123457, ChainParents(8, 5)}}});
  cs.back().min_piece = 4096;
  cs.push_back({"1gpu 8r one-hop stars (nvswitch plan) bf16 real", same(8), DType::kBF16, 0, 1 << 18, 1 << 14,
                SplitStars(8, 1 << 18, 2), false, true});
  // Donation: in == out.
  cs.push_back({"1gpu 4r in==out (donated) f32 sum", same(4), DType::kF32, 0, 99999, 2048,
                {{0, 3, 0, 50000, ChainParents(4, 0)}, {3, 3, 50000, 49999, StarParents(4, 3)}}, true});
  cs.back().min_piece = 1024;
  cs.push_back({"1gpu 3r in==out reduce-only + bcast-only", same(3), DType::kF32, 0, 9000, 512,
                {{0, 1, 0, 4500, {-1, 0, 1}}, {2, 2, 4500, 4500, {2, 0, -1}}}, true});
  cs.back().min_piece = 256;
  // Push path (a parent with one child in the reduce phase) and its fallbacks to pull.
  cs.push_back({"1gpu 2r star-split push, rank 0 in==out only (root pulls)", same(2), DType::kF32, 0, 100000, 4096,
                SplitStars(2, 100000, 4)});
  cs.back().alias_ranks = 1;
  cs.back().min_piece = 4096;
  cs.push_back({"1gpu 2r star-split push, rank 1 in==out only", same(2), DType::kBF16, 0, 100001, 4096,
                SplitStars(2, 100001, 2), false, true});
  cs.back().alias_ranks = 2;
  cs.back().min_piece = 4096;
  cs.push_back({"1gpu 4r chain push all the way, ranks 1,2 in==out", same(4), DType::kS32, 0, 77777, 2048,
                {{0, 3, 0, 77777, ChainParents(4, 0)}}});
  cs.back().alias_ranks = 6;
  cs.back().min_piece = 2048;
  // Rank 1 is 0's only child (pushes up), and pulls its own two children; rank 3 aliases.
  cs.push_back({"1gpu 4r push above a multi-child pull, rank 3 in==out", same(4), DType::kF32, 2, 65536, 2048,
                {{0, 3, 0, 65536, {-1, 0, 1, 1}}}});
  cs.back().alias_ranks = 8;
  cs.back().min_piece = 2048;
  cs.push_back({"1gpu 4r reduce-only chain (push), rank 1 in==out", same(4), DType::kS64, 0, 40000, 1024,
                {{2, 1, 0, 40000, ChainParents(4, 2)}}});
  cs.back().alias_ranks = 2;
  cs.back().min_piece = 1024;
  cs.push_back({"1gpu 3r reduce-only star (pull) + broadcast-only chain, mixed in==out", same(3), DType::kF32, 0,
                20000, 512, {{1, 1, 0, 10000, StarParents(3, 1)}, {0, 2, 10000, 10000, ChainParents(3, 0)}}});
  cs.back().alias_ranks = 5;
  cs.back().min_piece = 512;
  // Degenerate programs.
  cs.push_back({"1gpu 2r empty segment + gap only tail", same(2), DType::kF32, 0, 1000, 64,
                {{0, 3, 0, 0, StarParents(2, 0)}, {1, 3, 16, 900, StarParents(2, 1)}}});
  cs.push_back({"1gpu 2r no trees (all gap)", same(2), DType::kS32, 0, 1000, 64, {}});
  cs.push_back({"1gpu 2r one element", same(2), DType::kF32, 0, 1, 1, {{1, 3, 0, 1, StarParents(2, 1)}}});
  cs.push_back({"1gpu 1r trivial", same(1), DType::kF32, 0, 4097, 1024, {{0, 3, 0, 4097, {-1}}}});
  // One-shot kernels (ranks as streams of one GPU).
  for (DType d : all)
    for (int op = 0; op < 3; ++op) {
      const std::string dn = std::string(cuda::DTypeName(d)) + (op == 0 ? " sum" : op == 1 ? " max" : " min");
      cs.push_back({"1gpu 3r ll " + dn, same(3), d, op, 4099, 1024, SplitStars(3, 4099, Esize(d))});
      cs.back().mode = Mode::kLL;
      cs.push_back({"1gpu 2r oneshot " + dn, same(2), d, op, 100003, 4096, SplitStars(2, 100003, Esize(d))});
      cs.back().mode = Mode::kOneShot;
    }
  cs.push_back({"1gpu 8r ll f32 sum real 256 KiB", same(8), DType::kF32, 0, 1 << 16, 1 << 14, SplitStars(8, 1 << 16, 4),
                false, true});
  cs.back().mode = Mode::kLL;
  cs.push_back({"1gpu 5r ll bf16 sum real, dgx-like trees", same(5), DType::kBF16, 0, 33333, 4096,
                {{0, 3, 0, 20000, ChainParents(5, 0)}, {3, 3, 20000, 13333, StarParents(5, 3)}}, false, true});
  cs.back().mode = Mode::kLL;
  cs.push_back({"1gpu 2r ll one element", same(2), DType::kF16, 0, 1, 1, {{1, 3, 0, 1, StarParents(2, 1)}}});
  cs.back().mode = Mode::kLL;
  cs.push_back({"1gpu 4r ll in==out s64", same(4), DType::kS64, 0, 3001, 512, SplitStars(4, 3001, 8), true});
  cs.back().mode = Mode::kLL;
  cs.push_back({"1gpu 3r ll rank 1 in==out f32 real reversed launch", same(3), DType::kF32, 0, 12345, 512,
                SplitStars(3, 12345, 4), false, true});
  cs.back().mode = Mode::kLL;
  cs.back().alias_ranks = 2;
  cs.back().reverse_launch = true;
  // LL reduce-scatter and all-gather (Mode::kLLBlocks): out poisoned (0xFF), blocks of odd sizes
  // (off 8 bytes: the byte path) and of whole lines, 2 to 8 ranks, in place too.
  for (int n : {2, 3, 4, 8})
    for (DType d : {DType::kF32, DType::kBF16, DType::kS32, DType::kF64})
      for (int phases : {1, 2}) {
        const std::string nm = std::string("1gpu ") + std::to_string(n) + "r ll-blocks " +
                               (phases == 1 ? "reduce-scatter " : "all-gather ") + cuda::DTypeName(d);
        for (int64_t block : {int64_t{4099}, int64_t{1024}}) {
          cs.push_back({nm + " block " + std::to_string(block), same(n), d, 0, n * block, 1024,
                        OwnedBlocks(n, block, phases)});
          cs.back().mode = Mode::kLLBlocks;
          cs.back().roots_only = phases == 1;
        }
      }
  cs.push_back({"1gpu 3r ll-blocks reduce-scatter bf16 max, one element per block", same(3), DType::kBF16, 1, 3, 1,
                OwnedBlocks(3, 1, 1)});
  cs.back().mode = Mode::kLLBlocks;
  cs.back().roots_only = true;
  cs.push_back({"1gpu 4r ll-blocks reduce-scatter f32 real in==out", same(4), DType::kF32, 0, 4 * 3001, 512,
                OwnedBlocks(4, 3001, 1), true, true});
  cs.back().mode = Mode::kLLBlocks;
  cs.back().roots_only = true;
  cs.push_back({"1gpu 4r ll-blocks all-gather f16 in==out reversed launch", same(4), DType::kF16, 0, 4 * 777, 512,
                OwnedBlocks(4, 777, 2), true});
  cs.back().mode = Mode::kLLBlocks;
  cs.back().reverse_launch = true;
  cs.push_back({"1gpu 2r oneshot f32 real 4 MiB odd, 4 KiB chunks", same(2), DType::kF32, 0, (1 << 20) + 3, 1024,
                SplitStars(2, (1 << 20) + 3, 4), false, true});
  cs.back().mode = Mode::kOneShot;
  cs.push_back({"1gpu 2r oneshot bf16 real, rank 0 in==out", same(2), DType::kBF16, 0, 777777, 1 << 16,
                SplitStars(2, 777777, 2), false, true});
  cs.back().mode = Mode::kOneShot;
  cs.back().alias_ranks = 1;
  cs.push_back({"1gpu 2r oneshot s32 in==out reversed launch", same(2), DType::kS32, 0, 65536 + 7, 4096,
                SplitStars(2, 65536 + 7, 4), true});
  cs.back().mode = Mode::kOneShot;
  cs.back().reverse_launch = true;
  cs.push_back({"1gpu 2r oneshot one element", same(2), DType::kF64, 1, 1, 1, {{0, 3, 0, 1, StarParents(2, 0)}}});
  cs.back().mode = Mode::kOneShot;
  // Host channel (Blink's hybrid transfer) beside the trees, ranks as streams of one GPU, on
  // each engine (SMs, copy engines: the engine name is in the case's name).
  for (int engine : {0, 1}) {
    const std::string hy = engine == 1 ? "1gpu 2r hybrid ce " : "1gpu 2r hybrid ";
    auto add = [&](Case c) { c.mode = Mode::kHybrid; c.host_engine = engine; cs.push_back(std::move(c)); };
    for (DType d : {DType::kF32, DType::kBF16, DType::kS64})
      for (int op = 0; op < 3; ++op)
        add({hy + cuda::DTypeName(d) + (op == 0 ? " sum" : op == 1 ? " max" : " min"), same(2), d, op, 300001,
             1 << 14, SplitStars(2, 300001, Esize(d))});
    add({hy + "f32 real in==out, 3 trees", same(2), DType::kF32, 0, 250007, 4096,
         {{0, 3, 0, 100000, StarParents(2, 0)}, {1, 3, 100000, 100000, StarParents(2, 1)},
          {0, 3, 200000, 50007, StarParents(2, 0)}}, true, true});
    Case all_host{hy + "all through the host (share 1)", same(2), DType::kF32, 0, 100003, 4096,
                  SplitStars(2, 100003, 4)};
    all_host.host_share = 1.0;
    add(all_host);
  }
  return cs;
}

std::vector<Case> TwoGpuCases(bool quick) {
  std::vector<Case> cs;
  const std::vector<int> dev = {0, 1};
  cs.push_back({"2gpu star-split f32 sum real 4 MiB", dev, DType::kF32, 0, 1 << 20, 1 << 17, SplitStars(2, 1 << 20, 4),
                false, true});
  cs.push_back({"2gpu star-split bf16 sum 1 KiB", dev, DType::kBF16, 0, 512, 1 << 17, SplitStars(2, 512, 2)});
  cs.push_back({"2gpu ll f32 sum real 4 KiB + 12 B", dev, DType::kF32, 0, 1027, 1 << 17, SplitStars(2, 1027, 4), false, true});
  cs.back().mode = Mode::kLL;
  cs.push_back({"2gpu oneshot bf16 sum 1 MiB + 2 B", dev, DType::kBF16, 0, (1 << 19) + 1, 1 << 16,
                SplitStars(2, (1 << 19) + 1, 2)});
  cs.back().mode = Mode::kOneShot;
  cs.push_back({"2gpu hybrid f32 sum real 1 MiB + 12 B", dev, DType::kF32, 0, (1 << 18) + 3, 1 << 16,
                SplitStars(2, (1 << 18) + 3, 4), false, true});
  cs.back().mode = Mode::kHybrid;
  if (quick) return cs;
  const DType all[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16, DType::kS32, DType::kS64};
  for (DType d : all)
    for (int op = 0; op < 3; ++op) {
      std::string nm = std::string("2gpu star-split ") + cuda::DTypeName(d) + (op == 0 ? " sum" : op == 1 ? " max" : " min");
      cs.push_back({nm, dev, d, op, 300001, 1 << 15, SplitStars(2, 300001, Esize(d))});
    }
  cs.push_back({"2gpu star-split f32 64 MiB real", dev, DType::kF32, 0, 16 << 20, 512 << 10, SplitStars(2, 16 << 20, 4),
                false, true});
  cs.push_back({"2gpu single tree root 1 f32 real", dev, DType::kF32, 0, 1 << 20, 1 << 16,
                {{1, 3, 0, 1 << 20, StarParents(2, 1)}}, false, true});
  cs.push_back({"2gpu in==out star-split f32", dev, DType::kF32, 0, 1 << 18, 1 << 16, SplitStars(2, 1 << 18, 4), true});
  cs.push_back({"2gpu star-split push, rank 0 in==out only f32", dev, DType::kF32, 0, 1 << 20, 1 << 16,
                SplitStars(2, 1 << 20, 4), false, true});
  cs.back().alias_ranks = 1;
  cs.push_back({"2gpu star-split push, rank 1 in==out only bf16", dev, DType::kBF16, 0, (1 << 20) + 5, 1 << 16,
                SplitStars(2, (1 << 20) + 5, 2), false, true});
  cs.back().alias_ranks = 2;
  cs.push_back({"2gpu broadcast-only root 0 f16", dev, DType::kF16, 0, 1 << 18, 1 << 16,
                {{0, 2, 0, 1 << 18, StarParents(2, 0)}}});
  cs.push_back({"2gpu reduce-only root 1 f32", dev, DType::kF32, 0, 1 << 18, 1 << 16,
                {{1, 1, 0, 1 << 18, StarParents(2, 1)}}});
  for (DType d : all)
    for (int op = 0; op < 3; ++op) {
      const std::string dn = std::string(cuda::DTypeName(d)) + (op == 0 ? " sum" : op == 1 ? " max" : " min");
      cs.push_back({"2gpu ll " + dn, dev, d, op, 10001, 1 << 15, SplitStars(2, 10001, Esize(d))});
      cs.back().mode = Mode::kLL;
      cs.push_back({"2gpu oneshot " + dn, dev, d, op, 1000001, 1 << 15, SplitStars(2, 1000001, Esize(d))});
      cs.back().mode = Mode::kOneShot;
    }
  cs.push_back({"2gpu oneshot f32 real 8 MiB (the default limit)", dev, DType::kF32, 0, 2 << 20, 512 << 10,
                SplitStars(2, 2 << 20, 4), false, true});
  cs.back().mode = Mode::kOneShot;
  cs.push_back({"2gpu ll bf16 real 256 KiB rank 1 in==out", dev, DType::kBF16, 0, 1 << 17, 1 << 15,
                SplitStars(2, 1 << 17, 2), false, true});
  cs.back().mode = Mode::kLL;
  cs.back().alias_ranks = 2;
  // Host channel beside NVLink, on each engine (SMs, copy engines).
  for (int engine : {0, 1}) {
    const std::string hy = engine == 1 ? "2gpu hybrid ce " : "2gpu hybrid ";
    auto add = [&](Case c) { c.mode = Mode::kHybrid; c.host_engine = engine; cs.push_back(std::move(c)); };
    for (DType d : all)
      for (int op = 0; op < 3; ++op)
        add({hy + cuda::DTypeName(d) + (op == 0 ? " sum" : op == 1 ? " max" : " min"), dev, d, op, 1000001, 1 << 15,
             SplitStars(2, 1000001, Esize(d))});
    Case big{hy + "f32 real 64 MiB, share 0.12", dev, DType::kF32, 0, 16 << 20, 512 << 10, SplitStars(2, 16 << 20, 4),
             false, true};
    big.host_share = 0.12;
    add(big);
    Case alias0{hy + "bf16 real, rank 0 in==out", dev, DType::kBF16, 0, (1 << 20) + 7, 1 << 16,
                SplitStars(2, (1 << 20) + 7, 2), false, true};
    alias0.alias_ranks = 1;
    add(alias0);
    Case all_host{hy + "all through the host (share 1), both in==out, 2 host blocks", dev, DType::kF32, 0, 1 << 20,
                  1 << 16, SplitStars(2, 1 << 20, 4), true, true};
    all_host.host_share = 1.0;
    all_host.host_blocks = 2;
    add(all_host);
  }
  return cs;
}

// ---------------------------------------------------------------------------------------------
// Bench.

int Bench(int argc, char** argv, int ngpu) {
  DType dtype = DType::kF32;
  int64_t chunk_bytes = 512 << 10, max_bytes = int64_t{1} << 30, min_bytes = 1024;
  std::string mode_arg = "auto";
  double host_share = 0.071;  // treegen.hybrid_share on 2 x H200 (28 GB/s beside 364)
  int host_blocks = -1;
  int64_t host_chunk = -1;
  int host_engine = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--host-share" && i + 1 < argc) host_share = std::atof(argv[++i]);
    else if (a == "--host-engine" && i + 1 < argc) host_engine = std::string(argv[++i]) == "ce" ? 1 : 0;
    else if (a == "--host-blocks" && i + 1 < argc) host_blocks = std::atoi(argv[++i]);
    else if (a == "--host-chunk" && i + 1 < argc) host_chunk = ParseBytes(argv[++i]);
    if (a == "--dtype" && i + 1 < argc) dtype = std::string(argv[++i]) == "bf16" ? DType::kBF16 : DType::kF32;
    else if (a == "--chunk" && i + 1 < argc) chunk_bytes = ParseBytes(argv[++i]);
    else if (a == "--max" && i + 1 < argc) max_bytes = ParseBytes(argv[++i]);
    else if (a == "--min" && i + 1 < argc) min_bytes = ParseBytes(argv[++i]);
    else if (a == "--mode" && i + 1 < argc) mode_arg = argv[++i];
  }
  const std::vector<int> devices = ngpu >= 2 ? std::vector<int>{0, 1} : std::vector<int>{0, 0};
  const int n = 2, es = Esize(dtype);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# jax_blink CUDA executor bench: %s, %s, 2 ranks on %s, one-hop star trees (rank r roots half r), "
              "program chunk %lld B\n", prop.name, cuda::DTypeName(dtype),
              ngpu >= 2 ? "GPUs 0,1" : "2 streams of GPU 0", static_cast<long long>(chunk_bytes));
  std::printf("%12s %12s %8s %7s %10s %8s %12s %12s %12s %12s %7s\n", "bytes", "elems", "mode", "units", "host",
              "calls", "stream_us", "graph_us", "algbw_GB/s", "busbw_GB/s", "#wrong");
  std::vector<Rank> ranks = MakeRanks(devices, max_bytes);
  // in_r[i] = (i % 7) + r: the sum 2 (i % 7) + 1 is exact in every float type.
  {
    // A whole number of periods of 7 elements per host block, so that every block repeats the
    // pattern at the right phase.
    std::vector<uint8_t> h(std::min<int64_t>(max_bytes, int64_t{7} << 22));  // 7 * 2^22 / es elements
    const int64_t he = h.size() / es;
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < he; ++i) Put(dtype, h.data(), i, static_cast<double>(i % 7 + r));
      CK(cudaSetDevice(devices[r]));
      for (int64_t off = 0; off < max_bytes; off += h.size())
        CK(cudaMemcpy(ranks[r].in + off, h.data(), std::min<int64_t>(h.size(), max_bytes - off), cudaMemcpyHostToDevice));
    }
  }
  Settle(ranks);
  std::vector<cudaEvent_t> ev0(n), ev1(n);
  for (int r = 0; r < n; ++r) {
    CK(cudaSetDevice(devices[r]));
    CK(cudaEventCreate(&ev0[r]));
    CK(cudaEventCreate(&ev1[r]));
  }
  // Time `calls` calls (stream launches or graph replays) on every rank; max over ranks, per call.
  auto timed = [&](auto&& enqueue, int calls) {
    SyncAll(ranks);
    for (int r = 0; r < n; ++r) { CK(cudaSetDevice(devices[r])); CK(cudaEventRecord(ev0[r], ranks[r].stream)); }
    enqueue();
    for (int r = 0; r < n; ++r) { CK(cudaSetDevice(devices[r])); CK(cudaEventRecord(ev1[r], ranks[r].stream)); }
    SyncAll(ranks);
    float worst = 0;
    for (int r = 0; r < n; ++r) { float ms; CK(cudaEventElapsedTime(&ms, ev0[r], ev1[r])); worst = std::max(worst, ms); }
    return 1000.0 * worst / calls;
  };
  int rc = 0;
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    const int64_t elems = bytes / es;
    std::vector<int32_t> prog = MakeProgram(n, std::max<int64_t>(1, chunk_bytes / es), elems, SplitStars(n, elems, es));
    cuda::Options opt;
    opt.blocks = ngpu >= 2 ? 0 : 64;
    if (mode_arg == "tree") ForceMode(&opt, Mode::kTree);
    else if (mode_arg == "ll") ForceMode(&opt, Mode::kLL);
    else if (mode_arg == "oneshot") ForceMode(&opt, Mode::kOneShot);
    else if (mode_arg == "hybrid") {
      opt.host_share = host_share;
      opt.host_blocks = host_blocks;
      opt.host_engine = host_engine;
      opt.host_chunk_bytes = host_chunk > 0 ? host_chunk : host_engine == 1 ? cuda::kDefaultHostCEChunkBytes : cuda::kDefaultHostChunkBytes;
      ForceMode(&opt, Mode::kHybrid);
    }
    std::vector<cuda::Site*> sites;
    std::string err = cuda::CreateSite(devices, prog.data(), static_cast<int64_t>(prog.size()), es, opt, ++g_comm_id, &sites);
    if (!err.empty()) { std::printf("set-up failed: %s\n", err.c_str()); return 1; }
    auto launch_all = [&] {
      for (int r = 0; r < n; ++r) cuda::Launch(sites[r], dtype, 0, ranks[r].in, ranks[r].out, ranks[r].stream, 10000);
    };
    for (int i = 0; i < 5; ++i) launch_all();  // warm-up
    const int calls = static_cast<int>(std::clamp<int64_t>((int64_t{1} << 31) / bytes, 20, 2000));
    const double us = timed([&] { for (int i = 0; i < calls; ++i) launch_all(); }, calls);
    double gus = -1;
    if (bytes <= (16 << 20)) {
      const int per = 100;
      std::vector<cudaGraphExec_t> execs(n);
      for (int r = 0; r < n; ++r) {
        CK(cudaSetDevice(devices[r]));
        CK(cudaStreamBeginCapture(ranks[r].stream, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < per; ++i) cuda::Launch(sites[r], dtype, 0, ranks[r].in, ranks[r].out, ranks[r].stream, 10000);
        cudaGraph_t g;
        CK(cudaStreamEndCapture(ranks[r].stream, &g));
        CK(cudaGraphInstantiate(&execs[r], g, 0));
        CK(cudaGraphDestroy(g));
      }
      auto replay = [&](int times) {
        for (int k = 0; k < times; ++k)
          for (int r = 0; r < n; ++r) { CK(cudaSetDevice(devices[r])); CK(cudaGraphLaunch(execs[r], ranks[r].stream)); }
      };
      replay(1);
      gus = timed([&] { replay(5); }, 5 * per);
      for (auto& x : execs) CK(cudaGraphExecDestroy(x));
    }
    err = AnyDeviceError();
    int64_t wrong = 0;
    if (err.empty()) {
      std::vector<uint8_t> h(bytes);
      for (int r = 0; r < n; ++r) {
        CK(cudaSetDevice(devices[r]));
        CK(cudaMemcpy(h.data(), ranks[r].out, bytes, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < elems; ++i) wrong += Get(dtype, h.data(), i) != static_cast<double>(2 * (i % 7) + 1);
      }
    } else {
      std::printf("kernel failure: %s\n", err.c_str());
      return 1;
    }
    const double best = gus > 0 ? std::min(us, gus) : us;
    const double algbw = bytes / (best * 1e3);
    char hostcol[32] = "-";
    if (cuda::SiteHostElems(sites[0]) > 0)
      std::snprintf(hostcol, sizeof hostcol, "%.1f%%/%d", 100.0 * cuda::SiteHostElems(sites[0]) / elems,
                    cuda::SiteHostBlocks(sites[0]));
    std::printf("%12lld %12lld %8s %7lld %10s %8d %12.2f %12s %12.2f %12.2f %7lld\n", static_cast<long long>(bytes),
                static_cast<long long>(elems), cuda::ModeName(cuda::SiteMode(sites[0])),
                static_cast<long long>(cuda::SiteUnits(sites[0])), hostcol, calls, us,
                gus > 0 ? std::to_string(gus).substr(0, std::to_string(gus).find('.') + 3).c_str() : "-", algbw,
                algbw * 2.0 * (n - 1) / n, static_cast<long long>(wrong));
    std::fflush(stdout);
    if (wrong) rc = 1;
  }
  FreeRanks(ranks);
  return rc;
}

}  // namespace

// The bucket packing's copies (cuda/pack.cu, cuda/segments.cuh): segments of every alignment and
// length class, more than one launch's table, into a destination poisoned everywhere; every
// segment must arrive byte for byte, and no byte between or around them may change.
bool RunCopySegments(const std::string& name) {
  if (!Wanted(name)) return true;
  std::vector<int64_t> lengths = {0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 32, 4099, (64 << 10) + 3, (2 << 20) + 5};
  for (int i = 0; i < 150; ++i) lengths.push_back(11 + i % 5);  // past one table of kMaxSegments
  std::mt19937 rng(11);
  std::vector<int64_t> src_off, dst_off;
  int64_t s_at = 0, d_at = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    s_at += i % 3;       // sources off 0, 1 or 2 bytes from where the last one ended
    d_at += (i % 4) * 4;  // destinations off 0, 4, 8 or 12 bytes (the guard bytes between them)
    src_off.push_back(s_at);
    dst_off.push_back(d_at);
    s_at += lengths[i];
    d_at += lengths[i];
  }
  const int64_t src_bytes = s_at + 64, dst_bytes = d_at + 64;
  std::vector<uint8_t> h_src(src_bytes), h_dst(dst_bytes);
  for (auto& b : h_src) b = static_cast<uint8_t>(rng());
  uint8_t *src = nullptr, *dst = nullptr;
  CK(cudaSetDevice(0));
  CK(cudaMalloc(&src, src_bytes));
  CK(cudaMalloc(&dst, dst_bytes));
  CK(cudaMemcpy(src, h_src.data(), src_bytes, cudaMemcpyHostToDevice));
  CK(cudaMemset(dst, 0xA5, dst_bytes));
  std::vector<cuda::Segment> segs;
  for (size_t i = 0; i < lengths.size(); ++i) segs.push_back({src + src_off[i], dst + dst_off[i], lengths[i]});
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  std::string err = cuda::CopySegments(segs, st);
  CK(cudaStreamSynchronize(st));
  CK(cudaStreamDestroy(st));
  CK(cudaMemcpy(h_dst.data(), dst, dst_bytes, cudaMemcpyDeviceToHost));
  CK(cudaFree(src));
  CK(cudaFree(dst));
  std::vector<uint8_t> want(dst_bytes, 0xA5);
  for (size_t i = 0; i < lengths.size(); ++i)
    std::memcpy(want.data() + dst_off[i], h_src.data() + src_off[i], lengths[i]);
  int64_t wrong = 0;
  for (int64_t i = 0; i < dst_bytes; ++i) wrong += h_dst[i] != want[i];
  char d[160];
  std::snprintf(d, sizeof d, "%zu segments, %lld bytes, %lld bytes wrong", lengths.size(),
                static_cast<long long>(d_at), static_cast<long long>(wrong));
  Report(err.empty() && wrong == 0, name, err.empty() ? d : err);
  return err.empty() && wrong == 0;
}

int main(int argc, char** argv) {
  int ngpu = 0;
  CK(cudaGetDeviceCount(&ngpu));
  if (ngpu < 1) { std::printf("no CUDA device\n"); return 2; }
  bool bench = false, quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--bench") bench = true;
    if (std::string(argv[i]) == "--quick") quick = true;
    if (std::string(argv[i]) == "--filter" && i + 1 < argc) g_filter = argv[++i];
  }
  if (bench) return Bench(argc, argv, ngpu);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# jax_blink CUDA executor self-test: %d x %s; %s\n", ngpu, prop.name, cuda::Version());
  if (!(quick && ngpu >= 2)) {
    RunCopySegments("1gpu bucket packing: 165 copies of every alignment into poisoned memory");
    for (const Case& c : OneGpuCases(quick)) RunCase(c);
    if (!quick) {
      RunChained("1gpu 2r 1000 chained calls s32 (stream)", {0, 0}, 4099, 1000, false);
      RunChained("1gpu 4r 1000 chained calls s32 (stream)", {0, 0, 0, 0}, 1 << 16, 1000, false);
      RunChained("1gpu 2r 1000 chained calls s32 (CUDA graph)", {0, 0}, 4099, 1000, true);
      RunChained("1gpu 2r 999 chained calls, rank 0 in place every 3rd", {0, 0}, 4099, 999, false, true);
      RunChained("1gpu 4r 999 chained calls, rank 0 in place every 3rd", {0, 0, 0, 0}, 1 << 14, 999, false, true);
      RunSkipped("1gpu 3r rank 1 skips a call -> time-out record", {0, 0, 0}, 1);
      RunChained("1gpu 3r 1000 chained calls s32 ll (stream)", {0, 0, 0}, 4099, 1000, false, false, Mode::kLL);
      RunChained("1gpu 2r 1000 chained calls s32 ll (CUDA graph)", {0, 0}, 4099, 1000, true, false, Mode::kLL);
      RunChained("1gpu 2r 999 chained calls s32 oneshot, rank 0 in place every 3rd", {0, 0}, 1 << 18, 999, false, true,
                 Mode::kOneShot);
      RunChained("1gpu 2r 1000 chained calls s32 oneshot (CUDA graph)", {0, 0}, 1 << 18, 1000, true, false, Mode::kOneShot);
      RunInterleaved("1gpu 2r ll/tree/oneshot/hybrid sites in turns (stream)", {0, 0}, 300, false);
      RunInterleaved("1gpu 3r ll/tree sites in turns (CUDA graph)", {0, 0, 0}, 300, true);
      RunSkipped("1gpu 3r ll: rank 1 skips a call -> time-out record", {0, 0, 0}, 1, Mode::kLL);
      RunSkipped("1gpu 2r oneshot: rank 0 skips a call -> time-out record", {0, 0}, 0, Mode::kOneShot);
      RunChained("1gpu 2r 999 chained calls s32 hybrid, rank 0 in place every 3rd", {0, 0}, 1 << 18, 999, false, true,
                 Mode::kHybrid);
      RunChained("1gpu 2r 1000 chained calls s32 hybrid (CUDA graph)", {0, 0}, 1 << 18, 1000, true, false, Mode::kHybrid);
      RunSkipped("1gpu 2r hybrid: rank 1 skips a call -> time-out record", {0, 0}, 1, Mode::kHybrid);
      RunChained("1gpu 2r 999 chained calls s32 hybrid ce, rank 0 in place every 3rd", {0, 0}, 1 << 18, 999, false, true,
                 Mode::kHybrid, 1);
      RunSkipped("1gpu 2r hybrid ce: rank 1 skips a call -> time-out record", {0, 0}, 1, Mode::kHybrid, 1);
      // The two-shot kernel on a small grid: JAX_BLINK_ASYNC_BLOCKS=8 faulted on 4 x H200 in a
      // training step whose 25 MiB buckets run it (NOTES, change 29); these isolate the kernel.
      RunChained("1gpu 4r 200 chained calls s32 twoshot 25 MiB, 8 blocks", {0, 0, 0, 0}, 25 << 18, 200, false, false,
                 Mode::kTwoShot, 0, 8);
      RunChained("1gpu 3r 200 chained calls s32 twoshot 25 MiB, 8 blocks, rank 0 in place every 3rd", {0, 0, 0},
                 25 << 18, 200, false, true, Mode::kTwoShot, 0, 8);
    }
  }
  if (ngpu >= 4 && !quick) {
    for (int blocks : {24, 8}) {
      const std::string g = std::to_string(blocks) + " blocks";
      RunChained("4gpu 300 chained calls s32 twoshot 25 MiB, " + g, {0, 1, 2, 3}, 25 << 18, 300, false, false,
                 Mode::kTwoShot, 0, blocks);
      RunChained("4gpu 300 chained calls s32 twoshot 25 MiB, " + g + ", rank 0 in place every 3rd", {0, 1, 2, 3},
                 25 << 18, 300, false, true, Mode::kTwoShot, 0, blocks);
      RunChained("4gpu 300 chained calls s32 twoshot 17 MiB + 4 bytes (a tail), " + g, {0, 1, 2, 3}, (17 << 18) + 1, 300,
                 false, false, Mode::kTwoShot, 0, blocks);
    }
  }
  if (ngpu >= 2) {
    for (const Case& c : TwoGpuCases(quick)) RunCase(c);
    RunChained("2gpu 1000 chained calls s32 64 KiB (stream)", {0, 1}, 1 << 14, 1000, false);
    if (!quick) {
      RunChained("2gpu 1000 chained calls s32 4 MiB (stream)", {0, 1}, 1 << 20, 1000, false);
      RunChained("2gpu 1000 chained calls s32 64 KiB (CUDA graph)", {0, 1}, 1 << 14, 1000, true);
      RunChained("2gpu 999 chained calls 4 MiB, rank 0 in place every 3rd", {0, 1}, 1 << 20, 999, false, true);
      RunSkipped("2gpu rank 1 skips a call -> time-out record", {0, 1}, 1);
      RunSkipped("2gpu rank 0 skips a call -> time-out record", {0, 1}, 0);
      RunChained("2gpu 1000 chained calls s32 64 KiB ll (stream)", {0, 1}, 1 << 14, 1000, false, false, Mode::kLL);
      RunChained("2gpu 1000 chained calls s32 64 KiB ll (CUDA graph)", {0, 1}, 1 << 14, 1000, true, false, Mode::kLL);
      RunChained("2gpu 999 chained calls 4 MiB oneshot, rank 0 in place every 3rd", {0, 1}, 1 << 20, 999, false, true,
                 Mode::kOneShot);
      RunChained("2gpu 1000 chained calls 4 MiB oneshot (CUDA graph)", {0, 1}, 1 << 20, 1000, true, false, Mode::kOneShot);
      RunInterleaved("2gpu ll/tree/oneshot/hybrid sites in turns (stream)", {0, 1}, 500, false);
      RunInterleaved("2gpu ll/tree/oneshot/hybrid sites in turns (CUDA graph)", {0, 1}, 500, true);
      RunSkipped("2gpu ll: rank 1 skips a call -> time-out record", {0, 1}, 1, Mode::kLL);
      RunSkipped("2gpu oneshot: rank 0 skips a call -> time-out record", {0, 1}, 0, Mode::kOneShot);
      RunChained("2gpu 999 chained calls 4 MiB hybrid, rank 0 in place every 3rd", {0, 1}, 1 << 20, 999, false, true,
                 Mode::kHybrid);
      RunChained("2gpu 1000 chained calls 4 MiB hybrid (CUDA graph)", {0, 1}, 1 << 20, 1000, true, false, Mode::kHybrid);
      RunSkipped("2gpu hybrid: rank 0 skips a call -> time-out record", {0, 1}, 0, Mode::kHybrid);
      RunChained("2gpu 999 chained calls 4 MiB hybrid ce, rank 0 in place every 3rd", {0, 1}, 1 << 20, 999, false, true,
                 Mode::kHybrid, 1);
      RunSkipped("2gpu hybrid ce: rank 0 skips a call -> time-out record", {0, 1}, 0, Mode::kHybrid, 1);
      RunSkipped("2gpu hybrid ce: rank 1 skips a call -> time-out record", {0, 1}, 1, Mode::kHybrid, 1);
    }
  } else {
    std::printf("# only one GPU: the 2-GPU tests are skipped\n");
  }
  std::printf("# %d passed, %d failed\n", g_passes, g_failures);
  cuda::ReleaseAll();
  return g_failures ? 1 : 0;
}
