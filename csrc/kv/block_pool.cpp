// di::kv::BlockPool implementation (see block_pool.h for the block states and the COW rule).
#include "kv/block_pool.h"

#include <algorithm>
#include <cstring>

namespace di::kv {
namespace {

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }
[[noreturn]] void broken(const std::string& msg) { throw std::logic_error("BlockPool invariant: " + msg); }

}  // namespace

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size) : num_blocks_(num_blocks), block_size_(block_size) {
  if (num_blocks < 1) bad("num_blocks must be >= 1 (block 0 is the reserved null block), got " + std::to_string(num_blocks));
  if (block_size < 1) bad("block_size must be >= 1, got " + std::to_string(block_size));
  if (static_cast<int64_t>(num_blocks) * block_size > (int64_t{1} << 40))
    bad("num_blocks * block_size too large");
  refcount_.assign(num_blocks, 0);
  free_stack_.reserve(num_blocks);
  // Pushed in reverse so that the first allocations get low block ids (easier to read in tests).
  for (int32_t b = num_blocks - 1; b >= 1; --b) free_stack_.push_back(b);
  node_.assign(num_blocks, 0);
  hash_.assign(num_blocks, 0);
  parent_node_.assign(num_blocks, 0);
  extra_.assign(num_blocks, std::string());
  prev_.assign(num_blocks, -1);
  next_.assign(num_blocks, -1);
  on_lru_.assign(num_blocks, 0);
}

int32_t BlockPool::num_free_blocks() const {
  return static_cast<int32_t>(free_stack_.size()) + num_evictable_;
}

int64_t BlockPool::blocks_for_tokens(int64_t num_tokens) const {
  if (num_tokens < 0) bad("num_tokens must be >= 0, got " + std::to_string(num_tokens));
  return (num_tokens + block_size_ - 1) / block_size_;
}

bool BlockPool::can_allocate(int64_t num_tokens) const {
  return blocks_for_tokens(num_tokens) <= num_free_blocks();
}

BlockPool::Seq& BlockPool::seq_at(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) bad("unknown seq_id " + std::to_string(seq_id));
  return it->second;
}

const BlockPool::Seq& BlockPool::seq_at(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) bad("unknown seq_id " + std::to_string(seq_id));
  return it->second;
}

bool BlockPool::allocate(int64_t seq_id, int64_t num_tokens) {
  return allocate_with_prefix(seq_id, num_tokens, nullptr, 0);
}

int64_t BlockPool::extra_blocks_for_append(const Seq& s, int64_t num_tokens) const {
  if (num_tokens < 0) bad("num_tokens must be >= 0, got " + std::to_string(num_tokens));
  if (num_tokens == 0) return 0;
  int64_t grow = blocks_for_tokens(s.num_tokens + num_tokens) - static_cast<int64_t>(s.blocks.size());
  // Copy-on-write: writing into a partially filled last block that someone else also reads (a fork,
  // or the prefix cache) needs a private copy first.
  int64_t cow = 0;
  if (s.num_tokens % block_size_ != 0 && !s.blocks.empty()) {
    int32_t last = s.blocks.back();
    if (refcount_[last] > 1 || node_[last] != 0) cow = 1;
  }
  return grow + cow;
}

bool BlockPool::can_append(int64_t seq_id, int64_t num_tokens) const {
  return extra_blocks_for_append(seq_at(seq_id), num_tokens) <= num_free_blocks();
}

bool BlockPool::append_slots(int64_t seq_id, int64_t num_tokens) {
  Seq& s = seq_at(seq_id);
  int64_t need = extra_blocks_for_append(s, num_tokens);
  if (need > num_free_blocks()) return false;
  if (num_tokens == 0) return true;
  int64_t partial = s.num_tokens % block_size_;
  if (partial != 0) {
    int32_t last = s.blocks.back();
    if (refcount_[last] > 1 || node_[last] != 0) {
      int32_t fresh = take_block();
      copy_ops_.push_back({last, fresh, static_cast<int32_t>(partial)});
      s.blocks.back() = fresh;
      release_block(last);
    }
  }
  s.num_tokens += num_tokens;
  int64_t target = blocks_for_tokens(s.num_tokens);
  while (static_cast<int64_t>(s.blocks.size()) < target) s.blocks.push_back(take_block());
  return true;
}

void BlockPool::free(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) bad("free: unknown seq_id " + std::to_string(seq_id));
  // Release the tail first: cached tail blocks then sit nearer the LRU head and are evicted before the
  // shared-looking head of the prompt.
  const auto& blocks = it->second.blocks;
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) release_block(*b);
  seqs_.erase(it);
}

void BlockPool::fork(int64_t seq_id, int64_t child_id) {
  if (seqs_.count(child_id)) bad("fork: child seq_id " + std::to_string(child_id) + " already exists");
  const Seq& parent = seq_at(seq_id);
  Seq child = parent;
  for (int32_t b : child.blocks) ++refcount_[b];
  seqs_.emplace(child_id, std::move(child));
}

bool BlockPool::contains(int64_t seq_id) const { return seqs_.count(seq_id) != 0; }

int64_t BlockPool::num_tokens(int64_t seq_id) const { return seq_at(seq_id).num_tokens; }

const std::vector<int32_t>& BlockPool::block_table(int64_t seq_id) const { return seq_at(seq_id).blocks; }

int64_t BlockPool::max_blocks_per_seq(const int64_t* seq_ids, int64_t n) const {
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max<int64_t>(m, seq_at(seq_ids[i]).blocks.size());
  return m;
}

