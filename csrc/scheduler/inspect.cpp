// StepScheduler inspection: per-request facts for tests and tools, and the full invariant check.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "scheduler/errors.h"
#include "scheduler/step_scheduler.h"

namespace di::sched {

std::vector<int64_t> StepScheduler::request_info(int64_t seq_id) const {
  auto it = slot_of_.find(seq_id);
  if (it == slot_of_.end()) bad("seq_id=" + s(seq_id) + ": unknown (never added, or ended and processed)");
  const Req& r = at(it->second);
  return {static_cast<int64_t>(r.status), r.num_computed, r.pending, r.schedule_cnt, r.process_cnt,
          r.num_preemptions, r.output_len()};
}

std::vector<int32_t> StepScheduler::output_tokens(int64_t seq_id) const {
  auto it = slot_of_.find(seq_id);
  if (it == slot_of_.end()) bad("seq_id=" + s(seq_id) + ": unknown (never added, or ended and processed)");
  const Req& r = at(it->second);
  std::vector<int32_t> out(r.tokens.begin() + r.prompt_len, r.tokens.end());
  out.insert(out.end(), r.stage, r.stage + r.nstage);
  return out;
}

void StepScheduler::check_invariants() const {
  auto fail = [](const std::string& m) { throw std::logic_error("scheduler invariant: " + m); };
  int64_t live = 0, handoff = 0;
  std::vector<int> where(slots_.size(), 0);
  for (int32_t x : waiting_) where[x] |= 1;
  for (int32_t x : prefilling_) where[x] |= 2;
  for (int32_t x : decoding_) where[x] |= 4;
  for (size_t slot = 0; slot < slots_.size(); ++slot) {
    const Req& r = slots_[slot];
    if (!r.used) continue;
    const std::string id = "seq " + s(r.seq_id) + ": ";
    const int want = r.status == Status::WAITING ? 1 : r.status == Status::PREFILLING ? 2
                   : r.status == Status::DECODING ? 4 : 0;
    if (where[slot] != want) fail(id + "list membership does not match its status");
    const bool holds = r.status == Status::PREFILLING || r.status == Status::DECODING || r.status == Status::HANDOFF;
    if (holds != pool_.contains(r.seq_id)) fail(id + "holds blocks iff running");
    if (holds != (r.kv_slots > 0)) fail(id + "reservation does not match the pool");
    if (holds && pool_.num_tokens(r.seq_id) != r.kv_slots) fail(id + "reserved slots differ from the pool's");
    if (holds) {
      const std::vector<int32_t>& t = pool_.block_table(r.seq_id);
      if (static_cast<int32_t>(t.size()) != r.blocks.n || !std::equal(t.begin(), t.end(), arena_.data(r.blocks)))
        fail(id + "block-table mirror differs from the pool's");
    }
    if (!holds && r.blocks.cls >= 0) fail(id + "holds a block-table chunk but no blocks");
    if (r.kv_slots % pool_.block_size() != 0) fail(id + "reservation is not whole blocks");
    if (r.protect && holds && r.kv_slots < full_tokens(r)) fail(id + "protected but not holding its whole length");
    if (r.protect && cfg_.policy != Policy::GUARDED) fail(id + "protected outside the GUARDED policy");
    if (cfg_.policy == Policy::GUARDED && r.num_preemptions > cfg_.max_preemptions)
      fail(id + "preempted more than max_preemptions times");
    if (holds && r.kv_slots < r.num_computed) fail(id + "fewer KV slots than computed tokens");
    if (r.num_computed > r.total()) fail(id + "computed beyond its tokens");
    if (r.known != static_cast<int64_t>(r.tokens.size()) + r.nstage || r.last_token != r.token_at(r.known - 1))
      fail(id + "token cache");
    if (r.nstage < 0 || r.nstage > kStage || (r.nstage > 0 && r.status != Status::DECODING))
      fail(id + "staged tokens outside DECODING");
    if (r.status == Status::DECODING && r.num_computed != r.total() - 1) fail(id + "decoding but not one token behind");
    if (r.pending < 0 || (r.pending > 0 && r.in_flight == 0)) fail(id + "pending tokens without an outstanding row");
    if (r.spec_in_flight < 0 || r.spec_in_flight > r.in_flight) fail(id + "verify rows in flight exceed rows in flight");
    if (r.in_flight > static_cast<int32_t>(plans_.size())) fail(id + "in flight in more plans than outstanding");
    if (r.schedule_cnt - r.process_cnt != r.in_flight) fail(id + "schedule_cnt - process_cnt != in_flight");
    if (r.status != Status::ENDED) ++live;
    if (r.status == Status::HANDOFF) ++handoff;
  }
  if (live != live_) fail("live count");
  if (handoff != num_handoff_) fail("hand-off count");
  if (num_running() > cfg_.max_num_seqs) fail("more running requests than max_num_seqs");
}

}  // namespace di::sched
