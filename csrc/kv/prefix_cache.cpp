// di::kv::BlockPool: prefix-cache half (content hashing, match, insertion, prefix-sharing allocation)
// and the invariant checker.
#include <algorithm>
#include <cstring>
#include <functional>

#include "kv/block_pool.h"

namespace di::kv {
namespace {

inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }
[[noreturn]] void broken(const std::string& msg) { throw std::logic_error("BlockPool invariant: " + msg); }

constexpr uint64_t kRootHash = 0x6b76707265666978ULL;  // "kvprefix"

}  // namespace

uint64_t BlockPool::block_hash(uint64_t parent, const int32_t* toks, const std::string& extra) const {
  uint64_t h = mix64(parent);
  if (!extra.empty()) h = mix64(h ^ std::hash<std::string>{}(extra));
  int32_t i = 0;
  // Two tokens per mixing round: half the multiplies of a token-at-a-time loop.
  for (; i + 1 < block_size_; i += 2) {
    uint64_t pair = (static_cast<uint64_t>(static_cast<uint32_t>(toks[i])) << 32) | static_cast<uint32_t>(toks[i + 1]);
    h = mix64(h ^ pair);
  }
  if (i < block_size_) h = mix64(h ^ static_cast<uint32_t>(toks[i]));
  return h & hash_mask_;
}

int32_t BlockPool::find_cached(uint64_t hash, uint64_t parent_node, const int32_t* toks,
                               const std::string& extra) const {
  auto range = by_hash_.equal_range(hash);
  for (auto it = range.first; it != range.second; ++it) {
    int32_t b = it->second;
    // The hash only narrows the search; identity is verified exactly, so collisions cannot alias.
    if (parent_node_[b] == parent_node && extra_[b] == extra &&
        std::memcmp(&tokens_[static_cast<size_t>(b) * block_size_], toks, sizeof(int32_t) * block_size_) == 0)
      return b;
  }
  return 0;
}

void BlockPool::set_hash_mask_for_testing(uint64_t mask) {
  if (num_cached_ != 0) bad("set_hash_mask_for_testing: the cache must be empty");
  hash_mask_ = mask;
}

bool BlockPool::is_cached(int32_t block) const {
  if (block < 0 || block >= num_blocks_) bad("block id out of range: " + std::to_string(block));
  return node_[block] != 0;
}

int64_t BlockPool::match(const int32_t* tokens, int64_t n, const std::string& extra, std::vector<int32_t>& out) const {
  if (n < 0) bad("match: n must be >= 0");
  if (num_cached_ == 0) return 0;
  uint64_t h = kRootHash, parent = 0;
  int64_t full = n / block_size_, k = 0;
  for (; k < full; ++k) {
    const int32_t* t = tokens + k * block_size_;
    h = block_hash(h, t, extra);
    int32_t b = find_cached(h, parent, t, extra);
    if (b == 0) break;
    out.push_back(b);
    parent = node_[b];
  }
  return k * block_size_;
}

int64_t BlockPool::cache_blocks(const int32_t* tokens, int64_t n, const int32_t* blocks, int64_t nblocks,
                                const std::string& extra) {
  if (n < 0) bad("cache_blocks: n must be >= 0");
  if (nblocks < 0) bad("cache_blocks: nblocks must be >= 0");
  int64_t full = std::min<int64_t>(n / block_size_, nblocks);
  for (int64_t i = 0; i < full; ++i) {
    int32_t b = blocks[i];
    if (b <= 0 || b >= num_blocks_) bad("cache_blocks: block id " + std::to_string(b) + " out of range [1, " + std::to_string(num_blocks_) + ")");
    if (refcount_[b] == 0) bad("cache_blocks: block " + std::to_string(b) + " is not in use (refcount 0)");
  }
  if (tokens_.empty()) tokens_.assign(static_cast<size_t>(num_blocks_) * block_size_, 0);
  uint64_t h = kRootHash, parent = 0;
  int64_t added = 0;
  for (int64_t i = 0; i < full; ++i) {
    const int32_t* t = tokens + i * block_size_;
    h = block_hash(h, t, extra);
    int32_t existing = find_cached(h, parent, t, extra);
    if (existing != 0) {  // same content already cached (maybe this very block): follow its chain
      parent = node_[existing];
      continue;
    }
    int32_t b = blocks[i];
    if (node_[b] != 0) {
      // Already cached under another parent node with the same content chain (same chained hash,
      // same tokens): that happens when its old parent was evicted and the prefix re-cached in other
      // blocks. Adopt it under the live parent; its node id, and so its children, stay valid.
      if (hash_[b] == h && extra_[b] == extra &&
          std::memcmp(&tokens_[static_cast<size_t>(b) * block_size_], t, sizeof(int32_t) * block_size_) == 0) {
        parent_node_[b] = parent;
        parent = node_[b];
        continue;
      }
      bad("cache_blocks: block " + std::to_string(b) + " is already cached with different content");
    }
    node_[b] = next_node_++;
    hash_[b] = h;
    parent_node_[b] = parent;
    extra_[b] = extra;
    std::memcpy(&tokens_[static_cast<size_t>(b) * block_size_], t, sizeof(int32_t) * block_size_);
    by_hash_.emplace(h, b);
    ++num_cached_;
    ++added;
    parent = node_[b];
  }
  return added;
}

