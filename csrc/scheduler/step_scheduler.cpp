// StepScheduler: see step_scheduler.h for the token accounting every rule here refers to.
#include "scheduler/step_scheduler.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "scheduler/errors.h"

namespace di::sched {

namespace {
// Up-front reservations (address space: pages are faulted in only where used), so that growing the
// block arena or the slot array, which copies them into fresh pages at once, is rare. The arena: every
// block of the pool in chunks of up to twice a table's size plus the smallest chunk per running
// request (more only with prefix sharing); the slots: max_num_seqs running and as many waiting. Capped
// (64 MiB / 32k slots of address space) so a huge pool or max_num_seqs is not refused up front.
size_t arena_reserve(const kv::BlockPool& pool, const Config& cfg) {
  const size_t est = 2 * static_cast<size_t>(std::max(pool.num_blocks(), 0)) +
                     4 * static_cast<size_t>(std::max(cfg.max_num_seqs, 0));
  return std::min<size_t>(est, size_t{1} << 24);
}
}  // namespace

StepScheduler::StepScheduler(kv::BlockPool& pool, const Config& cfg)
    : pool_(pool), cfg_(cfg), arena_(arena_reserve(pool, cfg)) {
  slots_.reserve(std::min<size_t>(2 * static_cast<size_t>(std::max(cfg.max_num_seqs, 1)), size_t{1} << 15));
  const std::string p = "SchedulerConfig.";
  if (cfg.max_num_seqs < 1) bad(p + "max_num_seqs=" + s(cfg.max_num_seqs) + ": must be >= 1");
  if (cfg.max_num_batched_tokens < 1 || cfg.max_num_batched_tokens > kMaxStepTokens)
    bad(p + "max_num_batched_tokens=" + s(cfg.max_num_batched_tokens) + ": must be in [1, " + s(kMaxStepTokens) + "]");
  if (cfg.max_model_len < 2 || cfg.max_model_len > (int64_t{1} << 30))
    bad(p + "max_model_len=" + s(cfg.max_model_len) + ": must be in [2, 2**30]");
  if (cfg.prefill_attempt_interval < 0)
    bad(p + "prefill_attempt_interval=" + s(cfg.prefill_attempt_interval) + ": must be >= 0");
  if (cfg.prefill_any_attempt_interval < cfg.prefill_attempt_interval)
    bad(p + "prefill_any_attempt_interval=" + s(cfg.prefill_any_attempt_interval) +
        ": must be >= prefill_attempt_interval=" + s(cfg.prefill_attempt_interval));
  if (cfg.watermark_blocks < 0) bad(p + "watermark_blocks=" + s(cfg.watermark_blocks) + ": must be >= 0");
  if (cfg.policy != Policy::GUARDED && cfg.policy != Policy::DEEPINFER)
    bad(p + "preemption_policy=" + s(static_cast<int32_t>(cfg.policy)) + ": must be 0 (GUARDED) or 1 (DEEPINFER)");
  if (cfg.max_preemptions < 0) bad(p + "max_preemptions=" + s(cfg.max_preemptions) + ": must be >= 0");
  if (cfg.headroom_steps < 0 || cfg.headroom_steps > (1 << 20))
    bad(p + "headroom_steps=" + s(cfg.headroom_steps) + ": must be in [0, 2**20]");
  if (cfg.eos_token_id < -1) bad(p + "eos_token_id=" + s(cfg.eos_token_id) + ": must be >= 0, or -1 for none");
  cfg_.cost.validate();
  if (!(cfg.time_budget_ns > 0.0)) cfg_.time_budget_ns = std::numeric_limits<double>::infinity();
  // Every prefill step must be able to compute at least one token of any admissible request, or a
  // long prompt could never be scheduled under the budget.
  const double worst = cfg_.cost.base_ns + cfg_.cost.chunk_ns(1, cfg.max_model_len - 1);
  if (!(worst <= cfg_.time_budget_ns))
    bad(p + "time_budget_ns=" + std::to_string(cfg.time_budget_ns) + ": must be >= cost(1, max_model_len - 1) = " +
        std::to_string(worst) + " ns so that one token of the longest request fits a step");
}

void StepScheduler::add_request(int64_t seq_id, const int32_t* prompt, int64_t n, int64_t max_tokens,
                                int64_t min_tokens, bool ignore_eos, const std::vector<int32_t>& stop_ids) {
  if (slot_of_.count(seq_id)) bad("seq_id=" + s(seq_id) + ": already exists");
  if (pool_.contains(seq_id)) bad("seq_id=" + s(seq_id) + ": already holds blocks in the KV pool (set first_seq_id past it)");
  if (n < 1) bad("prompt_token_ids: must not be empty");
  for (int64_t i = 0; i < n; ++i)
    if (prompt[i] < 0) bad("prompt_token_ids[" + s(i) + "]=" + s(prompt[i]) + ": token ids must be >= 0");
  if (max_tokens < 1) bad("max_tokens=" + s(max_tokens) + ": must be >= 1");
  if (min_tokens < 0 || min_tokens > max_tokens)
    bad("min_tokens=" + s(min_tokens) + ": must be in [0, max_tokens=" + s(max_tokens) + "]");
  for (int32_t t : stop_ids)
    if (t < 0) bad("stop_token_ids: " + s(t) + " must be >= 0");
  // A PROMPT engine samples exactly one token before handing the request off.
  const int64_t gen = cfg_.engine_type == EngineType::PROMPT ? 1 : max_tokens;
  if (n + gen > cfg_.max_model_len)
    bad("max_tokens=" + s(max_tokens) + ": prompt (" + s(n) + ") + max_tokens (" + s(gen) +
        ") must be <= max_model_len=" + s(cfg_.max_model_len));
  // KV slots the request can ever need: every token but the last sampled one is fed to the model.
  const int64_t need = pool_.blocks_for_tokens(n + gen - 1);
  if (need > pool_.num_blocks() - 1)
    bad("max_tokens=" + s(max_tokens) + ": prompt + output need " + s(need) + " KV blocks but the pool has only " +
        s(pool_.num_blocks() - 1));

  int32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<int32_t>(slots_.size());
    slots_.emplace_back();
  }
  Req& r = slots_[slot];
  r = Req{};
  r.used = true;
  r.seq_id = seq_id;
  r.arrival = next_arrival_++;
  r.tokens.reserve(static_cast<size_t>(n + std::min<int64_t>(max_tokens, 64)));
  r.tokens.assign(prompt, prompt + n);
  r.tok_tail = r.tokens.data() + n;
  r.known = n;
  r.last_token = prompt[n - 1];
  r.prompt_len = n;
  r.max_tokens = max_tokens;
  r.min_tokens = min_tokens;
  r.ignore_eos = ignore_eos;
  r.has_stop = !stop_ids.empty();
  if (r.has_stop) r.stop_ids = std::make_unique<std::vector<int32_t>>(stop_ids);
  slot_of_[seq_id] = slot;
  waiting_.push_back(slot);  // arrival is increasing, so waiting_ stays sorted by arrival
  ++live_;
}

