// Paged KV block pool: reference-counted fixed-size blocks, per-sequence block tables, and an
// optional content-addressed prefix cache over full blocks. No torch, no Python: the scheduler's C++
// links against this header directly; _C.kv.BlockPool binds it for Python (kv_bindings.cpp).
//
// Block states (every block id in [1, num_blocks) is in exactly one):
//   used       refcount > 0 (held by >= 1 sequence table)
//   cached     refcount == 0, content registered in the prefix cache; on the LRU "evictable" list.
//              Counts as free: allocation evicts the least recently released cached block when the
//              plain free list is empty.
//   free       refcount == 0, no content; on the plain free stack.
// Block 0 is the null block: never handed out, used as padding in block tables.
//
// Fork and copy-on-write: fork() shares every block, the partially filled last block included. The
// pool owns copy-on-write: when append_slots() would write into a last block that is partially filled
// and shared (refcount > 1), that sequence gets a fresh block instead and the pool queues a copy op
// (src, dst, valid tokens) that the caller must execute on the KV memory before the next forward
// (take_copy_ops()). can_append()/append_slots() count that extra block.
//
// Prefix cache exactness: keys are 64-bit chained content hashes (parent hash, block tokens, extra
// key), but a hit is only returned after verifying the stored tokens, the extra key and the parent's
// unique node id, so a hash collision can never return wrong KV. Node ids are never reused: after a
// parent block is evicted its cached children become unreachable (they age out of the LRU).
//
// Not thread-safe: one owner calls it (the GIL-released sections never run concurrently with another
// call on the same pool as long as the Python side does not share a pool across threads).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace di::kv {

// One deferred copy-on-write: copy the first `num_tokens` token slots of block `src` into `dst`.
struct CopyOp {
  int32_t src;
  int32_t dst;
  int32_t num_tokens;
};

class BlockPool {
 public:
  BlockPool(int32_t num_blocks, int32_t block_size);  // block 0 = null block, never handed out