void BlockPool::fill_block_tables(const int64_t* seq_ids, int64_t n, int32_t* out, int64_t width) const {
  if (n < 0) bad("fill_block_tables: n must be >= 0");
  if (width < 0) bad("fill_block_tables: width must be >= 0");
  // Validate everything before writing so a bad id leaves `out` untouched.
  std::vector<const Seq*> rows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const Seq& s = seq_at(seq_ids[i]);
    if (static_cast<int64_t>(s.blocks.size()) > width)
      bad("fill_block_tables: width " + std::to_string(width) + " < " + std::to_string(s.blocks.size()) +
          " blocks of seq_id " + std::to_string(seq_ids[i]));
    rows[i] = &s;
  }
  for (int64_t i = 0; i < n; ++i) {
    int32_t* row = out + i * width;
    const auto& b = rows[i]->blocks;
    if (!b.empty()) std::memcpy(row, b.data(), b.size() * sizeof(int32_t));
    std::fill(row + b.size(), row + width, 0);
  }
}

int32_t BlockPool::refcount(int32_t block) const {
  if (block < 0 || block >= num_blocks_) bad("block id out of range: " + std::to_string(block));
  return refcount_[block];
}

int64_t BlockPool::slot(int64_t seq_id, int64_t pos) const {
  const Seq& s = seq_at(seq_id);
  if (pos < 0 || pos >= s.num_tokens)
    bad("slot: pos " + std::to_string(pos) + " outside [0, " + std::to_string(s.num_tokens) + ")");
  return static_cast<int64_t>(s.blocks[pos / block_size_]) * block_size_ + pos % block_size_;
}

void BlockPool::fill_slot_mapping(const int64_t* seq_ids, const int64_t* starts, const int64_t* counts, int64_t n,
                                  int64_t ratio, int64_t* out) const {
  if (ratio < 1 || block_size_ % ratio != 0)
    bad("slot mapping: ratio must be >= 1 and divide block_size " + std::to_string(block_size_) + ", got " +
        std::to_string(ratio));
  const int64_t epb = block_size_ / ratio;
  std::vector<const Seq*> rows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {  // validate everything first: a bad row leaves `out` untouched
    const Seq& s = seq_at(seq_ids[i]);
    const int64_t limit = s.num_tokens / ratio;
    if (starts[i] < 0 || counts[i] < 0 || starts[i] + counts[i] > limit)
      bad("slot mapping: [" + std::to_string(starts[i]) + ", " + std::to_string(starts[i] + counts[i]) +
          ") outside the " + std::to_string(limit) + (ratio == 1 ? " tokens" : " complete entries") + " of seq_id " +
          std::to_string(seq_ids[i]));
    rows[i] = &s;
  }
  for (int64_t i = 0; i < n; ++i) {
    const auto& b = rows[i]->blocks;
    for (int64_t e = starts[i], end = starts[i] + counts[i]; e < end; ++e)
      *out++ = static_cast<int64_t>(b[e / epb]) * epb + e % epb;
  }
}

void BlockPool::truncate(int64_t seq_id, int64_t num_tokens) {
  Seq& s = seq_at(seq_id);
  if (num_tokens < 0 || num_tokens > s.num_tokens)
    bad("truncate: num_tokens must be in [0, " + std::to_string(s.num_tokens) + "] for seq_id " +
        std::to_string(seq_id) + ", got " + std::to_string(num_tokens));
  const int64_t keep = blocks_for_tokens(num_tokens);
  while (static_cast<int64_t>(s.blocks.size()) > keep) {
    release_block(s.blocks.back());
    s.blocks.pop_back();
  }
  s.num_tokens = num_tokens;
}

std::vector<CopyOp> BlockPool::take_copy_ops() {
  std::vector<CopyOp> out;
  out.swap(copy_ops_);
  return out;
}

// ---- free lists ----

int32_t BlockPool::take_block() {
  int32_t b;
  if (!free_stack_.empty()) {
    b = free_stack_.back();
    free_stack_.pop_back();
  } else {
    if (lru_head_ < 0) broken("take_block with nothing free");
    b = lru_head_;
    lru_remove(b);
    uncache(b);
  }
  refcount_[b] = 1;
  return b;
}

void BlockPool::release_block(int32_t b) {
  if (--refcount_[b] == 0) {
    if (node_[b] != 0) lru_push_back(b);
    else free_stack_.push_back(b);
  }
}

void BlockPool::lru_push_back(int32_t b) {
  prev_[b] = lru_tail_;
  next_[b] = -1;
  if (lru_tail_ >= 0) next_[lru_tail_] = b;
  else lru_head_ = b;
  lru_tail_ = b;
  on_lru_[b] = 1;
  ++num_evictable_;
}

void BlockPool::lru_remove(int32_t b) {
  if (prev_[b] >= 0) next_[prev_[b]] = next_[b];
  else lru_head_ = next_[b];
  if (next_[b] >= 0) prev_[next_[b]] = prev_[b];
  else lru_tail_ = prev_[b];
  prev_[b] = next_[b] = -1;
  on_lru_[b] = 0;
  --num_evictable_;
}

void BlockPool::uncache(int32_t b) {
  auto range = by_hash_.equal_range(hash_[b]);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second == b) {
      by_hash_.erase(it);
      break;
    }
  }
  node_[b] = 0;
  hash_[b] = 0;
  parent_node_[b] = 0;
  extra_[b].clear();
  --num_cached_;
}

int64_t BlockPool::evict_all_cached() {
  int64_t n = 0;
  while (lru_head_ >= 0) {
    int32_t b = lru_head_;
    lru_remove(b);
    uncache(b);
    free_stack_.push_back(b);
    ++n;
  }
  return n;
}

}  // namespace di::kv
