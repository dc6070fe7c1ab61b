// The per-step planner. One object per DP rank; driven from Python once per step:
//   wish()              -> what this rank would like to run (has prefill work, has decode work)
//   schedule(group)     -> the plan for the step type the DP group agreed on
//   update(step, toks)  -> apply the step's sampled tokens, stop checks, end requests
// Everything per request stays in C++ and talks to the KV pool directly (di::kv::BlockPool), so a step
// never calls back into Python per request.
//
// Token accounting of a request (the numbers every rule below refers to):
//   tokens         prompt + output tokens whose values are known
//   pending        tokens already scheduled to be sampled whose values are not known yet (async mode);
//                  a verify row of 1 + k tokens counts 1 + k (the most it can yield)
//   total          tokens.size() + pending
//   num_computed   tokens whose KV is computed or scheduled to be computed
//   output length  total - prompt_len: output tokens generated so far, counting kept output from
//                  before a preemption and tokens still in flight.
//
// Preemption policies (Config::policy):
//   DEEPINFER  the seed's: decode rows shortest-output-first, the victim is the longest-output request
//              (ties by arrival: earlier arrival = served first, preempted last); admission keeps only
//              watermark_blocks free.
//   GUARDED    (default) decode rows in admission order (oldest first), the victim is the most recently
//              admitted request (it has the least work to lose); admission also keeps free the blocks
//              the running requests grow into over headroom_steps decode steps, so a request evicted
//              for lack of blocks is not re-admitted into the same shortage; a request preempted
//              max_preemptions times is re-admitted with the KV of its whole possible length
//              reserved ("protected"): it never asks for a block again, so it is never a victim and no
//              request is preempted more than max_preemptions times.
//   Both: a preempted request keeps its output and re-enters the waiting queue in arrival order;
//   admission is first-come first-served (the first waiting request that does not fit stops it).
//
// Speculative decoding: set_drafts() before schedule() asks for k draft tokens to be verified per
// decode request. Its row is then 1 + k tokens [last token, k drafts] (drafts are -1 placeholders the
// caller fills), KV is reserved for 1 + k, and update() takes 1..1+k tokens for it (accepted drafts +
// the correction / bonus token), stop-checked one by one (tokens after a stop are dropped). The KV of
// rejected drafts is given back (num_computed steps back; whole trailing blocks return to the pool).
// While a verify row is outstanding (async mode) its request is not planned again: where its next
// token goes depends on how many drafts are accepted.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv/block_pool.h"
#include "scheduler/block_arena.h"
#include "scheduler/cost_model.h"
#include "scheduler/plan_buffer.h"

