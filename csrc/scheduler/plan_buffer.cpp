// Huge-page allocations and the recycled plan buffers (see plan_buffer.h for why).
#include "scheduler/plan_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <mutex>
#include <vector>

namespace di::sched {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kSmallAlign = 64;

size_t huge_round(size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }

// Recycled buffers: a 64-byte header in front of the data holds the capacity (data bytes).
struct Recycler {
  static constexpr size_t kMinBytes = 64 << 10;  // smaller ones: malloc is cheap enough
  static constexpr size_t kKeep = 8;
  static constexpr size_t kHeader = 64;
  std::mutex mu;
  std::vector<char*> free;  // bases

  static size_t cap_of(const char* base) { return *reinterpret_cast<const size_t*>(base); }
  static void drop(char* base) { huge_free(base, kHeader + cap_of(base)); }

  char* take(size_t bytes) {
    if (bytes >= kMinBytes) {
      std::lock_guard<std::mutex> lock(mu);
      for (size_t i = 0; i < free.size(); ++i) {
        const size_t c = cap_of(free[i]);
        // never hand a much larger buffer to a small plan (but huge pages come whole)
        if (c >= bytes && c <= 2 * bytes + kHugePage) {
          char* base = free[i];
          free[i] = free.back();
          free.pop_back();
          return base;
        }
      }
    }
    // room for the plan to grow a little; a huge allocation is rounded to whole pages anyway
    size_t cap = bytes < kMinBytes ? bytes : bytes + bytes / 4;
    if (kHeader + cap >= kHugeMin) cap = huge_round(kHeader + cap) - kHeader;
    char* base = static_cast<char*>(huge_alloc(kHeader + cap));
    *reinterpret_cast<size_t*>(base) = cap;
    return base;
  }
  void give(char* base) {
    if (cap_of(base) >= kMinBytes) {
      std::lock_guard<std::mutex> lock(mu);
      if (free.size() < kKeep) {
        free.push_back(base);
        return;
      }
    }
    drop(base);
  }
};

Recycler& recycler() {
  static Recycler* r = new Recycler();  // never destroyed: arrays may outlive module teardown
  return *r;
}

constexpr int kSlabMinShift = 6;   // 64-byte chunks at least
constexpr int kSlabMaxShift = 16;  // 64 KiB at most; larger buffers come from operator new

struct Slabs {
  std::mutex mu;
  std::vector<void*> free[kSlabMaxShift + 1];
  char* cur = nullptr;  // unused tail of the newest slab
  size_t left = 0;
};

Slabs& slabs() {
  static Slabs* s = new Slabs();  // never destroyed: buffers may be freed during teardown
  return *s;
}

int slab_class(size_t bytes) {
  int c = kSlabMinShift;
  while ((size_t{1} << c) < bytes) ++c;
  return c;
}

}  // namespace

void* slab_alloc(size_t bytes) {
  if (bytes > (size_t{1} << kSlabMaxShift)) return ::operator new(bytes);
  const int c = slab_class(bytes);
  const size_t len = size_t{1} << c;
  Slabs& s = slabs();
  std::lock_guard<std::mutex> lock(s.mu);
  auto& fl = s.free[c];
  if (!fl.empty()) {
    void* p = fl.back();
    fl.pop_back();
    return p;
  }
  if (s.left < len) {  // a new slab (what is left of the old one is too small: at most 64 KiB lost)
    s.cur = static_cast<char*>(huge_alloc(kHugePage));
    s.left = kHugePage;
  }
  void* p = s.cur;
  s.cur += len;
  s.left -= len;
  return p;
}

void slab_free(void* p, size_t bytes) noexcept {
  if (p == nullptr) return;
  if (bytes > (size_t{1} << kSlabMaxShift)) {
    ::operator delete(p);
    return;
  }
  Slabs& s = slabs();
  std::lock_guard<std::mutex> lock(s.mu);
  s.free[slab_class(bytes)].push_back(p);  // (push_back may throw only on exhaustion: then terminate)
}

