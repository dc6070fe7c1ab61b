// Memory of the planner that grows with the number of running requests: huge-page backed allocations
// for the big per-request arrays, recycled flat buffers that a plan is written into and that Python
// then owns without a copy, and Col, the plain region view the planner appends a plan's fields to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>

namespace di::sched {

// Allocations of >= kHugeMin bytes are rounded up to whole 2 MiB pages, 2 MiB aligned and
// madvise(MADV_HUGEPAGE)'d, so that they are
// backed by transparent huge pages (THP in "madvise" mode, the common default). Why: at 16k running
// requests the request slots, block-id arena and plan buffers span thousands of 4 KiB pages touched
// every step, more than the TLB covers; the misses were about a quarter of a step (measured with
// glibc's hugetlb tunable, which does the same for every malloc). Smaller ones come from operator new,
// 64-byte aligned (request slots are cache-line aligned).
inline constexpr size_t kHugeMin = size_t{256} << 10;
void* huge_alloc(size_t bytes);          // throws std::bad_alloc
void huge_free(void* p, size_t bytes) noexcept;  // `bytes` as given to huge_alloc

// A std allocator over a pair of functions (the huge-page and slab allocators below).
template <typename T, void* (*Alloc)(size_t), void (*Free)(void*, size_t) noexcept>
struct FnAllocator {
  using value_type = T;
  template <typename U>
  struct rebind {
    using other = FnAllocator<U, Alloc, Free>;
  };
  FnAllocator() = default;
  template <typename U>
  FnAllocator(const FnAllocator<U, Alloc, Free>&) noexcept {}  // NOLINT(google-explicit-constructor)
  T* allocate(size_t n) { return static_cast<T*>(Alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { Free(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const FnAllocator<U, Alloc, Free>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const FnAllocator<U, Alloc, Free>&) const noexcept { return false; }
};

template <typename T>
using HugeAllocator = FnAllocator<T, huge_alloc, huge_free>;

// Small per-request buffers (a request's token buffer) carved from 2 MiB huge-page slabs, by power-of-two
// size class (64 bytes to 64 KiB; larger ones come from operator new). Why: a decoding request's token
// buffer is written once per output stage flush, each on a page of its own; as malloc'ed buffers at 16k
// requests those were thousands of 4 KiB pages, and the page walk was about a third of a flush's cost.
// Freed chunks are kept for reuse (per class) and slabs are never returned to the system: the memory
// held is the process's peak of live token buffers. Thread-safe (one mutex; allocations are rare: a
// request's arrival, a buffer doubling, its end).
void* slab_alloc(size_t bytes);
void slab_free(void* p, size_t bytes) noexcept;  // `bytes` as given to slab_alloc

template <typename T>
using SlabAllocator = FnAllocator<T, slab_alloc, slab_free>;

// Flat buffers handed from the planner to Python: a plan is written straight into one and Python's
// numpy array owns it afterwards (the previous design built the plan in vectors and copied it into a
// fresh array: at 16k rows x 33 blocks that second pass over ~2 MB was ~20% of a step). A dropped
// buffer of >= 64 KiB goes to a small process-wide free list (a fresh multi-megabyte allocation was
// page-faulted in on every step: ~15% of a 16k-row step). Thread-safe; never destroyed (arrays may
// outlive module teardown).
void* take_buffer(size_t bytes);  // data pointer (capacity >= bytes)
void give_buffer(void* data) noexcept;

// A region of a plan buffer that fields are appended to. No capacity check: the planner sizes each
// region from a bound on the step's rows / tokens before planning (and checks the bound per row).
template <typename T>
class Col {
 public:
  void bind(T* p) { p_ = p; }  // keeps the size (rebinding after the buffer moved)
  void clear() { n_ = 0; }
  void push_back(T v) { p_[n_++] = v; }
  void append(const T* src, size_t len) {
    if (len) std::memcpy(p_ + n_, src, len * sizeof(T));
    n_ += len;
  }
  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  T back() const { return p_[n_ - 1]; }
  T operator[](size_t i) const { return p_[i]; }
  const T* begin() const { return p_; }
  const T* end() const { return p_ + n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace di::sched