namespace di::sched {

inline constexpr int32_t kMaxDrafts = 64;  // drafts one verify row may carry

enum class EngineType : int32_t { NORMAL = 0, PROMPT = 1, COMPLETION = 2 };
enum class StepType : int32_t { IDLE = 0, PREFILL = 1, DECODE = 2 };
enum class Status : uint8_t { WAITING = 0, PREFILLING = 1, DECODING = 2, HANDOFF = 3, ENDED = 4 };
enum class FinishReason : uint8_t { NONE = 0, STOP = 1, LENGTH = 2, ABORT = 3, HANDOFF = 4, FAILED = 5 };
enum class Policy : int32_t { GUARDED = 0, DEEPINFER = 1 };

struct Config {
  EngineType engine_type = EngineType::NORMAL;
  int32_t max_num_seqs = 256;               // requests holding KV (prefilling + decoding) at once
  int64_t max_num_batched_tokens = kMaxStepTokens;  // token cap of one step, <= kMaxStepTokens
  int64_t max_model_len = 8192;             // prompt + output tokens of one request
  int32_t eos_token_id = -1;                // -1: no EOS
  double time_budget_ns = 0.0;              // prefill step budget; <= 0 or inf: no time budget
  int32_t prefill_attempt_interval = 2;     // decode steps before asking "do all ranks have prefill?"
  int32_t prefill_any_attempt_interval = 16;  // decode steps before asking "does any rank?"
  bool async_mode = false;                  // allow schedule(N+1) before update(N)
  int32_t watermark_blocks = 0;             // blocks kept free when admitting next to running work
  Policy policy = Policy::GUARDED;
  int32_t max_preemptions = 2;              // GUARDED: preemptions before a request is protected
  int32_t headroom_steps = 8;               // GUARDED: decode steps of growth kept free at admission
  // Prefix sharing (0: off). A NORMAL / PROMPT admission takes the pool's cached blocks of the longest
  // cached prefix of its first max(0, known - prefix_tail) tokens, rounded down to prefix_align
  // tokens, by refcount (no copy, no new memory), and starts num_computed there; the caller rebuilds
  // whatever else the hit needs (e.g. SWA state) from PlanOut::cached. The tail is left to compute, so
  // every write of the request goes to its own fresh blocks after the hit.
  int32_t prefix_align = 0;
  int32_t prefix_tail = 1;
  CostModel cost;
};

// Output tokens a decoding request keeps inline in its second cache line before they are appended to its
// token buffer (see Req::push).
inline constexpr int32_t kStage = 10;

// One request. Laid out so that a decode step and its update touch only the first two cache lines of the
// request (plus its block ids): every per-step counter is in the first line (32-bit counts: a request's
// token counts are bounded by max_model_len, and its step counters by its lifetime in steps), the
// block-table mirror's header and the staged output tokens in the second, everything a step does not
// read in the third. Slots live by value in one (huge-page) array, one indirection less per request
// per step; both hot lines are prefetched rows ahead.
// Why the staging: the token buffer is a separate heap allocation per request, so appending each step's
// token touched one more line on a different page per request; at 16k running requests those lines
// (and their TLB entries) are past the caches and the append was about half of update's growth
// (measured). Staged, the buffer is written once per kStage decode steps.
struct alignas(64) Req {
  // ---- first line: read or written by every decode row and its update ----
  int64_t seq_id = 0;
  int32_t known = 0;  // prompt + known output tokens = tokens.size() + nstage
  int32_t prompt_len = 0;
  int32_t pending = 0;
  int32_t num_computed = 0;
  int32_t max_tokens = 1;
  int32_t min_tokens = 0;
  // KV reserved in the pool, in whole blocks (a multiple of block_size). Reserving whole blocks means
  // the pool is called once per block_size decode tokens instead of every step.
  int32_t kv_slots = 0;
  int32_t last_token = -1;  // the newest known token
  int32_t in_flight = 0;    // outstanding plans holding a row of this request
  int32_t schedule_cnt = 0;  // rows scheduled (DeepInfer's schedule_cnt)
  int32_t process_cnt = 0;   // rows processed by update (DeepInfer's process_cnt)
  int32_t spec_in_flight = 0;  // outstanding verify rows (rows with drafts)
  int32_t want_k = 0;          // drafts asked for by set_drafts() for the next schedule()
  Status status = Status::WAITING;
  bool ignore_eos = false;
  bool has_stop = false;  // stop_ids non-empty (saves reading the third line per token)
  bool used = false;      // the slot holds a request
  // ---- second line ----
  // Mirror of the pool's block table (in the scheduler's BlockArena), refreshed whenever the
  // reservation changes, so a step copies block tables without a hash lookup per row.
  BlockArena::Ref blocks;
  // The newest nstage known tokens, not yet in `tokens`: only while DECODING (flushed when the
  // request is preempted or ends, and before anything reads the buffer as a whole).
  int32_t nstage = 0;
  // tokens.data() + tokens.size() as of the last change of `tokens`: where the next flush writes,
  // kept here so update can prefetch it rows ahead (a hint only: never dereferenced).
  const int32_t* tok_tail = nullptr;
  int32_t stage[kStage] = {};
  // ---- third line (rarely touched) ----
  int64_t arrival = 0;
  int64_t order_key = 0;       // GUARDED decode order: admission stamp, protected ones first
  int32_t prefill_target = 0;  // tokens to compute before the first sample of this admission
  int32_t num_preemptions = 0;
  uint32_t draft_stamp = 0;    // set_drafts() call that last named this request (duplicate check)
  FinishReason reason = FinishReason::NONE;
  bool protect = false;        // GUARDED: whole possible length reserved, never preempted
  bool reported = false;       // ENDED and returned by update() (the slot lives on while rows are in flight)
  std::vector<int32_t, SlabAllocator<int32_t>> tokens;  // prompt + known output, but for the staged tail
  std::unique_ptr<std::vector<int32_t>> stop_ids;  // only when has_stop (a pointer keeps this line whole)

