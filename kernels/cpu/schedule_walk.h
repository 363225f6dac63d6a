// The schedule walk of both CPU back ends: the in-process executor (cpu/executor.cc, ranks as
// threads of one process) and the shared-memory one (cpu/shm.cc, ranks in several processes).
// Written once because both rest on the same order of steps (the deadlock-freedom argument of
// cpu/executor.cc, "Order, and why it cannot deadlock") and the same rule for when a rank may
// return (its readers said they are done).
//
// A rank computes its result in its *own* buffer (in-process: XLA's result buffer; shared memory:
// its staging area in the segment) and peers read it there. What differs between the back ends
// is a policy, `Peers` (their Call classes), which provides:
//   static constexpr bool kOperandShared  peers can read this rank's operand where XLA put it (one
//                                          process): a leaf's value and a broadcast-only root's
//                                          are its operand, published at entry without a copy.
//                                          Otherwise (another process) such a rank copies its
//                                          operand into its own buffer chunk by chunk, publishing
//                                          each, at that tree's step (as a hop-by-hop run would).
//   const char* Value(int peer, int t, bool leaf)  where `peer`'s reduce result of tree t is
//   const char* RootValue(int root, bool reduced)  where a tree's final value is at its root (after
//                                                  its reduce phase, or its operand where none)
//   bool Wait(int peer, int t, int phase, int64_t chunk); void Publish(int t, int phase, int64_t chunks)
//   uint64_t Progress(int peer, int t, int phase)  chunks of (t, phase) `peer` published in this call
//   bool BeginRead(const int32_t* peers, int n); void EndRead(const int32_t* peers, int n)
//   void PublishDone(); bool WaitDone(int peer)    (one process only: WaitForReaders)
// Any `false` means the call failed; the policy holds the message.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common/program.h"
#include "cpu/reduce.h"

namespace jax_blink::cpu_walk {

constexpr int kReduce = 0, kBroadcast = 1;  // the phase of a progress word

// What the walk needs of a program besides its trees, derived once per communicator.
struct ScheduleLayout {
  std::vector<int32_t> child_begin;  // children of r in tree t: child_list[child_begin[t*n+r] ..
  std::vector<int32_t> child_list;   //                                      child_begin[t*n+r+1]), ascending
  std::vector<std::pair<int64_t, int64_t>> gaps;  // (offset, len) outside every segment
  std::vector<std::vector<int32_t>> readers_of;   // per rank: the peers that read its own buffer (one process)
  int nranks = 0;

  void Build(const Program& p) {
    nranks = p.nranks();
    const int ntrees = p.ntrees();
    child_begin.assign(static_cast<size_t>(ntrees) * nranks + 1, 0);
    child_list.assign(static_cast<size_t>(ntrees) * nranks, 0);
    // Counting sort by parent: children come out in ascending rank order.
    for (int t = 0; t < ntrees; ++t)
      for (int r = 0; r < nranks; ++r)
        if (p.tree(t).parent[r] >= 0) ++child_begin[static_cast<size_t>(t) * nranks + p.tree(t).parent[r] + 1];
    for (size_t i = 1; i < child_begin.size(); ++i) child_begin[i] += child_begin[i - 1];
    std::vector<int32_t> fill(child_begin.begin(), child_begin.end() - 1);
    for (int t = 0; t < ntrees; ++t)
      for (int r = 0; r < nranks; ++r)
        if (p.tree(t).parent[r] >= 0) child_list[fill[static_cast<size_t>(t) * nranks + p.tree(t).parent[r]]++] = r;
    gaps.clear();
    int64_t at = 0;
    for (int t : p.trees_by_offset()) {
      const TreeView& tv = p.tree(t);
      if (tv.seg_offset > at) gaps.emplace_back(at, tv.seg_offset - at);
      at = tv.seg_offset + tv.seg_len;
    }
    if (p.total_elems() > at) gaps.emplace_back(at, p.total_elems() - at);
    // Who reads whose buffer (see RunSteps): the parent reads a non-root's in a tree with a reduce
    // phase, every non-root reads the root's in a tree with a broadcast phase.
    readers_of.assign(nranks, {});
    for (int t = 0; t < ntrees; ++t) {
      const TreeView& tv = p.tree(t);
      if (tv.num_chunks(p.chunk_elems()) == 0) continue;
      for (int r = 0; r < nranks; ++r) {
        if (r == tv.root) continue;
        if (tv.phases & kPhaseReduce) readers_of[r].push_back(tv.parent[r]);
        if (tv.phases & kPhaseBroadcast) readers_of[tv.root].push_back(r);
      }
    }
    for (auto& v : readers_of) {
      std::sort(v.begin(), v.end());
      v.erase(std::unique(v.begin(), v.end()), v.end());
    }
  }