int64_t BlockPool::cache_seq(int64_t seq_id, const int32_t* tokens, int64_t n, const std::string& extra) {
  const Seq& s = seq_at(seq_id);
  if (n > s.num_tokens)
    bad("cache_seq: " + std::to_string(n) + " tokens given but seq_id " + std::to_string(seq_id) + " holds " +
        std::to_string(s.num_tokens));
  // Copy: cache_blocks does not touch tables, but keep it independent of the Seq's storage anyway.
  std::vector<int32_t> blocks = s.blocks;
  return cache_blocks(tokens, n, blocks.data(), static_cast<int64_t>(blocks.size()), extra);
}

bool BlockPool::allocate_with_prefix(int64_t seq_id, int64_t num_tokens, const int32_t* prefix, int64_t k) {
  if (num_tokens < 0) bad("allocate: num_tokens must be >= 0, got " + std::to_string(num_tokens));
  if (seqs_.count(seq_id)) bad("allocate: seq_id " + std::to_string(seq_id) + " already exists");
  int64_t total = blocks_for_tokens(num_tokens);
  if (k < 0 || k > total)
    bad("allocate: " + std::to_string(k) + " prefix blocks for " + std::to_string(num_tokens) + " tokens (at most " +
        std::to_string(total) + ")");
  int64_t revive = 0;
  if (k > 0) {
    std::vector<int32_t> sorted(prefix, prefix + k);
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) bad("allocate: prefix blocks repeat");
    for (int64_t i = 0; i < k; ++i) {
      int32_t b = prefix[i];
      if (b <= 0 || b >= num_blocks_) bad("allocate: prefix block id " + std::to_string(b) + " out of range");
      if (refcount_[b] == 0 && node_[b] == 0)
        bad("allocate: prefix block " + std::to_string(b) + " is free (stale match result?)");
      if (refcount_[b] == 0) ++revive;
    }
  }
  // Revived cached blocks leave the evictable set, so they are paid for out of the free count too.
  if (total - k + revive > num_free_blocks()) return false;
  Seq s;
  s.num_tokens = num_tokens;
  s.blocks.reserve(static_cast<size_t>(total));
  for (int64_t i = 0; i < k; ++i) {
    int32_t b = prefix[i];
    if (refcount_[b] == 0) lru_remove(b);
    ++refcount_[b];
    s.blocks.push_back(b);
  }
  for (int64_t i = k; i < total; ++i) s.blocks.push_back(take_block());
  seqs_.emplace(seq_id, std::move(s));
  return true;
}

int64_t BlockPool::allocate_cached(int64_t seq_id, const int32_t* tokens, int64_t n, const std::string& extra) {
  std::vector<int32_t> hit;
  int64_t cached = match(tokens, n, extra, hit);
  if (!allocate_with_prefix(seq_id, n, hit.data(), static_cast<int64_t>(hit.size()))) return -1;
  return cached;
}

void BlockPool::check_invariants() const {
  std::vector<int32_t> users(num_blocks_, 0);
  for (const auto& [id, s] : seqs_) {
    if (static_cast<int64_t>(s.blocks.size()) != blocks_for_tokens(s.num_tokens))
      broken("seq " + std::to_string(id) + " has " + std::to_string(s.blocks.size()) + " blocks for " +
             std::to_string(s.num_tokens) + " tokens");
    for (int32_t b : s.blocks) {
      if (b <= 0 || b >= num_blocks_) broken("seq " + std::to_string(id) + " holds block id " + std::to_string(b));
      ++users[b];
    }
  }
  if (refcount_[0] != 0) broken("null block has a refcount");
  std::vector<uint8_t> in_free(num_blocks_, 0);
  for (int32_t b : free_stack_) {
    if (b <= 0 || b >= num_blocks_) broken("free list holds block id " + std::to_string(b));
    if (in_free[b]++) broken("block " + std::to_string(b) + " twice on the free list");
  }
  int32_t lru_len = 0, prev = -1;
  for (int32_t b = lru_head_; b >= 0; prev = b, b = next_[b]) {
    if (prev_[b] != prev) broken("LRU back link broken at block " + std::to_string(b));
    if (!on_lru_[b]) broken("LRU flag missing on block " + std::to_string(b));
    if (++lru_len > num_blocks_) broken("LRU cycle");
  }
  if (prev != lru_tail_) broken("LRU tail mismatch");
  if (lru_len != num_evictable_) broken("LRU length != num_evictable");
  int32_t cached = 0;
  for (int32_t b = 1; b < num_blocks_; ++b) {
    if (refcount_[b] != users[b])
      broken("block " + std::to_string(b) + " refcount " + std::to_string(refcount_[b]) + " but " +
             std::to_string(users[b]) + " users");
    bool is_cached = node_[b] != 0;
    cached += is_cached;
    int states = (refcount_[b] > 0) + in_free[b] + on_lru_[b];
    if (states != 1) broken("block " + std::to_string(b) + " is in " + std::to_string(states) + " states");
    if (on_lru_[b] && !is_cached) broken("uncached block " + std::to_string(b) + " on the LRU");
    if (in_free[b] && is_cached) broken("cached block " + std::to_string(b) + " on the plain free list");
  }
  if (cached != num_cached_) broken("num_cached mismatch");
  if (static_cast<int64_t>(by_hash_.size()) != num_cached_) broken("hash map size != num_cached");
  for (const auto& [h, b] : by_hash_)
    if (node_[b] == 0 || hash_[b] != h) broken("hash map entry for uncached block " + std::to_string(b));
}

}  // namespace di::kv
