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

  // `reserve_ids`: capacity allocated up front. Memory is only faulted in where chunks are used (one
  // page at a time as the arena fills), so a generous reservation costs address space, not memory;
  // outgrowing it copies the arena into a larger allocation (every page of it fresh at once).
  explicit BlockArena(size_t reserve_ids) : cap_(std::max<size_t>(reserve_ids, size_t{1} << 16)) {
    mem_ = static_cast<int32_t*>(huge_alloc(cap_ * sizeof(int32_t)));
  }
  ~BlockArena() { huge_free(mem_, cap_ * sizeof(int32_t)); }
  BlockArena(const BlockArena&) = delete;
  BlockArena& operator=(const BlockArena&) = delete;

  const int32_t* data(const Ref& r) const { return mem_ + r.off; }

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
    std::memcpy(mem_ + r.off, src, static_cast<size_t>(n) * sizeof(int32_t));
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
    if (top_ + len > cap_) grow(std::max(2 * cap_, top_ + len));
    const auto off = static_cast<uint32_t>(top_);  // (offsets are 32-bit: an arena below 16 GiB)
    top_ += len;
    return off;
  }

  void grow(size_t cap) {
    auto* mem = static_cast<int32_t*>(huge_alloc(cap * sizeof(int32_t)));
    std::memcpy(mem, mem_, top_ * sizeof(int32_t));
    huge_free(mem_, cap_ * sizeof(int32_t));
    mem_ = mem;
    cap_ = cap;
  }

  int32_t* mem_ = nullptr;
  size_t cap_ = 0;
  size_t top_ = 0;
  std::vector<uint32_t> free_[32];
};

}  // namespace di::sched