bool StepScheduler::abort(int64_t seq_id) {
  auto it = slot_of_.find(seq_id);
  if (it == slot_of_.end()) return false;
  const int32_t slot = it->second;
  if (at(slot).status == Status::ENDED) return false;
  end(slot, FinishReason::ABORT);
  compact_lists();
  erase_if_done(slot);
  return true;
}

bool StepScheduler::admissible_prefill_head() const {
  if (num_running() >= cfg_.max_num_seqs) return false;
  for (int32_t slot : waiting_) {
    const Req& r = at(slot);
    if (r.pending > 0) continue;  // its last step's tokens are still in flight
    // COMPLETION admission reserves KV for every known token (the KV it loads plus the decode slot).
    prefix_hit(r, hit_tmp_);
    return fits_blocks_with_watermark(admit_blocks(admit_tokens(r), hit_tmp_));
  }
  return false;
}

std::pair<bool, bool> StepScheduler::wish() const {
  switch (cfg_.engine_type) {
    case EngineType::PROMPT:
      return {!prefilling_.empty() || admissible_prefill_head(), false};
    case EngineType::COMPLETION:
      return {false, !decoding_.empty() || admissible_prefill_head()};
    default:
      return {!prefilling_.empty() || admissible_prefill_head(), !decoding_.empty()};
  }
}