  int64_t total() const { return static_cast<int64_t>(known) + pending; }
  int64_t output_len() const { return total() - prompt_len; }
  int32_t token_at(int64_t p) const {
    const int64_t base = static_cast<int64_t>(tokens.size());
    return p < base ? tokens[static_cast<size_t>(p)] : stage[p - base];
  }
  void flush() {
    if (nstage == 0) return;
    tokens.insert(tokens.end(), stage, stage + nstage);
    nstage = 0;
    tok_tail = tokens.data() + tokens.size();
  }
  void push(int32_t tok) {
    if (status == Status::DECODING) {
      if (nstage == kStage) flush();
      stage[nstage++] = tok;
    } else {
      flush();
      tokens.push_back(tok);
      tok_tail = tokens.data() + tokens.size();
    }
    ++known;
    last_token = tok;
  }
};
static_assert(sizeof(Req) == 192, "Req: two hot cache lines and one cold one");

// What schedule() hands back. The plan is written in place into two flat buffers (int32 and int64; see
// plan_buffer.h) that the binding hands to Python as they are. Regions, with capacities R (rows), T
// (tokens), P (preemptions), B (block ids; the last region, so it can grow):
//   int32: num_tokens R | start R | sample R | num_drafts R | cached R | kv_load_tokens R |
//          block_offsets R + 1 | token_ids T | block_ids B
//   int64: seq_ids R | kv_load_ids R | preempted P
struct PlanOut {
  int64_t step_id = 0;
  StepType type = StepType::IDLE;
  Col<int64_t> seq_ids;
  Col<int32_t> num_tokens;
  Col<int32_t> start;        // num_computed before the step = position of the first new token
  Col<int32_t> sample;       // 1: the row samples a token (decode rows, last prefill chunk)
  Col<int32_t> num_drafts;   // drafts the row verifies (its last num_drafts tokens)
  Col<int32_t> token_ids;    // flat, sum(num_tokens); -1 = placeholder (previous step's sample)
  // Compact (CSR) block tables: row i's blocks are block_ids[block_offsets[i]:block_offsets[i+1]]
  // (no padding).
  Col<int32_t> block_offsets;  // n + 1
  Col<int32_t> block_ids;
  int64_t width = 0;           // widest row (the dense view's width)
  Col<int64_t> preempted;
  Col<int64_t> kv_load_ids;  // COMPLETION: admitted requests whose KV the caller must load
  Col<int32_t> kv_load_tokens;
  // Per row: -1, or (the row is the first of a prefill admission this step: NORMAL / PROMPT) the
  // tokens its shared cached prefix covers (0: no hit); the row starts there.
  Col<int32_t> cached;
  double predicted_ns = 0.0;  // cost model's prediction (prefill steps)
  int64_t rows_cap = 0, tok_cap = 0, pre_cap = 0, blk_cap = 0;

  PlanOut() = default;
  PlanOut(const PlanOut&) = delete;
  PlanOut& operator=(const PlanOut&) = delete;
  ~PlanOut() { drop(); }
  // Fresh buffers with these capacities, every region empty (a buffer not handed off is given back).
  void open(int64_t rows, int64_t tokens, int64_t preemptions, int64_t blocks);
  // Room for `more` block ids: a larger buffer when the block region is full (written part copied).
  void reserve_blocks(size_t more) {
    if (block_ids.size() + more > static_cast<size_t>(blk_cap)) grow_blocks(block_ids.size() + more);
  }
  size_t len32() const { return static_cast<size_t>(7 * rows_cap + 1 + tok_cap) + block_ids.size(); }
  size_t len64() const { return static_cast<size_t>(2 * rows_cap) + preempted.size(); }
  // The buffers (int32, int64) pass to the caller, who gives them back with give_buffer().
  std::pair<void*, void*> hand_off();

