// _C.scheduler: the step planner (StepScheduler over a _C.kv.BlockPool) and the cost-model solver.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>

#include "core/buffers.h"
#include "core/registry.h"
#include "scheduler/plan_buffer.h"
#include "scheduler/step_scheduler.h"

namespace nb = nanobind;
using di::sched::CostModel;
using di::sched::StepScheduler;

namespace {

template <typename T>
nb::ndarray<nb::numpy, T> to_np(const std::vector<T>& v) {
  auto a = di::new_array<T>({v.size()});
  if (!v.empty()) std::memcpy(a.data(), v.data(), v.size() * sizeof(T));
  return a;
}

// A numpy array that owns a buffer from take_buffer (given back when Python drops it).
template <typename T>
nb::ndarray<nb::numpy, T> owned_array(void* data, size_t n) {
  size_t shape[1] = {n};
  nb::capsule owner(data, [](void* p) noexcept { di::sched::give_buffer(p); });
  return nb::ndarray<nb::numpy, T>(static_cast<T*>(data), 1, shape, owner);
}

// A numpy array over a recycled buffer (plan_buffer.h), uninitialised: the caller writes every element
// (zero-filling first was a second pass over most of the bytes of a dense table).
template <typename T>
nb::ndarray<nb::numpy, T> raw_array(size_t n) {
  void* data = di::sched::take_buffer((n > 0 ? n : 1) * sizeof(T));
  return owned_array<T>(data, n);
}

// The plan's two flat buffers, which the core wrote it into, become numpy arrays as they are (no copy);
// Python slices them into the plan's arrays (creating an array through the binding costs about a
// microsecond each, and a plan has eleven). Region layout: see PlanOut.
nb::tuple plan_tuple(di::sched::PlanOut& p) {
  const size_t n = p.seq_ids.size(), ntok = p.token_ids.size(), nblk = p.block_ids.size();
  const size_t np_ = p.preempted.size(), nk = p.kv_load_ids.size();
  const size_t len32 = p.len32(), len64 = p.len64();
  const auto [b32, b64] = p.hand_off();
  auto i32 = owned_array<int32_t>(b32, len32);
  auto i64 = owned_array<int64_t>(b64, len64);
  return nb::make_tuple(p.step_id, static_cast<int32_t>(p.type), i32, i64, n, ntok, nblk, np_, nk, p.predicted_ns,
                        p.width, p.rows_cap, p.tok_cap);
}

CostModel make_cost(double base, double token, double quad, double ctx) {
  CostModel c{base, token, quad, ctx};
  c.validate();
  return c;
}

}  // namespace

