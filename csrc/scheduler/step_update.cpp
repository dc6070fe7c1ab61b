// StepScheduler, results side: applying a step's sampled tokens (update), stop rules, request ends and the
// list upkeep they need. The planning side is in step_scheduler.cpp; step_scheduler.h has the accounting.
#include <algorithm>
#include <string>

#include "scheduler/errors.h"
#include "scheduler/step_scheduler.h"

namespace di::sched {

FinishReason StepScheduler::stop_reason(const Req& r, int32_t tok) const {
  const int64_t n_out = r.known - r.prompt_len;
  if (n_out >= r.min_tokens) {
    if (!r.ignore_eos && cfg_.eos_token_id >= 0 && tok == cfg_.eos_token_id) return FinishReason::STOP;
    if (r.has_stop)
      for (int32_t t : *r.stop_ids)
        if (t == tok) return FinishReason::STOP;
  }
  if (n_out >= r.max_tokens || r.known >= cfg_.max_model_len)
    return FinishReason::LENGTH;
  return FinishReason::NONE;
}

void StepScheduler::end(int32_t slot, FinishReason reason) {
  Req& r = at(slot);
  Ended e;
  e.seq_id = r.seq_id;
  e.reason = reason;
  e.num_preemptions = r.num_preemptions;
  r.flush();
  e.output.assign(r.tokens.begin() + r.prompt_len, r.tokens.end());
  if (r.kv_slots > 0) {
    if (reason == FinishReason::HANDOFF) {
      const int32_t* b = arena_.data(r.blocks);
      e.handoff_blocks.assign(b, b + r.blocks.n);
    }
    release(r);  // exactly once: ENDED requests hold nothing, so they are never freed again
  }
  if (r.status == Status::HANDOFF) --num_handoff_;
  r.status = Status::ENDED;
  r.reason = reason;
  --live_;
  lists_dirty_ = true;
  ended_.push_back(std::move(e));
}

void StepScheduler::compact_lists() {
  if (!lists_dirty_) return;
  auto gone = [&](int32_t slot) { return at(slot).status == Status::ENDED; };
  for (auto* v : {&waiting_, &prefilling_, &decoding_}) v->erase(std::remove_if(v->begin(), v->end(), gone), v->end());
  lists_dirty_ = false;
}

void StepScheduler::erase_if_done(int32_t slot) {
  Req& r = at(slot);
  if (!r.used || r.status != Status::ENDED || r.in_flight > 0) return;
  slot_of_.erase(r.seq_id);
  arena_.clear(r.blocks);  // (already empty: ended requests hold no blocks)
  r = Req{};  // drops its buffers
  free_slots_.push_back(slot);
}

std::vector<Ended> StepScheduler::update(int64_t step_id, const int32_t* sampled, int64_t n, const int32_t* counts,
                                         int64_t ncounts) {
  if (plans_.empty()) throw std::runtime_error("update: no plan is outstanding");
  const PlanRec& front = plans_.front();
  if (front.step_id != step_id)
    bad("plan.step_id=" + s(step_id) + ": updates must come in schedule order; the oldest outstanding plan is step " +
        s(front.step_id));
  const int64_t rows = static_cast<int64_t>(front.slots.size());
  if (counts == nullptr) {
    if (n != rows) bad("result: expected " + s(rows) + " sampled tokens (one per plan row), got " + s(n));
  } else {
    if (ncounts != rows) bad("num_sampled: expected " + s(rows) + " counts (one per plan row), got " + s(ncounts));
    int64_t sum = 0;
    for (int64_t k = 0; k < rows; ++k) {
      const int64_t lo = front.sample[k] ? 1 : 0, hi = front.sample[k] ? 1 + front.drafts[k] : 1;
      if (counts[k] < lo || counts[k] > hi)
        bad("num_sampled[" + s(k) + "]=" + s(counts[k]) + ": must be in [" + s(lo) + ", " + s(hi) +
            "] (a row yields its accepted drafts + one token)");
      sum += counts[k];
    }
    if (sum != n) bad("result: expected sum(num_sampled)=" + s(sum) + " tokens, got " + s(n));
  }
  PlanRec rec = std::move(plans_.front());
  plans_.pop_front();
  std::vector<int32_t> done;  // rows whose request has ended: erased once every list is compacted
  int64_t off = 0;
  const size_t nrows = rec.slots.size();
  for (size_t k = 0; k < nrows; ++k) {
    // Two-stage prefetch: the request's two hot lines 32 rows ahead; 16 rows ahead, for a request whose
    // stage is full (its token goes to the token buffer this step: a line elsewhere, the costliest
    // access of an update at 16k requests), the buffer's tail, whose address is in line 2. (An update
    // row is ~3x cheaper than a planning row, hence twice schedule_decode's distances.)
    if (k + 32 < nrows) {
      const char* p = reinterpret_cast<const char*>(&at(rec.slots[k + 32]));
      __builtin_prefetch(p, 1);
      __builtin_prefetch(p + 64, 1);
    }
    if (k + 16 < nrows) {
      const Req& a = at(rec.slots[k + 16]);
      if (a.nstage == kStage) __builtin_prefetch(a.tok_tail, 1);
    }
    const int32_t slot = rec.slots[k];
    Req& r = at(slot);
    if (r.seq_id != rec.seq_ids[k]) throw std::logic_error("scheduler: plan row points at a reused slot");
    const int32_t kd = rec.drafts[k];
    const int64_t m = counts == nullptr ? 1 : counts[k];
    const int32_t* toks = sampled + off;
    off += m;
    --r.in_flight;
    ++r.process_cnt;
    if (kd > 0) --r.spec_in_flight;
    if (r.status == Status::ENDED) {  // ended after this step was scheduled: slot discarded
      done.push_back(slot);
      continue;
    }
    if (!rec.sample[k]) continue;
    r.pending -= 1 + kd;
    bool ended = false;
    for (int64_t j = 0; j < m && !ended; ++j) {  // token by token: whatever follows a stop is dropped
      const int32_t tok = toks[j];
      if (tok < 0) {  // a bad sample fails its own request, not the batch
        end(slot, FinishReason::FAILED);
        ended = true;
        break;
      }
      r.push(tok);
      const FinishReason why = stop_reason(r, tok);
      if (why != FinishReason::NONE || r.status == Status::HANDOFF) {
        end(slot, why != FinishReason::NONE ? why : FinishReason::HANDOFF);
        ended = true;
      }
    }
    if (ended) {
      done.push_back(slot);
      continue;
    }
    if (kd > 0 && r.status == Status::DECODING) {
      // m - 1 drafts accepted: the KV of the 1 + kd - m rejected ones is stale; recompute from there
      // and give back the whole blocks past what the next step needs
      r.num_computed -= static_cast<int32_t>(1 + kd - m);
      const int64_t keep = round_up(r.num_computed + 1);
      if (keep < r.kv_slots && !r.protect) {  // a protected request keeps its whole reservation
        pool_.truncate(r.seq_id, keep);
        r.kv_slots = static_cast<int32_t>(keep);
        refresh_blocks(r);
      }
    }
  }
  compact_lists();
  for (int32_t slot : done) erase_if_done(slot);
  if (spare_recs_.size() < 2) spare_recs_.push_back(std::move(rec));  // its buffers serve a later plan
  std::vector<Ended> out;
  out.swap(ended_);
  // these ends are now reported; a slot still held by a row in flight stops counting as live
  for (const Ended& e : out) {
    auto it = slot_of_.find(e.seq_id);
    if (it != slot_of_.end()) at(it->second).reported = true;
  }
  return out;
}

}  // namespace di::sched
