// di::kv::StatePool and its _C.kv binding.
#include "kv/state_pool.h"

#include <stdexcept>
#include <string>

#include "core/buffers.h"
#include "kv/kv_module.h"

namespace nb = nanobind;

namespace di::kv {

StatePool::StatePool(int32_t num_slots) : num_slots_(num_slots) {
  if (num_slots < 0) throw std::invalid_argument("num_slots must be >= 0, got " + std::to_string(num_slots));
  free_.reserve(num_slots);
  for (int32_t s = num_slots - 1; s >= 0; --s) free_.push_back(s);  // slot 0 handed out first
  owner_.assign(num_slots, -1);
  held_.assign(num_slots, 0);
}

int32_t StatePool::acquire(int64_t seq_id) {
  if (slot_of_.count(seq_id)) throw std::invalid_argument("acquire: seq_id " + std::to_string(seq_id) + " already holds a slot");
  if (free_.empty()) return -1;
  int32_t s = free_.back();
  free_.pop_back();
  owner_[s] = seq_id;
  held_[s] = 1;
  slot_of_.emplace(seq_id, s);
  return s;
}

void StatePool::release(int64_t seq_id) {
  auto it = slot_of_.find(seq_id);
  if (it == slot_of_.end()) throw std::invalid_argument("release: unknown seq_id " + std::to_string(seq_id));
  int32_t s = it->second;
  owner_[s] = -1;
  held_[s] = 0;
  free_.push_back(s);
  slot_of_.erase(it);
}

int32_t StatePool::slot(int64_t seq_id) const {
  auto it = slot_of_.find(seq_id);
  if (it == slot_of_.end()) throw std::invalid_argument("slot: unknown seq_id " + std::to_string(seq_id));
  return it->second;
}

void StatePool::fill_slots(const int64_t* seq_ids, int64_t n, int32_t* out) const {
  for (int64_t i = 0; i < n; ++i) slot(seq_ids[i]);  // validate first: a bad id leaves `out` untouched
  for (int64_t i = 0; i < n; ++i) out[i] = slot_of_.find(seq_ids[i])->second;
}

void StatePool::check_invariants() const {
  auto fail = [](const std::string& m) { throw std::logic_error("StatePool invariant: " + m); };
  std::vector<uint8_t> seen(num_slots_, 0);
  for (int32_t s : free_) {
    if (s < 0 || s >= num_slots_) fail("free slot out of range");
    if (seen[s]++) fail("slot " + std::to_string(s) + " twice on the free list");
    if (held_[s]) fail("slot " + std::to_string(s) + " both free and held");
  }
  for (const auto& [seq, s] : slot_of_) {
    if (s < 0 || s >= num_slots_ || !held_[s] || owner_[s] != seq) fail("slot map broken for seq " + std::to_string(seq));
    if (seen[s]++) fail("slot " + std::to_string(s) + " held twice");
  }
  for (int32_t s = 0; s < num_slots_; ++s)
    if (!seen[s]) fail("slot " + std::to_string(s) + " leaked");
}

void register_state_pool(nb::module_& m) {
  nb::class_<StatePool>(m, "StatePool", "Per-sequence state slot bookkeeping (free list + owner map).")
      .def(nb::init<int32_t>(), nb::arg("num_slots"))
      .def_prop_ro("num_slots", &StatePool::num_slots)
      .def_prop_ro("num_free_slots", &StatePool::num_free_slots)
      .def_prop_ro("num_seqs", &StatePool::num_seqs)
      .def("acquire", &StatePool::acquire, nb::arg("seq_id"))
      .def("release", &StatePool::release, nb::arg("seq_id"))
      .def("contains", &StatePool::contains, nb::arg("seq_id"))
      .def("slot", &StatePool::slot, nb::arg("seq_id"))
      .def("slots",
           [](const StatePool& p, di::CArray1<int64_t> ids) {
             auto out = di::new_array<int32_t>({ids.shape(0)});
             p.fill_slots(ids.data(), static_cast<int64_t>(ids.shape(0)), out.data());
             return out;
           },
           nb::arg("seq_ids"), "int32 slot per sequence, in one call.")
      .def("check_invariants", &StatePool::check_invariants);
}

}  // namespace di::kv
