// StepScheduler, KV side: block accounting against the pool (watermark / headroom checks, reservations,
// allocation and release) and prefix sharing at admission. The planning side is in step_scheduler.cpp,
// the results side in step_update.cpp; step_scheduler.h has the accounting every rule here refers to.
#include <algorithm>
#include <string>

#include "scheduler/errors.h"
#include "scheduler/step_scheduler.h"

namespace di::sched {

bool StepScheduler::fits_with_watermark(int64_t num_tokens) const {
  return fits_blocks_with_watermark(pool_.blocks_for_tokens(num_tokens));
}

void StepScheduler::set_prefix_sharing(int32_t align, int32_t tail) {
  if (align < 0 || (align > 0 && align % pool_.block_size() != 0))
    bad("prefix_align=" + s(align) + ": must be 0 (off) or a positive multiple of block_size=" + s(pool_.block_size()));
  if (tail < 1) bad("prefix_tail=" + s(tail) + ": must be >= 1 (the last token is always computed)");
  cfg_.prefix_align = align;
  cfg_.prefix_tail = tail;
}

int64_t StepScheduler::prefix_hit(const Req& r, std::vector<int32_t>& out) const {
  out.clear();
  if (cfg_.prefix_align <= 0 || cfg_.engine_type == EngineType::COMPLETION) return 0;
  const int64_t al = cfg_.prefix_align;
  const int64_t cap = std::max<int64_t>(0, static_cast<int64_t>(r.known) - cfg_.prefix_tail) / al * al;
  if (cap == 0 || pool_.num_cached_blocks() == 0) return 0;
  // (admission candidates are WAITING, so none of their tokens is staged: the buffer is whole)
  if (r.nstage != 0) throw std::logic_error("scheduler: prefix match over a request with staged tokens");
  static const std::string kNoKey;
  const int64_t got = pool_.match(r.tokens.data(), cap, kNoKey, out) / al * al;
  out.resize(static_cast<size_t>(got / pool_.block_size()));
  return got;
}

int64_t StepScheduler::admit_blocks(int64_t num_tokens, const std::vector<int32_t>& hit) const {
  // Fresh blocks for the rest, plus the shared ones that are only evictable now (they leave the free
  // count when revived); shared blocks in use by another request cost nothing.
  int64_t need = pool_.blocks_for_tokens(num_tokens) - static_cast<int64_t>(hit.size());
  for (int32_t b : hit) need += pool_.refcount(b) == 0;
  return need;
}

bool StepScheduler::fits_blocks_with_watermark(int64_t blocks) const {
  const int64_t running = num_running();
  int64_t keep = running == 0 ? 0 : cfg_.watermark_blocks;  // a lone request may use all
  if (running > 0 && cfg_.policy == Policy::GUARDED && cfg_.engine_type != EngineType::PROMPT) {
    // What the requests that will decode grow into over the next headroom_steps decode steps (one
    // token each a step, on average headroom_steps / block_size blocks each): admitting into that
    // space is what makes the next decode steps preempt, and the victim then waits here for the same
    // space again. (PROMPT engines never decode: their requests do not grow.)
    const int64_t bs = pool_.block_size();
    const int64_t growing = static_cast<int64_t>(prefilling_.size() + decoding_.size());
    keep += (growing * cfg_.headroom_steps + bs - 1) / bs;
  }
  return blocks + keep <= pool_.num_free_blocks();
}

int64_t StepScheduler::full_tokens(const Req& r) const {
  // The KV of every token it can ever feed (add_request checked this fits the pool).
  const int64_t gen = cfg_.engine_type == EngineType::PROMPT ? 1 : r.max_tokens;
  return r.prompt_len + gen - 1;
}

int64_t StepScheduler::admit_tokens(const Req& r) const {
  if (cfg_.policy == Policy::GUARDED && r.num_preemptions >= cfg_.max_preemptions)
    return std::max<int64_t>(r.total(), full_tokens(r));  // protected
  return r.total();
}

void StepScheduler::admitted(Req& r) {
  r.protect = cfg_.policy == Policy::GUARDED && r.num_preemptions >= cfg_.max_preemptions;
  // Protected requests sort before every other (they never need a block, so they are never the victim
  // the tail of the order gives), the rest by admission.
  r.order_key = r.protect ? next_admit_ - (int64_t{1} << 62) : next_admit_;
  ++next_admit_;
}

int64_t StepScheduler::round_up(int64_t num_tokens) const {
  const int64_t bs = pool_.block_size();
  return (num_tokens + bs - 1) / bs * bs;
}

bool StepScheduler::reserve(Req& r, int64_t num_tokens) {
  if (num_tokens <= r.kv_slots) return true;
  const int64_t extra = round_up(num_tokens) - r.kv_slots;
  if (!pool_.append_slots(r.seq_id, extra)) return false;
  r.kv_slots += extra;
  refresh_blocks(r);
  return true;
}

void StepScheduler::allocate(Req& r, int64_t num_tokens, const std::vector<int32_t>* hit) {
  const int64_t want = round_up(num_tokens);
  const bool ok = hit != nullptr && !hit->empty()
                      ? pool_.allocate_with_prefix(r.seq_id, want, hit->data(), static_cast<int64_t>(hit->size()))
                      : pool_.allocate(r.seq_id, want);
  if (!ok) throw std::logic_error("scheduler: allocate failed after a fit check");
  r.kv_slots = want;
  refresh_blocks(r);
}

void StepScheduler::release(Req& r) {
  if (r.kv_slots > 0 || pool_.contains(r.seq_id)) pool_.free(r.seq_id);
  r.kv_slots = 0;
  arena_.clear(r.blocks);
}

void StepScheduler::refresh_blocks(Req& r) {
  const std::vector<int32_t>& t = pool_.block_table(r.seq_id);
  arena_.assign(r.blocks, t.data(), static_cast<int32_t>(t.size()));
}

}  // namespace di::sched