 private:
  void bind32(int32_t* base);
  void grow_blocks(size_t need);
  void drop();
  void* buf32_ = nullptr;
  void* buf64_ = nullptr;
};

struct Ended {
  int64_t seq_id = 0;
  FinishReason reason = FinishReason::NONE;
  std::vector<int32_t> output;
  std::vector<int32_t> handoff_blocks;  // PROMPT engine: the block table at hand-off time
  int32_t num_preemptions = 0;
};

class StepScheduler {
 public:
  StepScheduler(kv::BlockPool& pool, const Config& cfg);
  StepScheduler(const StepScheduler&) = delete;
  StepScheduler& operator=(const StepScheduler&) = delete;

  void add_request(int64_t seq_id, const int32_t* prompt, int64_t n, int64_t max_tokens, int64_t min_tokens,
                   bool ignore_eos, const std::vector<int32_t>& stop_ids);
  bool abort(int64_t seq_id);

  // This rank's preference: (has prefill work it can start now, has decode work).
  std::pair<bool, bool> wish() const;
  // The step type every rank of the group derives from the same group facts and the same counter.
  StepType decide(bool all_prefill, bool any_prefill, bool any_decode) const;
  // The plan lives in the scheduler until the next schedule(); its buffers until hand_off() (the
  // caller owns them then) or the next schedule().
  PlanOut& schedule(bool all_prefill, bool any_prefill, bool any_decode);
  // (wish + local decide + schedule) in one call: the single-rank path (LocalVote).
  PlanOut& schedule_local();
  // Turn prefix sharing on (align > 0) or off (align == 0); see Config::prefix_align.
  void set_prefix_sharing(int32_t align, int32_t tail);
  int64_t total_preemptions() const { return total_preemptions_; }
  int64_t discarded_tokens() const { return discarded_tokens_; }  // computed KV tokens preemption threw away
  // Drafts to verify in the next schedule() (decode requests only; capped there by max_tokens, the
  // token cap and free KV). Cleared by schedule(). All-or-nothing: std::invalid_argument (naming
  // draft_counts[i] / draft_seq_ids[i]) and no change for k outside [0, kMaxDrafts], a seq id given
  // twice, or one that is not live: never added, or its end already reported by update() (Python's
  // notion of a live request id). A request that ended but is not reported yet (aborted, or ended
  // with a row in flight) is skipped: the caller cannot know yet.
  void set_drafts(const int64_t* seq_ids, const int32_t* ks, int64_t n);
  // Sampled tokens of the oldest outstanding plan. counts == nullptr: one per row (rows that do not
  // sample: ignored). Else counts[i] tokens for row i, flat in `sampled`: 1..1 + num_drafts[i] for a
  // sampling row, 0 or 1 (ignored) for a row that does not sample.
  std::vector<Ended> update(int64_t step_id, const int32_t* sampled, int64_t n, const int32_t* counts = nullptr,
                            int64_t ncounts = 0);

  bool has_unfinished() const { return live_ > 0 || !plans_.empty() || !ended_.empty(); }
  int64_t num_live() const { return live_; }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  // Requests holding KV: prefilling, decoding, and PROMPT requests awaiting their hand-off token.
  int64_t num_running() const { return static_cast<int64_t>(prefilling_.size() + decoding_.size()) + num_handoff_; }
  int64_t num_outstanding() const { return static_cast<int64_t>(plans_.size()); }
  int32_t decode_steps_since_prefill() const { return decode_since_prefill_; }
  const Config& config() const { return cfg_; }
  // Per-request facts for inspection and tests: (status, num_computed, pending, schedule_cnt,
  // process_cnt, num_preemptions, output_len). std::invalid_argument if unknown.
  std::vector<int64_t> request_info(int64_t seq_id) const;
  std::vector<int32_t> output_tokens(int64_t seq_id) const;
  bool contains(int64_t seq_id) const { return slot_of_.count(seq_id) != 0; }
  void check_invariants() const;  // throws std::logic_error