StepType StepScheduler::decide(bool all_prefill, bool any_prefill, bool any_decode) const {
  if (cfg_.engine_type == EngineType::PROMPT) return any_prefill ? StepType::PREFILL : StepType::IDLE;
  if (cfg_.engine_type == EngineType::COMPLETION) return any_decode ? StepType::DECODE : StepType::IDLE;
  if (!any_decode) return any_prefill ? StepType::PREFILL : StepType::IDLE;
  // Decode is running somewhere. Prefill interrupts it only after enough decode steps: sooner when
  // every rank has prompts (no rank idles), later when only some do (the bound a lone prompt waits).
  if (any_prefill && decode_since_prefill_ >= cfg_.prefill_any_attempt_interval) return StepType::PREFILL;
  if (all_prefill && decode_since_prefill_ >= cfg_.prefill_attempt_interval) return StepType::PREFILL;
  return StepType::DECODE;
}

// flatten: the -O2 build otherwise leaves vector::push_back as an out-of-line call per field per row,
// measured at ~20% of a decode step.
__attribute__((flatten)) void StepScheduler::add_row(PlanOut& out, PlanRec& rec, int32_t slot, int64_t q, bool sample,
                                                     int32_t drafts, int32_t cached) {
  Req& r = at(slot);
  if (static_cast<int64_t>(out.seq_ids.size()) >= out.rows_cap ||
      static_cast<int64_t>(out.token_ids.size()) + q > out.tok_cap)
    throw std::logic_error("scheduler: plan row beyond the step's bound");
  out.seq_ids.push_back(r.seq_id);
  out.num_tokens.push_back(static_cast<int32_t>(q));
  out.start.push_back(static_cast<int32_t>(r.num_computed));
  out.sample.push_back(sample ? 1 : 0);
  out.num_drafts.push_back(drafts);
  out.cached.push_back(cached);
  const int64_t known = r.known;
  if (q == 1) {  // decode: the last known token, or the placeholder of the one still in flight
    out.token_ids.push_back(r.num_computed == known - 1 ? r.last_token : r.num_computed < known ? r.token_at(r.num_computed) : -1);
  } else {
    for (int64_t p = r.num_computed; p < r.num_computed + q; ++p) out.token_ids.push_back(p < known ? r.token_at(p) : -1);
  }
  r.num_computed += q;
  if (sample) r.pending += 1 + drafts;  // a verify row yields up to 1 + drafts tokens
  if (drafts > 0) ++r.spec_in_flight;
  ++r.in_flight;
  ++r.schedule_cnt;
  // Compact block table row, copied while the request's lines are in cache (its blocks are final here:
  // later rows only preempt requests not yet planned), straight into the buffer Python will own.
  const auto nb = static_cast<size_t>(r.blocks.n);
  out.reserve_blocks(nb);
  out.block_ids.append(arena_.data(r.blocks), nb);
  out.block_offsets.push_back(static_cast<int32_t>(out.block_ids.size()));
  out.width = std::max<int64_t>(out.width, r.blocks.n);
  rec.slots.push_back(slot);
  rec.seq_ids.push_back(r.seq_id);
  rec.sample.push_back(sample ? 1 : 0);
  rec.drafts.push_back(drafts);
}