  int32_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return num_blocks_; }
  // Plain free blocks plus evictable cached blocks (both can be handed out right now).
  int32_t num_free_blocks() const;
  int64_t blocks_for_tokens(int64_t num_tokens) const;  // ceil(num_tokens / block_size)
  bool can_allocate(int64_t num_tokens) const;
  // false + no change if it does not fit; std::invalid_argument if seq exists / n < 0.
  bool allocate(int64_t seq_id, int64_t num_tokens);
  bool can_append(int64_t seq_id, int64_t num_tokens) const;
  bool append_slots(int64_t seq_id, int64_t num_tokens);  // false + no change if it does not fit
  void free(int64_t seq_id);                               // std::invalid_argument if unknown
  void fork(int64_t seq_id, int64_t child_id);             // child shares all blocks (refcount++)
  bool contains(int64_t seq_id) const;
  int64_t num_tokens(int64_t seq_id) const;
  const std::vector<int32_t>& block_table(int64_t seq_id) const;
  // Rows of `out` [n, width] filled with each seq's table, padded with 0; width must be >= max len.
  void fill_block_tables(const int64_t* seq_ids, int64_t n, int32_t* out, int64_t width) const;

  // ---- additions beyond the fixed interface ----
  int64_t num_seqs() const { return static_cast<int64_t>(seqs_.size()); }
  int32_t refcount(int32_t block) const;
  int64_t max_blocks_per_seq(const int64_t* seq_ids, int64_t n) const;
  // Flat KV slot of token `pos` of a sequence: block_table[pos / bs] * bs + pos % bs.
  int64_t slot(int64_t seq_id, int64_t pos) const;
  // Batched flat slots: for each i, positions [starts[i], starts[i] + counts[i]) of seq_ids[i], written
  // consecutively to `out` (sum(counts) entries). ratio > 1 maps compressed-entry indices instead: a
  // block holds block_size / ratio entries, entry e of a sequence lives at
  // table[e / epb] * epb + e % epb (epb = block_size / ratio) and must be < floor(num_tokens / ratio).
  void fill_slot_mapping(const int64_t* seq_ids, const int64_t* starts, const int64_t* counts, int64_t n,
                         int64_t ratio, int64_t* out) const;
  // Shrink a sequence to `num_tokens` (<= current), releasing whole trailing blocks (e.g. rejected
  // speculative tokens). Writing again into a now-partial shared/cached block goes through COW.
  void truncate(int64_t seq_id, int64_t num_tokens);
  // Deferred copy-on-write copies since the last call (cleared by the call).
  std::vector<CopyOp> take_copy_ops();
  int64_t num_pending_copy_ops() const { return static_cast<int64_t>(copy_ops_.size()); }

  // Prefix cache. Tokens are int32 ids; `extra` is an optional key (e.g. cache salt, LoRA id) that is
  // part of every block's identity.
  int32_t num_cached_blocks() const { return num_cached_; }  // blocks with a cache entry (any refcount)
  int32_t num_evictable_blocks() const { return num_evictable_; }
  bool is_cached(int32_t block) const;  // block has a prefix-cache entry (any refcount)
  // Longest run of cached full blocks matching the prefix of tokens; appends their ids to `out`.
  // Does not change any state. The result is valid until the next allocating call.
  int64_t match(const int32_t* tokens, int64_t n, const std::string& extra, std::vector<int32_t>& out) const;
  // Register the full blocks of `tokens` held in `blocks` (all must be in use). Blocks whose content
  // is already cached elsewhere are left uncached; returns how many new entries were made.
  int64_t cache_blocks(const int32_t* tokens, int64_t n, const int32_t* blocks, int64_t nblocks,
                       const std::string& extra);
  // cache_blocks with the sequence's own table; `tokens` are the sequence's first n tokens.
  int64_t cache_seq(int64_t seq_id, const int32_t* tokens, int64_t n, const std::string& extra);
  // New sequence whose first `k` blocks are the given (cached or in-use) blocks, shared by refcount;
  // the rest of ceil(num_tokens / bs) are fresh. false + no change if the fresh ones do not fit.
  bool allocate_with_prefix(int64_t seq_id, int64_t num_tokens, const int32_t* prefix, int64_t k);
  // match + allocate_with_prefix in one step (no window for eviction in between). Returns the number
  // of cached tokens reused, or -1 if it does not fit (no change).
  int64_t allocate_cached(int64_t seq_id, const int32_t* tokens, int64_t n, const std::string& extra);
  // Drop every evictable cached entry (their blocks become plain free). Returns how many.
  int64_t evict_all_cached();

  // Testing only: keep just the `mask` bits of every hash so collisions become common (must be set
  // while nothing is cached). Correctness must not depend on the hash: hits are verified exactly.
  void set_hash_mask_for_testing(uint64_t mask);

  // Full consistency check (O(num_blocks + total table length)); throws std::logic_error.
  void check_invariants() const;

 private:
  struct Seq {
    std::vector<int32_t> blocks;
    int64_t num_tokens = 0;
  };
  Seq& seq_at(int64_t seq_id);
  const Seq& seq_at(int64_t seq_id) const;
  int64_t extra_blocks_for_append(const Seq& s, int64_t num_tokens) const;
  int32_t take_block();            // pops a plain free block, else evicts the LRU cached one
  void release_block(int32_t b);   // refcount--, to the free or evictable list at zero
  void lru_push_back(int32_t b);
  void lru_remove(int32_t b);
  void uncache(int32_t b);
  uint64_t block_hash(uint64_t parent, const int32_t* toks, const std::string& extra) const;
  // Cached block with (parent node, tokens, extra) or 0.
  int32_t find_cached(uint64_t hash, uint64_t parent_node, const int32_t* toks, const std::string& extra) const;

  int32_t num_blocks_;
  int32_t block_size_;
  std::vector<int32_t> refcount_;
  std::vector<int32_t> free_stack_;  // plain free blocks
  std::unordered_map<int64_t, Seq> seqs_;
  std::vector<CopyOp> copy_ops_;

  // Prefix cache, per block (node_ == 0: not cached).
  std::vector<uint64_t> node_;         // unique, never-reused node id of the cache entry
  std::vector<uint64_t> hash_;         // chained content hash
  std::vector<uint64_t> parent_node_;  // node id of the parent block's entry (0 = root)
  std::vector<int32_t> tokens_;        // [num_blocks * block_size] tokens of cached blocks
  std::vector<std::string> extra_;
  std::unordered_multimap<uint64_t, int32_t> by_hash_;
  uint64_t next_node_ = 1;
  uint64_t hash_mask_ = ~uint64_t{0};
  int32_t num_cached_ = 0;
  // Evictable LRU (intrusive doubly linked list over block ids; -1 = none). Head = oldest.
  std::vector<int32_t> prev_, next_;
  std::vector<uint8_t> on_lru_;
  int32_t lru_head_ = -1, lru_tail_ = -1;
  int32_t num_evictable_ = 0;
};

}  // namespace di::kv