DI_SUBMODULE(scheduler, "step planner: prefill/decode plans over the KV block pool, cost-model chunking") {
  m.attr("MAX_STEP_TOKENS") = di::sched::kMaxStepTokens;
  m.attr("MAX_DRAFTS") = di::sched::kMaxDrafts;

  m.def(
      "max_chunk",
      [](double base, double token, double quad, double ctx, int64_t c, double spent, double budget, int64_t cap) {
        return make_cost(base, token, quad, ctx).max_chunk(c, spent, budget, cap);
      },
      nb::arg("base_ns"), nb::arg("token_ns"), nb::arg("quad_ns"), nb::arg("ctx_ns"), nb::arg("c"),
      nb::arg("spent_ns"), nb::arg("budget_ns"), nb::arg("cap"),
      "Largest q in [0, cap] with spent_ns + chunk_ns(q, c) <= budget_ns.");
  m.def(
      "chunk_ns",
      [](double base, double token, double quad, double ctx, int64_t q, int64_t c) {
        return make_cost(base, token, quad, ctx).chunk_ns(q, c);
      },
      nb::arg("base_ns"), nb::arg("token_ns"), nb::arg("quad_ns"), nb::arg("ctx_ns"), nb::arg("q"), nb::arg("c"));

  m.def(
      "dense_block_tables",
      [](di::CArray1<int32_t> offsets, di::CArray1<int32_t> ids, di::CArray1<int64_t> rows, bool all_rows,
         int64_t width) {
        const int64_t n = static_cast<int64_t>(offsets.shape(0)) - 1;
        di::require(n >= 0, "block_offsets: must hold rows + 1 entries");
        const int64_t m = all_rows ? n : static_cast<int64_t>(rows.shape(0));
        const int32_t* off = offsets.data();
        const int64_t* rw = rows.data();
        for (int64_t k = 0; k < m && !all_rows; ++k)
          if (rw[k] < 0 || rw[k] >= n)
            throw std::out_of_range("rows[" + std::to_string(k) + "]=" + std::to_string(rw[k]) +
                                    ": must be in [0, " + std::to_string(n) + ")");
        auto out = raw_array<int32_t>(static_cast<size_t>(m * width));
        {
          nb::gil_scoped_release release;
          int32_t* o = out.data();
          for (int64_t k = 0; k < m; ++k, o += width) {
            const int64_t r = all_rows ? k : rw[k];
            const int64_t len = std::min<int64_t>(off[r + 1] - off[r], width);
            if (len > 0) std::memcpy(o, ids.data() + off[r], static_cast<size_t>(len) * sizeof(int32_t));
            std::fill(o + len, o + width, 0);
          }
        }
        return out;
      },
      nb::arg("offsets"), nb::arg("ids"), nb::arg("rows"), nb::arg("all_rows"), nb::arg("width"),
      "Dense [rows, width] block tables (padded with 0) from the compact CSR form, flat.");

  m.def(
      "gather_names",
      [](uintptr_t table, int64_t len, di::CArray1<int64_t> seq_ids, int64_t n, int64_t base) {
        // The request-id list of a plan's rows in one pass (plan.request_ids): `table` is the data of the
        // Python side's numpy object array of request ids by seq id - base, which the plan holds alive.
        // Through numpy (take + tolist) this was two passes of reference counting and an intermediate
        // array, ~8 ns a row: as much as a third of a whole decode step's per-row cost.
        di::require(n >= 0 && n <= static_cast<int64_t>(seq_ids.shape(0)), "n: more rows than seq_ids holds");
        PyObject* const* names = reinterpret_cast<PyObject* const*>(table);
        const int64_t* seq = seq_ids.data();
        PyObject* out = PyList_New(n);
        if (out == nullptr) throw nb::python_error();
        for (int64_t k = 0; k < n; ++k) {
          const int64_t i = seq[k] - base;
          if (i < 0 || i >= len) {
            Py_DECREF(out);  // (its unset items are NULL, which list dealloc skips)
            throw std::out_of_range("seq_ids[" + std::to_string(k) + "]=" + std::to_string(seq[k]) +
                                    ": outside the request-id table");
          }
          PyObject* o = names[i];
          if (o == nullptr) o = Py_None;  // (numpy fills object arrays with None; never seen empty)
          Py_INCREF(o);
          PyList_SET_ITEM(out, k, o);
        }
        return nb::steal<nb::list>(out);
      },
      nb::arg("table"), nb::arg("len"), nb::arg("seq_ids"), nb::arg("n"), nb::arg("base"),
      "list of table[seq_ids[:n] - base] (table: address of a numpy object array's data, len entries)");

  nb::class_<StepScheduler>(m, "StepScheduler", "Per-step planner over a di::kv::BlockPool (see step_scheduler.h).")
      .def(
          "__init__",
          [](StepScheduler* self, di::kv::BlockPool& pool, int32_t engine_type, int32_t max_num_seqs,
             int64_t max_num_batched_tokens, int64_t max_model_len, int32_t eos_token_id, double time_budget_ns,
             int32_t prefill_attempt_interval, int32_t prefill_any_attempt_interval, bool async_mode,
             int32_t watermark_blocks, std::vector<double> cost, int32_t policy, int32_t max_preemptions,
             int32_t headroom_steps) {
            di::require(engine_type >= 0 && engine_type <= 2, "SchedulerConfig.engine_type: must be 0, 1 or 2");
            di::require(cost.size() == 4, "cost: expected (base_ns, token_ns, quad_ns, ctx_ns)");
            di::sched::Config cfg;
            cfg.engine_type = static_cast<di::sched::EngineType>(engine_type);
            cfg.max_num_seqs = max_num_seqs;
            cfg.max_num_batched_tokens = max_num_batched_tokens;
            cfg.max_model_len = max_model_len;
            cfg.eos_token_id = eos_token_id;
            cfg.time_budget_ns = time_budget_ns;
            cfg.prefill_attempt_interval = prefill_attempt_interval;
            cfg.prefill_any_attempt_interval = prefill_any_attempt_interval;
            cfg.async_mode = async_mode;
            cfg.watermark_blocks = watermark_blocks;
            cfg.policy = static_cast<di::sched::Policy>(policy);
            cfg.max_preemptions = max_preemptions;
            cfg.headroom_steps = headroom_steps;
            cfg.cost = CostModel{cost[0], cost[1], cost[2], cost[3]};
            new (self) StepScheduler(pool, cfg);
          },
          nb::arg("pool"), nb::arg("engine_type"), nb::arg("max_num_seqs"), nb::arg("max_num_batched_tokens"),
          nb::arg("max_model_len"), nb::arg("eos_token_id"), nb::arg("time_budget_ns"),
          nb::arg("prefill_attempt_interval"), nb::arg("prefill_any_attempt_interval"), nb::arg("async_mode"),
          nb::arg("watermark_blocks"), nb::arg("cost"), nb::arg("policy") = 0, nb::arg("max_preemptions") = 2,
          nb::arg("headroom_steps") = 8,
          nb::keep_alive<1, 2>())  // the pool outlives the scheduler that holds a reference to it
      .def(
          "add_request",
          [](StepScheduler& s, int64_t seq_id, di::CArray1<int32_t> prompt, int64_t max_tokens, int64_t min_tokens,
             bool ignore_eos, std::vector<int32_t> stop_ids) {
            s.add_request(seq_id, prompt.data(), static_cast<int64_t>(prompt.shape(0)), max_tokens, min_tokens,
                          ignore_eos, stop_ids);
          },
          nb::arg("seq_id"), nb::arg("prompt"), nb::arg("max_tokens"), nb::arg("min_tokens"), nb::arg("ignore_eos"),
          nb::arg("stop_ids"))
      .def("abort", &StepScheduler::abort, nb::arg("seq_id"))
      .def("set_prefix_sharing", &StepScheduler::set_prefix_sharing, nb::arg("align"), nb::arg("tail"),
           "Admissions share the pool's cached prefix blocks (align > 0: hit granularity in tokens, a multiple "
           "of block_size; tail: tokens always computed), reported per row in the plan's cached array.")
      .def("wish", &StepScheduler::wish, "(has prefill work startable now, has decode work)")
      .def(
          "decide",
          [](const StepScheduler& s, bool all, bool any, bool dec) { return static_cast<int32_t>(s.decide(all, any, dec)); },
          nb::arg("all_prefill"), nb::arg("any_prefill"), nb::arg("any_decode"))
      .def(
          "schedule",
          [](StepScheduler& s, bool all, bool any, bool dec) {
            nb::gil_scoped_release release;
            di::sched::PlanOut& p = s.schedule(all, any, dec);
            nb::gil_scoped_acquire acquire;
            return plan_tuple(p);
          },
          nb::arg("all_prefill"), nb::arg("any_prefill"), nb::arg("any_decode"),
          "(step_id, step_type, i32, i64, rows, tokens, block_ids, preempted, kv_loads, predicted_ns, width, R, T); "
          "regions of capacity R rows / T tokens: i32 = [num_tokens | start | sample | num_drafts | cached | "
          "kv_load_tokens (R each) | block_offsets (R + 1) | token_ids (T) | block_ids], "
          "i64 = [seq_ids | kv_load_ids (R each) | preempted]")
      .def(
          "schedule_local",
          [](StepScheduler& s) {
            nb::gil_scoped_release release;
            di::sched::PlanOut& p = s.schedule_local();
            nb::gil_scoped_acquire acquire;
            return plan_tuple(p);
          },
          "schedule() with this rank's own wish as the group's answer (one rank, LocalVote)")
      .def(
          "set_drafts",
          [](StepScheduler& s, di::CArray1<int64_t> seq_ids, di::CArray1<int32_t> ks) {
            di::require(seq_ids.shape(0) == ks.shape(0), "draft_seq_ids and draft_counts: lengths differ");
            nb::gil_scoped_release release;
            s.set_drafts(seq_ids.data(), ks.data(), static_cast<int64_t>(seq_ids.shape(0)));
          },
          nb::arg("seq_ids"), nb::arg("num_drafts"),
          "Drafts to verify per decode request in the next schedule(); all-or-nothing validation (see "
          "step_scheduler.h).")
      .def(
          "update",
          [](StepScheduler& s, int64_t step_id, di::CArray1<int32_t> sampled, di::CArray1<int32_t> counts) {
            std::vector<di::sched::Ended> ended;
            {
              nb::gil_scoped_release release;
              // empty counts: one token per row (rows that verify drafts need counts)
              const bool per_row = counts.shape(0) == 0;
              ended = s.update(step_id, sampled.data(), static_cast<int64_t>(sampled.shape(0)),
                               per_row ? nullptr : counts.data(), static_cast<int64_t>(counts.shape(0)));
            }
            nb::list out;
            for (auto& e : ended) {
              nb::object blocks = e.reason == di::sched::FinishReason::HANDOFF ? nb::cast(to_np(e.handoff_blocks))
                                                                               : nb::none();
              out.append(nb::make_tuple(e.seq_id, static_cast<int32_t>(e.reason), to_np(e.output), blocks,
                                        e.num_preemptions));
            }
            return out;
          },
          nb::arg("step_id"), nb::arg("sampled"), nb::arg("counts"),
          "Apply the oldest outstanding plan's samples; [(seq_id, reason, output, handoff_blocks, preemptions)].")
      .def("has_unfinished", &StepScheduler::has_unfinished)
      .def_prop_ro("num_live", &StepScheduler::num_live)
      .def_prop_ro("num_waiting", &StepScheduler::num_waiting)
      .def_prop_ro("num_running", &StepScheduler::num_running)
      .def_prop_ro("num_outstanding", &StepScheduler::num_outstanding)
      .def_prop_ro("total_preemptions", &StepScheduler::total_preemptions)
      .def_prop_ro("discarded_tokens", &StepScheduler::discarded_tokens)
      .def_prop_ro("decode_steps_since_prefill", &StepScheduler::decode_steps_since_prefill)
      .def("contains", &StepScheduler::contains, nb::arg("seq_id"))
      .def("request_info", &StepScheduler::request_info, nb::arg("seq_id"),
           "[status, num_computed, pending, schedule_cnt, process_cnt, num_preemptions, output_len]")
      .def("output_tokens", &StepScheduler::output_tokens, nb::arg("seq_id"))
      .def("check_invariants", &StepScheduler::check_invariants);
}