  const int32_t* kids(int t, int r) const { return child_list.data() + child_begin[static_cast<size_t>(t) * nranks + r]; }
  int num_kids(int t, int r) const {
    const size_t i = static_cast<size_t>(t) * nranks + r;
    return child_begin[i + 1] - child_begin[i];
  }
};

// Runs rank `rank`'s steps of the schedule, `in` -> `own` (the caller has entered the call).
//
// Every rank can read every peer's buffer, which this uses where the program's semantics allow it
// (the results are the same bits as a hop-by-hop run):
// - A broadcast copies from the tree's root, not from the parent: every rank's value is the
//   root's, ready chunk by chunk once the root has reduced it (at once in a broadcast-only tree),
//   and copied in runs of what the root has ready. The depth of a tree (the planner's trees for
//   host devices are up to n-1 hops long) costs no broadcast latency.
// - A leaf's reduce result is its operand: with kOperandShared its parent reads it where XLA put
//   it and the leaf publishes at entry (before any wait, so the order argument is unchanged);
//   else the leaf copies it into its own buffer at its reduce step, publishing chunk by chunk.
// Who reads whose buffer: its parent reads a non-root's value during the reduce phase; every
// non-root reads the root's during the broadcast phase (ScheduleLayout::readers_of). A rank writes
// its own buffer only at indices whose readers are done with them: a non-root's broadcast writes
// chunk c after the root published it, which is after the parent read chunk c of this rank's value
// (the root reduces a chunk after its children did), and `in` may be `own` (donation).
template <class Peers>
bool RunSteps(const Program& p, const ScheduleLayout& L, Peers& peers, int rank, cpu_reduce::ReduceFn reduce,
              size_t esize, const char* in, char* own) {
  const int64_t ce = p.chunk_elems();
  const bool alias = in == own;
  auto copy_segment = [&](const TreeView& tv) {
    std::memcpy(own + tv.seg_offset * esize, in + tv.seg_offset * esize, tv.seg_len * esize);
  };
  // The operand's chunks into this rank's own buffer, each published as (t, phase) progress.
  auto stage_chunks = [&](int t, const TreeView& tv, int phase, int64_t nch) {
    for (int64_t ch = 0; ch < nch; ++ch) {
      const int64_t off = tv.seg_offset + ch * ce, n = std::min(ce, tv.seg_offset + tv.seg_len - off);
      std::memcpy(own + off * esize, in + off * esize, n * esize);
      peers.Publish(t, phase, ch + 1);
    }
  };
  // At entry, one process: the values that are this rank's operand (a reduce leaf's, a
  // broadcast-only root's) are ready for its peers as they are.
  if constexpr (Peers::kOperandShared)
    for (int t = 0; t < p.ntrees(); ++t) {
      const TreeView& tv = p.tree(t);
      const int64_t nch = tv.num_chunks(ce);
      if (nch == 0) continue;
      if (tv.root == rank && tv.phases == kPhaseBroadcast) peers.Publish(t, kBroadcast, nch);
      if (tv.root != rank && (tv.phases & kPhaseReduce) && L.num_kids(t, rank) == 0) peers.Publish(t, kReduce, nch);
    }
  if (!alias)
    for (const auto& [off, len] : L.gaps) std::memcpy(own + off * esize, in + off * esize, len * esize);

  thread_local std::vector<const void*> kid_ptrs;
  if (kid_ptrs.size() < static_cast<size_t>(L.nranks)) kid_ptrs.resize(L.nranks);

  for (int t = 0; t < p.ntrees(); ++t) {
    const TreeView& tv = p.tree(t);
    const int64_t nch = tv.num_chunks(ce);
    if (nch == 0) continue;
    const int32_t* kids = L.kids(t, rank);
    const int nk = L.num_kids(t, rank);
    const bool root = tv.root == rank;
    const bool has_broadcast = (tv.phases & kPhaseBroadcast) != 0;
    if (tv.phases & kPhaseReduce) {
      if (nk == 0) {
        if (root) {  // the tree's only rank: its operand is the result
          if (!alias) copy_segment(tv);
          peers.Publish(t, kReduce, nch);
          if (has_broadcast) peers.Publish(t, kBroadcast, nch);
        } else if (!Peers::kOperandShared) {
          stage_chunks(t, tv, kReduce, nch);  // its value, where its parent reads it
        } else if (!has_broadcast && !alias) {
          copy_segment(tv);  // no broadcast fills its own buffer: its operand is its result
        }
      } else {
        for (int64_t ch = 0; ch < nch; ++ch) {
          const int64_t off = tv.seg_offset + ch * ce, n = std::min(ce, tv.seg_offset + tv.seg_len - off);
          for (int k = 0; k < nk; ++k)
            if (!peers.Wait(kids[k], t, kReduce, ch)) return false;
          // The kids' values in this call (published by the words just waited for).
          for (int k = 0; k < nk; ++k) kid_ptrs[k] = peers.Value(kids[k], t, L.num_kids(t, kids[k]) == 0) + off * esize;
          if (!peers.BeginRead(kids, nk)) return false;
          reduce(own + off * esize, in + off * esize, kid_ptrs.data(), nk, n);
          peers.EndRead(kids, nk);
          peers.Publish(t, kReduce, ch + 1);
          // The root's broadcast phase has nothing to do: let the others copy at once.
          if (root && has_broadcast) peers.Publish(t, kBroadcast, ch + 1);
        }
      }
    }
    if (has_broadcast) {
      if (root) {
        // Broadcast only: its operand is the value (one process: published at entry, peers read
        // it there); its own buffer gets it too.
        if (!Peers::kOperandShared) {
          if (!(tv.phases & kPhaseReduce)) stage_chunks(t, tv, kBroadcast, nch);
        } else if (!(tv.phases & kPhaseReduce) && !alias) {
          copy_segment(tv);
        }
      } else {
        const int32_t from[1] = {tv.root};
        // Copy as much as the root has ready in one piece (all of it, in a broadcast-only tree).
        for (int64_t ch = 0; ch < nch;) {
          if (!peers.Wait(tv.root, t, kBroadcast, ch)) return false;
          const char* src = peers.RootValue(tv.root, (tv.phases & kPhaseReduce) != 0);
          const int64_t upto = std::min<int64_t>(nch, static_cast<int64_t>(peers.Progress(tv.root, t, kBroadcast)));
          const int64_t off = tv.seg_offset + ch * ce;
          const int64_t end = std::min(tv.seg_offset + tv.seg_len, tv.seg_offset + upto * ce);
          if (!peers.BeginRead(from, 1)) return false;
          std::memcpy(own + off * esize, src + off * esize, (end - off) * esize);
          peers.EndRead(from, 1);
          ch = upto;
          if constexpr (!Peers::kOperandShared) peers.Publish(t, kBroadcast, ch);  // read from the root: WaitForReaders
        }
      }
    }
  }
  return true;
}

// Exit: nobody may still read this rank's own buffer when it returns (one process: XLA may reuse
// it) or starts its next call (shared memory: it overwrites its staging area). No deadlock: a rank
// publishes every word of its schedule before it reaches its exit, so every schedule finishes
// (the order argument) and every word waited for here comes.
// - One process: one word per rank, `done`, once it has read all it reads in this call; a rank
//   waits for the `done` of each peer that reads its own buffer (ScheduleLayout::readers_of).
// - Shared memory: per tree, the readers' own progress past their last read: a root waits for
//   every other rank's broadcast copy, a non-root for its parent's last reduce. Finer than `done`
//   (a rank leaves once the readers of its trees are through, not once every reader is through
//   everything), which measured faster with more ranks than cores (benchmarks/NOTES.md).
template <class Peers>
bool WaitForReaders(const Program& p, const ScheduleLayout& L, Peers& peers, int rank) {
  if constexpr (Peers::kOperandShared) {
    peers.PublishDone();
    for (int32_t peer : L.readers_of[rank])
      if (!peers.WaitDone(peer)) return false;
  } else {
    for (int t = 0; t < p.ntrees(); ++t) {
      const TreeView& tv = p.tree(t);
      const int64_t nch = tv.num_chunks(p.chunk_elems());
      if (nch == 0) continue;
      if (tv.root == rank) {
        if (tv.phases & kPhaseBroadcast)
          for (int r = 0; r < L.nranks; ++r)
            if (r != rank && !peers.Wait(r, t, kBroadcast, nch - 1)) return false;
      } else if (tv.phases & kPhaseReduce) {
        if (!peers.Wait(tv.parent[rank], t, kReduce, nch - 1)) return false;
      }
    }
  }
  return true;
}

}  // namespace jax_blink::cpu_walk
