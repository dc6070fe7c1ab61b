// StepScheduler, speculative decoding: the per-step draft request (set_drafts), validated all-or-nothing.
// Planning the verify rows is in schedule_decode (step_scheduler.cpp), applying their results in update
// (step_update.cpp); step_scheduler.h has the accounting.
#include <algorithm>
#include <string>
#include <vector>

#include "scheduler/errors.h"
#include "scheduler/step_scheduler.h"

namespace di::sched {

void StepScheduler::set_drafts(const int64_t* seq_ids, const int32_t* ks, int64_t n) {
  // Validate everything first (one hash lookup per entry, slots kept for the second pass): a bad entry
  // changes nothing. The stamps written here only mean something for this call's number.
  const uint32_t call = ++draft_call_;
  draft_tmp_.resize(static_cast<size_t>(n));
  std::vector<int64_t> ended_ids;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t seq = seq_ids[i];
    if (ks[i] < 0 || ks[i] > kMaxDrafts)
      bad("draft_counts[" + s(i) + "]=" + s(ks[i]) + " (draft_seq_ids[" + s(i) + "]=" + s(seq) +
          "): must be in [0, " + s(kMaxDrafts) + "]");
    int32_t slot = -1;
    auto it = slot_of_.find(seq);
    if (it != slot_of_.end()) {
      Req& r = at(it->second);
      if (r.reported) it = slot_of_.end();  // ended and reported: no longer live for the caller
      else if (r.status != Status::ENDED) slot = it->second;
      if (slot >= 0) {
        if (r.draft_stamp == call) bad("draft_seq_ids[" + s(i) + "]=" + s(seq) + ": given more than once");
        r.draft_stamp = call;
      }
    }
    if (it == slot_of_.end()) {
      // erased slots of requests that ended but are not reported yet are still live for the caller
      // (rare: sorted once per call, on the first miss)
      if (ended_ids.empty() && !ended_.empty()) {
        for (const Ended& e : ended_) ended_ids.push_back(e.seq_id);
        std::sort(ended_ids.begin(), ended_ids.end());
      }
      if (!std::binary_search(ended_ids.begin(), ended_ids.end(), seq))
        bad("draft_seq_ids[" + s(i) + "]=" + s(seq) +
            ": not a live request of this scheduler (never added, or its end was already reported by update)");
    }
    draft_tmp_[static_cast<size_t>(i)] = slot;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t slot = draft_tmp_[static_cast<size_t>(i)];
    if (slot < 0) continue;  // ended since the caller looked: simply not planned
    Req& r = at(slot);
    if (r.want_k == 0 && ks[i] > 0) draft_slots_.push_back(slot);
    r.want_k = ks[i];
  }
}

}  // namespace di::sched