void StepScheduler::schedule_prefill(PlanOut& out, PlanRec& rec) {
  const double budget = cfg_.time_budget_ns;
  int64_t tokens_left = cfg_.max_num_batched_tokens;
  double spent = 0.0;
  bool started = false;
  // Largest chunk of request r that fits what is left of the step (token cap and time budget).
  auto chunk = [&](const Req& r, int64_t remaining) -> int64_t {
    const double base = started ? spent : cfg_.cost.base_ns;
    const int64_t q = cfg_.cost.max_chunk(r.num_computed, base, budget, std::min(remaining, tokens_left));
    if (q > 0) {
      spent = base + cfg_.cost.chunk_ns(q, r.num_computed);
      started = true;
      tokens_left -= q;
    }
    return q;
  };
  auto finish_prefill = [&](int32_t slot) {
    Req& r = at(slot);
    if (cfg_.engine_type == EngineType::PROMPT) {
      r.status = Status::HANDOFF;
      ++num_handoff_;
    } else {
      r.status = Status::DECODING;
      decoding_.push_back(slot);
      decode_dirty_ = true;
    }
  };

  // 1) Continue requests already being chunked (they hold their blocks), in admission order.
  std::vector<int32_t> still;
  bool stop = false;
  for (int32_t slot : prefilling_) {
    Req& r = at(slot);
    const int64_t q = stop ? 0 : chunk(r, r.prefill_target - r.num_computed);
    if (q == 0) {
      stop = true;
      still.push_back(slot);
      continue;
    }
    const bool last = r.num_computed + q == r.prefill_target;
    add_row(out, rec, slot, q, last);
    if (last) finish_prefill(slot); else still.push_back(slot);
  }
  prefilling_.swap(still);

  // 2) Admit waiting requests first-come first-served; the first that does not fit stops admission
  //    (no overtaking, so a long prompt is not starved by short ones behind it).
  if (stop || tokens_left == 0) {
    out.predicted_ns = spent;
    return;
  }
  std::vector<int32_t> keep;
  keep.reserve(waiting_.size());
  size_t k = 0;
  for (; k < waiting_.size(); ++k) {
    const int32_t slot = waiting_[k];
    Req& r = at(slot);
    if (r.pending > 0) {
      keep.push_back(slot);
      continue;
    }
    if (num_running() >= cfg_.max_num_seqs || tokens_left == 0) break;
    const int64_t target = r.total();
    const int64_t reserve_tokens = admit_tokens(r);
    // Prefix sharing: the hit's cached blocks join its table by refcount (the tail stays new, so the
    // request never writes a shared block) and its prefill starts after them.
    const int64_t hit = prefix_hit(r, hit_tmp_);
    if (!fits_blocks_with_watermark(admit_blocks(reserve_tokens, hit_tmp_))) break;
    r.num_computed = static_cast<int32_t>(hit);
    const int64_t q = chunk(r, target - hit);
    if (q == 0) {
      r.num_computed = 0;
      break;
    }
    allocate(r, reserve_tokens, &hit_tmp_);
    admitted(r);
    r.prefill_target = target;
    r.status = Status::PREFILLING;
    const bool last = hit + q == target;
    add_row(out, rec, slot, q, last, 0, static_cast<int32_t>(hit));
    if (last) finish_prefill(slot); else prefilling_.push_back(slot);
  }
  for (; k < waiting_.size(); ++k) keep.push_back(waiting_[k]);
  waiting_.swap(keep);
  out.predicted_ns = spent;
}

void StepScheduler::sort_decoding() {
  if (cfg_.policy == Policy::GUARDED) {
    // Keys change only at admission: sort only when a request joined (insertion sort, the newcomers
    // are near their place; a protected one moves to the front).
    if (!decode_dirty_) return;
    decode_dirty_ = false;
    for (size_t i = 1; i < decoding_.size(); ++i) {
      const int32_t v = decoding_[i];
      const int64_t key = at(v).order_key;
      size_t j = i;
      while (j > 0 && key < at(decoding_[j - 1]).order_key) {
        decoding_[j] = decoding_[j - 1];
        --j;
      }
      decoding_[j] = v;
    }
    return;
  }
  // Insertion sort: every scheduled request grows by one token per step, so the order is almost
  // always unchanged and this is one linear pass; newly decoding requests (short output) move up.
  auto less = [&](int32_t a, int32_t b) {
    const Req& x = at(a);
    const Req& y = at(b);
    const int64_t lx = x.output_len(), ly = y.output_len();
    return lx < ly || (lx == ly && x.arrival < y.arrival);
  };
  for (size_t i = 1; i < decoding_.size(); ++i) {
    const int32_t v = decoding_[i];
    size_t j = i;
    while (j > 0 && less(v, decoding_[j - 1])) {
      decoding_[j] = decoding_[j - 1];
      --j;
    }
    decoding_[j] = v;
  }
}

void StepScheduler::preempt(int32_t slot, PlanOut& out) {
  Req& r = at(slot);
  if (r.protect) throw std::logic_error("scheduler: a protected request was chosen for preemption");
  ++total_preemptions_;
  discarded_tokens_ += r.num_computed;
  release(r);
  r.flush();  // re-admission recomputes from the token buffer (and prefix matching reads it whole)
  // Output tokens (and any still in flight) are kept: the request is recomputed from prompt + output.
  r.num_computed = 0;
  r.prefill_target = 0;
  r.status = Status::WAITING;
  ++r.num_preemptions;
  auto pos = std::lower_bound(waiting_.begin(), waiting_.end(), r.arrival,
                              [&](int32_t w, int64_t arr) { return at(w).arrival < arr; });
  waiting_.insert(pos, slot);
  if (static_cast<int64_t>(out.preempted.size()) >= out.pre_cap)
    throw std::logic_error("scheduler: more preemptions than the step's bound");
  out.preempted.push_back(r.seq_id);
}

