// Per-sequence state slots: one fixed StateBlock (SWA rings + compressor accumulators) per running
// sequence. Pure bookkeeping: which slot a sequence holds; the bytes live in a device tensor indexed by
// slot, laid out by deepinfer_core.kv.planner.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace di::kv {

class StatePool {
 public:
  explicit StatePool(int32_t num_slots);
  int32_t num_slots() const { return num_slots_; }
  int32_t num_free_slots() const { return static_cast<int32_t>(free_.size()); }
  int64_t num_seqs() const { return static_cast<int64_t>(slot_of_.size()); }
  // Slot index, or -1 when none is free. std::invalid_argument if the sequence already holds one.
  int32_t acquire(int64_t seq_id);
  void release(int64_t seq_id);  // std::invalid_argument if unknown
  bool contains(int64_t seq_id) const { return slot_of_.count(seq_id) != 0; }
  int32_t slot(int64_t seq_id) const;  // std::invalid_argument if unknown
  // Slot per sequence for a batch (one call per step); std::invalid_argument on an unknown id.
  void fill_slots(const int64_t* seq_ids, int64_t n, int32_t* out) const;
  void check_invariants() const;  // throws std::logic_error

 private:
  int32_t num_slots_;
  std::vector<int32_t> free_;
  std::vector<int64_t> owner_;  // seq id holding each slot, or -1
  std::vector<uint8_t> held_;
  std::unordered_map<int64_t, int32_t> slot_of_;
};

}  // namespace di::kv
