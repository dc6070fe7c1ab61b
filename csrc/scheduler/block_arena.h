// Every request's block-table mirror in one contiguous array instead of one heap vector per request.
// Why: a decode step copies each row's block ids into the plan. As per-request heap buffers they were
// scattered over the heap (one more page and cache line per request, reallocated whenever a table
// grew), and at 16k running requests loading them was the largest single stall of a step (perf at
// block size 256: ~30% of samples in the copy and its prefetch). Here a request's table is a chunk of
// a power-of-two size class in one huge-page array: tables of requests admitted one after another lie
// one after another (a decode pass in admission order streams through them), and a table is moved
// only when it outgrows its chunk (every few doublings).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "scheduler/plan_buffer.h"

namespace di::sched {

class BlockArena {
 public:
  // A request's table: mem[off, off + n), inside a chunk of 2^cls ints (cls < 0: no chunk).
  struct Ref {
    uint32_t off = 0;
    int32_t n = 0;
    int32_t cls = -1;
  };

  const int32_t* data(const Ref& r) const { return mem_.data() + r.off; }

  // r's table := src[0, n).
  void assign(Ref& r, const int32_t* src, int32_t n) {
    if (n == 0) {
      clear(r);
      return;
    }
    if (r.cls < 0 || (int64_t{1} << r.cls) < n) {
      int32_t cls = kMinClass;
      while ((int64_t{1} << cls) < n) ++cls;
      const uint32_t off = take(cls);
      clear(r);  // (after take: a freed chunk is not handed straight back to the same table)
      r.off = off;
      r.cls = cls;
    }
    std::memcpy(mem_.data() + r.off, src, static_cast<size_t>(n) * sizeof(int32_t));
    r.n = n;
  }

  void clear(Ref& r) {
    if (r.cls >= 0) free_[r.cls].push_back(r.off);
    r = Ref{};
  }

 private:
  static constexpr int32_t kMinClass = 2;  // 4 ids (16 bytes): four tables of 3-4 blocks per line

  uint32_t take(int32_t cls) {
    auto& fl = free_[cls];
    if (!fl.empty()) {
      const uint32_t off = fl.back();
      fl.pop_back();
      return off;
    }
    const size_t len = size_t{1} << cls;
    if (top_ + len > mem_.size()) mem_.resize(std::max<size_t>({2 * mem_.size(), top_ + len, size_t{1} << 16}));
    const auto off = static_cast<uint32_t>(top_);
    top_ += len;
    return off;
  }

  std::vector<int32_t, HugeAllocator<int32_t>> mem_;
  std::vector<uint32_t> free_[32];
  size_t top_ = 0;
};

}  // namespace di::sched