void StepScheduler::schedule_decode(PlanOut& out, PlanRec& rec) {
  sort_decoding();
  int64_t tokens_left = cfg_.max_num_batched_tokens;
  int64_t rows = 0;
  int64_t l = static_cast<int64_t>(decoding_.size()) - 1;  // decoding_[l + 1 ..] were preempted
  int64_t i = 0;
  // In the policy's order (DEEPINFER: shortest output first; GUARDED: protected, then oldest
  // admission); when blocks run out, preempt from the tail (DEEPINFER: longest output, as its
  // _schedule_decode; GUARDED: newest admission), and as a last resort the request itself.
  while (i <= l && rows < cfg_.max_num_seqs && tokens_left > 0) {
    // Two-stage prefetch: at 16k running requests their state is past L2, and the order is a
    // permutation of the slots, so the hardware cannot guess it. The request's two hot lines kPf rows
    // ahead; the block ids (arena) of the row kPf / 2 ahead, whose header (line 2) was fetched by now.
    // 16 rows (~0.5 us) cover the latency of a miss to the shared L3 here; 8 left the header loads
    // waiting (measured: 1.16-1.21x vs 1.21-1.25x at block size 256, 1,024 -> 16,384 requests).
    constexpr int64_t kPf = 16;
    if (i + kPf <= l) {
      const char* p = reinterpret_cast<const char*>(&at(decoding_[i + kPf]));
      __builtin_prefetch(p);
      __builtin_prefetch(p + 64);
    }
    if (i + kPf / 2 <= l) {
      const auto& b = at(decoding_[i + kPf / 2]).blocks;
      const auto d = reinterpret_cast<uintptr_t>(arena_.data(b));
      const uintptr_t end = d + static_cast<uintptr_t>(b.n) * sizeof(int32_t);
      for (uintptr_t q = d & ~uintptr_t{63}; q < end; q += 64) __builtin_prefetch(reinterpret_cast<const void*>(q));
    }
    const int32_t slot = decoding_[i];
    Req& r = at(slot);
    if (r.output_len() >= r.max_tokens || r.spec_in_flight > 0) {
      // its last token is in flight (it ends at update), or a verify row is: where its next token
      // goes depends on how many of those drafts are accepted
      ++i;
      continue;
    }
    int64_t k = r.want_k;
    if (k > 0) {
      // never verify more than can be kept (max_tokens, max_model_len) or than the step has room for;
      // drafts are optional, so no draft ever preempts anything
      k = std::min<int64_t>({k, r.max_tokens - r.output_len() - 1, cfg_.max_model_len - r.total() - 1, tokens_left - 1});
      if (k > 0 && !reserve(r, r.num_computed + 1 + k)) k = 0;
      if (k > 0) {
        add_row(out, rec, slot, 1 + k, true, static_cast<int32_t>(k));
        ++rows;
        tokens_left -= 1 + k;
        ++i;
        continue;
      }
    }
    const int64_t need = r.num_computed + 1;
    bool ok = reserve(r, need);
    while (!ok && l > i) {
      preempt(decoding_[l], out);
      --l;
      ok = reserve(r, need);
    }
    if (!ok) {
      preempt(slot, out);
      --l;
      break;
    }
    add_row(out, rec, slot, 1, true);
    ++rows;
    --tokens_left;
    ++i;
  }
  decoding_.resize(static_cast<size_t>(l + 1));

  if (cfg_.engine_type != EngineType::COMPLETION) return;
  // COMPLETION: admit waiting requests (their prompt KV is loaded by the caller into the blocks
  // reserved here), shortest output first. Requests with tokens in flight wait one more step.
  std::vector<int32_t> cand;
  for (int32_t slot : waiting_)
    if (at(slot).pending == 0) cand.push_back(slot);
  std::stable_sort(cand.begin(), cand.end(),
                   [&](int32_t a, int32_t b) { return at(a).output_len() < at(b).output_len(); });
  bool any_admitted = false;
  for (int32_t slot : cand) {
    Req& r = at(slot);
    if (num_running() >= cfg_.max_num_seqs || rows >= cfg_.max_num_seqs || tokens_left == 0) break;
    const int64_t total = r.total();
    const int64_t reserve_tokens = admit_tokens(r);
    if (!fits_with_watermark(reserve_tokens)) break;
    allocate(r, reserve_tokens);
    admitted(r);
    r.num_computed = total - 1;
    r.status = Status::DECODING;
    out.kv_load_ids.push_back(r.seq_id);
    out.kv_load_tokens.push_back(static_cast<int32_t>(total - 1));
    decoding_.push_back(slot);
    decode_dirty_ = true;
    add_row(out, rec, slot, 1, true);  // (cached -1: a KV load, not a prefill admission)
    ++rows;
    --tokens_left;
    any_admitted = true;
  }
  if (any_admitted) {
    waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(),
                                  [&](int32_t w) { return at(w).status != Status::WAITING; }),
                   waiting_.end());
  }
}

