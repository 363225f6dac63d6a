// The collective's schedule program: one flat int32 array, the same for every rank of a group
// (XLA lowers one custom call for all SPMD ranks), written by jax_blink/schedule.py.
//
//   header  [0] kProgramVersion
//           [1] nranks
//           [2] ntrees
//           [3] chunk_elems      elements per pipelined chunk (> 0)
//           [4] total_elems      elements of the operand (== of the result)
//   tree t, at kHeaderLen + t * (kTreeFixed + nranks):
//           [0] root             rank that finishes the reduction / starts the broadcast
//           [1] phases           kPhaseReduce | kPhaseBroadcast
//           [2] seg_offset       first element of this tree's segment
//           [3] seg_len          elements in it (>= 0); chunk k covers
//                                [seg_offset + k*chunk_elems, min(+chunk_elems, seg_offset+seg_len))
//           [4 + r] parent[r]    parent of rank r in this tree, -1 for the root
//
// Semantics for rank r, tree t, each chunk in order (executors may pipeline, the result is the same):
//   reduce phase:    out[c] = in[c] op child_0.out[c] op child_1.out[c] ...  (children in ascending
//                    rank order; 16-bit types accumulate in float32 and round once per hop);
//                    then r's reduce progress for t moves past c.
//   broadcast phase: root: out[c] already final (after its reduce, or out[c] = in[c] when the tree
//                    has no reduce phase); others: out[c] = parent.out[c]. Then r's broadcast
//                    progress for t moves past c.
// Segments of different trees never overlap; elements outside every segment get out = in.
// A rank returns only after every peer that reads its buffers is done with them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_blink {

constexpr int32_t kProgramVersion = 1;
constexpr int kHeaderLen = 5;
constexpr int kTreeFixed = 4;
constexpr int32_t kPhaseReduce = 1;
constexpr int32_t kPhaseBroadcast = 2;

enum class ReduceOp : int32_t { kSum = 0, kMax = 1, kMin = 2 };

struct TreeView {
  int32_t root;
  int32_t phases;
  int64_t seg_offset;
  int64_t seg_len;
  const int32_t* parent;  // nranks entries

  int64_t num_chunks(int64_t chunk_elems) const {
    return seg_len <= 0 ? 0 : (seg_len + chunk_elems - 1) / chunk_elems;
  }
};

// A decoded, validated view over the program array (which must outlive it).
class Program {
 public:
  // Returns an empty string on success, else what is wrong with the array. Checks everything an
  // executor relies on: the layout, every root and parent in range, phases in {1, 2, 3}, every
  // tree's parent pointers reaching its root without a cycle (so every tree spans all ranks), and
  // segments inside the operand that do not overlap. O(ntrees * nranks + ntrees log ntrees); the
  // scratch vectors are members, so a Program reused across calls does not allocate.
  std::string Decode(const int32_t* data, int64_t size) {
    if (size < kHeaderLen) return "program shorter than its header";
    if (data[0] != kProgramVersion)
      return "program version " + std::to_string(data[0]) + ", this build reads " +
             std::to_string(kProgramVersion) + " (rebuild jax_blink)";
    nranks_ = data[1];
    ntrees_ = data[2];
    chunk_elems_ = data[3];
    total_elems_ = data[4];
    if (nranks_ < 1) return "nranks < 1";
    if (ntrees_ < 0) return "ntrees < 0";
    if (chunk_elems_ < 1) return "chunk_elems < 1";
    if (total_elems_ < 0) return "total_elems < 0";
    const int64_t stride = kTreeFixed + static_cast<int64_t>(nranks_);
    if (size != kHeaderLen + static_cast<int64_t>(ntrees_) * stride)
      return "program length does not match its header";
    trees_.clear();
    state_.assign(nranks_, 0);
    for (int t = 0; t < ntrees_; ++t) {
      const int32_t* p = data + kHeaderLen + t * stride;
      TreeView tv{p[0], p[1], p[2], p[3], p + kTreeFixed};
      auto where = [t](const char* what) { return "tree " + std::to_string(t) + ": " + what; };
      if (tv.root < 0 || tv.root >= nranks_) return where("root out of range");
      if (tv.parent[tv.root] != -1) return where("root has a parent");
      if (tv.phases < 1 || tv.phases > (kPhaseReduce | kPhaseBroadcast))
        return where("phases must be 1 (reduce), 2 (broadcast) or 3 (both)");
      if (tv.seg_offset < 0 || tv.seg_len < 0 || tv.seg_offset + tv.seg_len > total_elems_)
        return where("segment outside the operand");
      for (int r = 0; r < nranks_; ++r)
        if (r != tv.root && (tv.parent[r] < 0 || tv.parent[r] >= nranks_ || tv.parent[r] == r))
          return where("parent of rank ") + std::to_string(r) + " out of range";
      // Every rank's parent chain reaches the root: colour 2t+1 = on the current walk, 2t+2 =
      // known to reach the root (colours of earlier trees are smaller, so no clearing).
      const int32_t on_path = 2 * t + 1, reaches = 2 * t + 2;
      state_[tv.root] = reaches;
      for (int r = 0; r < nranks_; ++r) {
        int v = r;
        while (state_[v] != reaches) {
          if (state_[v] == on_path)
            return where("parent pointers form a cycle through rank ") + std::to_string(v);
          state_[v] = on_path;
          v = tv.parent[v];
        }
        for (v = r; state_[v] == on_path; v = tv.parent[v]) state_[v] = reaches;
      }
      trees_.push_back(tv);
    }
    // Segments never overlap (empty ones are ignored).
    by_offset_.clear();
    for (int t = 0; t < ntrees_; ++t)
      if (trees_[t].seg_len > 0) by_offset_.push_back(t);
    std::sort(by_offset_.begin(), by_offset_.end(), [this](int a, int b) {
      return trees_[a].seg_offset < trees_[b].seg_offset;
    });
    for (size_t i = 1; i < by_offset_.size(); ++i) {
      const TreeView& a = trees_[by_offset_[i - 1]];
      if (a.seg_offset + a.seg_len > trees_[by_offset_[i]].seg_offset)
        return "segments of trees " + std::to_string(by_offset_[i - 1]) + " and " +
               std::to_string(by_offset_[i]) + " overlap";
    }
    return {};
  }

  // Trees with a non-empty segment, by ascending segment offset (valid after a successful Decode).
  const std::vector<int>& trees_by_offset() const { return by_offset_; }

  int nranks() const { return nranks_; }
  int ntrees() const { return ntrees_; }
  int64_t chunk_elems() const { return chunk_elems_; }
  int64_t total_elems() const { return total_elems_; }
  const TreeView& tree(int t) const { return trees_[t]; }

  // Children of `rank` in tree t, ascending.
  std::vector<int> children(int t, int rank) const {
    std::vector<int> out;
    for (int r = 0; r < nranks_; ++r)
      if (trees_[t].parent[r] == rank) out.push_back(r);
    return out;
  }

 private:
  int nranks_ = 0, ntrees_ = 0;
  int64_t chunk_elems_ = 0, total_elems_ = 0;
  std::vector<TreeView> trees_;
  std::vector<int32_t> state_;   // Decode's scratch
  std::vector<int> by_offset_;
};

}  // namespace jax_blink