 private:
  struct PlanRec {
    int64_t step_id;
    std::vector<int32_t> slots;
    std::vector<int64_t> seq_ids;
    std::vector<uint8_t> sample;
    std::vector<int32_t> drafts;
  };

  Req& at(int32_t slot) { return slots_[slot]; }
  const Req& at(int32_t slot) const { return slots_[slot]; }
  bool admissible_prefill_head() const;
  bool fits_with_watermark(int64_t num_tokens) const;
  bool fits_blocks_with_watermark(int64_t blocks) const;
  // Prefix sharing: the cached blocks an admission of r would share (appended to `out`, whole
  // prefix_align groups); returns the tokens they hold (0: none, or sharing off / COMPLETION).
  int64_t prefix_hit(const Req& r, std::vector<int32_t>& out) const;
  // Blocks an admission reserving num_tokens takes from the free count when it shares `hit`.
  int64_t admit_blocks(int64_t num_tokens, const std::vector<int32_t>& hit) const;
  int64_t full_tokens(const Req& r) const;   // tokens a request can ever feed (its whole possible KV)
  int64_t admit_tokens(const Req& r) const;  // KV tokens admission reserves (protected: whole length)
  void admitted(Req& r);                      // admission bookkeeping (order key, protection)
  int64_t round_up(int64_t num_tokens) const;
  bool reserve(Req& r, int64_t num_tokens);  // grow the reservation to >= num_tokens; false if no blocks
  void allocate(Req& r, int64_t num_tokens, const std::vector<int32_t>* hit = nullptr);  // first reservation (after a fit check)
  void release(Req& r);                       // give every block back to the pool
  void refresh_blocks(Req& r);                // mirror := the pool's table of r
  void sort_decoding();
  void preempt(int32_t slot, PlanOut& out);
  void end(int32_t slot, FinishReason reason);
  void add_row(PlanOut& out, PlanRec& rec, int32_t slot, int64_t q, bool sample, int32_t drafts = 0,
               int32_t cached = -1);
  void schedule_prefill(PlanOut& out, PlanRec& rec);
  void schedule_decode(PlanOut& out, PlanRec& rec);
  void erase_if_done(int32_t slot);
  void compact_lists();
  FinishReason stop_reason(const Req& r, int32_t tok) const;

  kv::BlockPool& pool_;
  Config cfg_;
  // By value (one indirection less per request per step), on huge pages (plan_buffer.h).
  std::vector<Req, HugeAllocator<Req>> slots_;
  BlockArena arena_;  // every request's block-table mirror
  std::vector<int32_t> free_slots_;
  std::unordered_map<int64_t, int32_t> slot_of_;
  std::vector<int32_t> waiting_;     // by arrival
  std::vector<int32_t> prefilling_;  // by admission
  std::vector<int32_t> decoding_;    // by (output length, arrival), re-sorted each decode step
  std::deque<PlanRec> plans_;
  std::vector<PlanRec> spare_recs_;  // updated plans' records, their buffers reused by schedule()
  PlanOut out_;                      // the newest plan
  std::vector<Ended> ended_;         // ended since the last update() returned
  std::vector<int32_t> draft_slots_; // slots with want_k set by set_drafts(), cleared by schedule()
  int64_t blk_hint_[3] = {0, 0, 0};  // block ids of the previous plan of each step type (region sizing)
  mutable std::vector<int32_t> hit_tmp_;  // admission scratch: a prefix hit's block ids
  std::vector<int32_t> draft_tmp_;   // set_drafts() scratch: slot per entry, -1 = skip
  uint32_t draft_call_ = 0;          // set_drafts() calls so far (stamps for the duplicate check)
  int64_t next_arrival_ = 0;
  int64_t next_step_ = 0;
  int64_t live_ = 0;
  int64_t num_handoff_ = 0;
  int32_t decode_since_prefill_ = 0;
  int64_t next_admit_ = 0;
  int64_t total_preemptions_ = 0;
  int64_t discarded_tokens_ = 0;
  bool lists_dirty_ = false;
  bool decode_dirty_ = true;  // GUARDED: decoding_ may be out of order_key order
};

}  // namespace di::sched