PlanOut& StepScheduler::schedule(bool all_prefill, bool any_prefill, bool any_decode) {
  const size_t max_out = cfg_.async_mode ? 2 : 1;
  if (plans_.size() >= max_out)
    throw std::runtime_error(std::string("schedule: ") + s(static_cast<int64_t>(plans_.size())) +
                             " plan(s) not yet updated; " + (cfg_.async_mode ? "async" : "sync") +
                             " mode allows " + s(static_cast<int64_t>(max_out - 1)) + " before scheduling again");
  PlanOut& out = out_;
  out.step_id = next_step_++;
  out.type = decide(all_prefill, any_prefill, any_decode);
  // Region capacities from bounds on this step (add_row checks them per row): rows come from the
  // prefilling or decoding requests plus admissions from the waiting queue, at most max_num_seqs;
  // tokens are capped by the step's token cap (a decode row is 1 token, a verify row up to
  // 1 + kMaxDrafts, and only requests named by set_drafts verify); only decode steps preempt, each
  // victim a distinct decoding request. Block ids are sized from the previous plan of the same type
  // and grow if a row does not fit.
  const int64_t cap = static_cast<int64_t>(cfg_.max_num_seqs);
  const int64_t waiting = static_cast<int64_t>(waiting_.size());
  int64_t rows = 0, tokens = 0, pre = 0;
  if (out.type == StepType::PREFILL) {
    rows = std::min(cap, static_cast<int64_t>(prefilling_.size()) + waiting);
    tokens = rows > 0 ? cfg_.max_num_batched_tokens : 0;
  } else if (out.type == StepType::DECODE) {
    const int64_t dec = static_cast<int64_t>(decoding_.size());
    rows = std::min(cap, dec + (cfg_.engine_type == EngineType::COMPLETION ? waiting : 0));
    tokens = std::min(cfg_.max_num_batched_tokens, rows + kMaxDrafts * static_cast<int64_t>(draft_slots_.size()));
    pre = dec;
  }
  const int64_t hint = blk_hint_[static_cast<int32_t>(out.type)];
  out.open(rows, tokens, pre, rows == 0 ? 0 : hint + hint / 8 + 2 * rows + 16);
  out.block_offsets.push_back(0);
  // The record reuses buffers of an updated plan: at 16k rows fresh per-step vectors were page-faulted
  // in every step (perf: ~15% of the step in the kernel's fault path).
  PlanRec rec;
  if (!spare_recs_.empty()) {
    rec = std::move(spare_recs_.back());
    spare_recs_.pop_back();
    rec.slots.clear();
    rec.seq_ids.clear();
    rec.sample.clear();
    rec.drafts.clear();
  }
  rec.step_id = out.step_id;
  const size_t est = static_cast<size_t>(rows);
  rec.slots.reserve(est);
  rec.seq_ids.reserve(est);
  rec.sample.reserve(est);
  rec.drafts.reserve(est);
  if (out.type == StepType::PREFILL) {
    decode_since_prefill_ = 0;
    schedule_prefill(out, rec);
  } else if (out.type == StepType::DECODE) {
    if (decode_since_prefill_ < std::numeric_limits<int32_t>::max()) ++decode_since_prefill_;
    schedule_decode(out, rec);
  }
  for (int32_t slot : draft_slots_) at(slot).want_k = 0;  // draft requests hold for one schedule() only
  draft_slots_.clear();
  // The compact block tables (block_offsets, block_ids) were filled row by row by add_row from the
  // mirrors (identical to pool_.fill_block_tables on these ids, which the invariant check and the
  // tests verify, without a hash lookup per row).
  blk_hint_[static_cast<int32_t>(out.type)] = static_cast<int64_t>(out.block_ids.size());
  plans_.push_back(std::move(rec));
  return out;
}

PlanOut& StepScheduler::schedule_local() {
  const auto [p, d] = wish();
  return schedule(p, p, d);  // one rank: all_prefill = any_prefill = its own wish
}

}  // namespace di::sched