void* huge_alloc(size_t bytes) {
  if (bytes < kHugeMin) return ::operator new(bytes > 0 ? bytes : 1, std::align_val_t{kSmallAlign});
  const size_t len = huge_round(bytes);
  void* p = std::aligned_alloc(kHugePage, len);
  if (p == nullptr) throw std::bad_alloc();
  // Advice only: without THP (or with it off) the memory is simply 4 KiB pages.
  (void)madvise(p, len, MADV_HUGEPAGE);
  return p;
}

void huge_free(void* p, size_t bytes) noexcept {
  if (p == nullptr) return;
  if (bytes < kHugeMin) {
    ::operator delete(p, std::align_val_t{kSmallAlign});
    return;
  }
  std::free(p);
}

void* take_buffer(size_t bytes) { return recycler().take(bytes) + Recycler::kHeader; }

void give_buffer(void* data) noexcept { recycler().give(static_cast<char*>(data) - Recycler::kHeader); }

}  // namespace di::sched

// ---- PlanOut: the regions of a plan's two buffers ----------------------------------------------------
#include "scheduler/step_scheduler.h"

namespace di::sched {

void PlanOut::bind32(int32_t* b) {
  const int64_t r = rows_cap;
  Col<int32_t>* rows[] = {&num_tokens, &start, &sample, &num_drafts, &cached, &kv_load_tokens};
  for (int64_t k = 0; k < 6; ++k) rows[k]->bind(b + k * r);
  block_offsets.bind(b + 6 * r);
  token_ids.bind(b + 7 * r + 1);
  block_ids.bind(b + 7 * r + 1 + tok_cap);
}

void PlanOut::open(int64_t rows, int64_t tokens, int64_t preemptions, int64_t blocks) {
  drop();
  rows_cap = rows;
  tok_cap = tokens;
  pre_cap = preemptions;
  blk_cap = blocks;
  buf32_ = take_buffer(static_cast<size_t>(7 * rows + 1 + tokens + blocks) * sizeof(int32_t));
  buf64_ = take_buffer(static_cast<size_t>(2 * rows + preemptions) * sizeof(int64_t));
  for (auto* c : {&num_tokens, &start, &sample, &num_drafts, &cached, &kv_load_tokens, &block_offsets, &token_ids,
                  &block_ids})
    c->clear();
  for (auto* c : {&seq_ids, &kv_load_ids, &preempted}) c->clear();
  bind32(static_cast<int32_t*>(buf32_));
  auto* b64 = static_cast<int64_t*>(buf64_);
  seq_ids.bind(b64);
  kv_load_ids.bind(b64 + rows);
  preempted.bind(b64 + 2 * rows);
  width = 0;
  predicted_ns = 0.0;
}

void PlanOut::grow_blocks(size_t need) {
  const size_t cap = std::max(need, static_cast<size_t>(2 * blk_cap));
  void* nb = take_buffer(static_cast<size_t>(7 * rows_cap + 1 + tok_cap + static_cast<int64_t>(cap)) * sizeof(int32_t));
  std::memcpy(nb, buf32_, len32() * sizeof(int32_t));  // every region's written part (and the gaps)
  give_buffer(buf32_);
  buf32_ = nb;
  blk_cap = static_cast<int64_t>(cap);
  bind32(static_cast<int32_t*>(buf32_));
}

std::pair<void*, void*> PlanOut::hand_off() {
  std::pair<void*, void*> out{buf32_, buf64_};
  buf32_ = buf64_ = nullptr;
  return out;
}

void PlanOut::drop() {
  if (buf32_ != nullptr) give_buffer(buf32_);
  if (buf64_ != nullptr) give_buffer(buf64_);
  buf32_ = buf64_ = nullptr;
}

}  // namespace di::sched
