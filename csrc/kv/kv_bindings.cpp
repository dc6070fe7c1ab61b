// _C.kv: nanobind bindings of di::kv::BlockPool (and, in state_pool.cpp, the state pool).
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "core/buffers.h"
#include "core/registry.h"
#include "kv/block_pool.h"
#include "kv/kv_module.h"

namespace nb = nanobind;
using di::kv::BlockPool;

namespace {

using I32Out2 = nb::ndarray<int32_t, nb::numpy, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

std::string as_string(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

nb::ndarray<nb::numpy, int32_t> vec_to_array(const std::vector<int32_t>& v) {
  auto a = di::new_array<int32_t>({v.size()});
  if (!v.empty()) std::memcpy(a.data(), v.data(), v.size() * sizeof(int32_t));
  return a;
}

}  // namespace

namespace di::kv {

void register_block_pool(nb::module_& m) {
  nb::class_<BlockPool>(m, "BlockPool",
                        "Paged KV block pool: refcounted blocks, block tables, copy-on-write, prefix cache.")
      .def(nb::init<int32_t, int32_t>(), nb::arg("num_blocks"), nb::arg("block_size"))
      .def_prop_ro("block_size", &BlockPool::block_size)
      .def_prop_ro("num_blocks", &BlockPool::num_blocks)
      .def_prop_ro("num_free_blocks", &BlockPool::num_free_blocks)
      .def_prop_ro("num_seqs", &BlockPool::num_seqs)
      .def_prop_ro("num_cached_blocks", &BlockPool::num_cached_blocks)
      .def_prop_ro("num_evictable_blocks", &BlockPool::num_evictable_blocks)
      .def_prop_ro("num_pending_copy_ops", &BlockPool::num_pending_copy_ops)
      .def("blocks_for_tokens", &BlockPool::blocks_for_tokens, nb::arg("num_tokens"))
      .def("can_allocate", &BlockPool::can_allocate, nb::arg("num_tokens"))
      .def("allocate", &BlockPool::allocate, nb::arg("seq_id"), nb::arg("num_tokens"))
      .def("can_append", &BlockPool::can_append, nb::arg("seq_id"), nb::arg("num_tokens"))
      .def("append_slots", &BlockPool::append_slots, nb::arg("seq_id"), nb::arg("num_tokens"))
      .def("free", &BlockPool::free, nb::arg("seq_id"))
      .def("fork", &BlockPool::fork, nb::arg("seq_id"), nb::arg("child_id"))
      .def("contains", &BlockPool::contains, nb::arg("seq_id"))
      .def("num_tokens", &BlockPool::num_tokens, nb::arg("seq_id"))
      .def("refcount", &BlockPool::refcount, nb::arg("block"))
      .def("is_cached", &BlockPool::is_cached, nb::arg("block"))
      .def("slot", &BlockPool::slot, nb::arg("seq_id"), nb::arg("pos"))
      .def("block_table", [](const BlockPool& p, int64_t seq) { return vec_to_array(p.block_table(seq)); },
           nb::arg("seq_id"), "Copy of one sequence's block table (int32).")
      .def("block_tables",
           [](const BlockPool& p, di::CArray1<int64_t> ids, int64_t width) {
             const int64_t n = static_cast<int64_t>(ids.shape(0));
             const int64_t* d = ids.data();
             int64_t w = width >= 0 ? width : p.max_blocks_per_seq(d, n);
             auto out = di::new_array<int32_t>({static_cast<size_t>(n), static_cast<size_t>(w)});
             {
               nb::gil_scoped_release rel;
               p.fill_block_tables(d, n, out.data(), w);
             }
             return out;
           },
           nb::arg("seq_ids"), nb::arg("width") = -1,
           "int32 [len(seq_ids), width] (width -1: longest table), padded with the null block 0.")
      .def("fill_block_tables",
           [](const BlockPool& p, di::CArray1<int64_t> ids, I32Out2 out) {
             const int64_t n = static_cast<int64_t>(ids.shape(0));
             di::require(static_cast<int64_t>(out.shape(0)) >= n, "fill_block_tables: out has fewer rows than seq_ids");
             nb::gil_scoped_release rel;
             p.fill_block_tables(ids.data(), n, out.data(), static_cast<int64_t>(out.shape(1)));
           },
           nb::arg("seq_ids"), nb::arg("out"), "Write tables into an existing C-contiguous int32 [n, width] array.")
      .def("truncate", &BlockPool::truncate, nb::arg("seq_id"), nb::arg("num_tokens"))
      .def("slot_mapping",
           [](const BlockPool& p, di::CArray1<int64_t> ids, di::CArray1<int64_t> starts, di::CArray1<int64_t> counts,
              int64_t ratio) {
             const size_t n = ids.shape(0);
             di::require(starts.shape(0) == n && counts.shape(0) == n,
                         "slot_mapping: starts and counts must have one entry per seq_id");
             int64_t total = 0;
             for (size_t i = 0; i < n; ++i) {
               di::require(counts.data()[i] >= 0, "slot_mapping: counts must be >= 0");
               total += counts.data()[i];
             }
             auto out = di::new_array<int64_t>({static_cast<size_t>(total)});
             {
               nb::gil_scoped_release rel;
               p.fill_slot_mapping(ids.data(), starts.data(), counts.data(), static_cast<int64_t>(n), ratio, out.data());
             }
             return out;
           },
           nb::arg("seq_ids"), nb::arg("starts"), nb::arg("counts"), nb::arg("ratio") = 1,
           "int64 flat slots of positions (ratio 1) or compressed entries (ratio r) [start, start+count) per seq.")
      .def("take_copy_ops",
           [](BlockPool& p) {
             auto ops = p.take_copy_ops();
             auto a = di::new_array<int32_t>({ops.size(), 3});
             for (size_t i = 0; i < ops.size(); ++i) {
               a.data()[3 * i] = ops[i].src;
               a.data()[3 * i + 1] = ops[i].dst;
               a.data()[3 * i + 2] = ops[i].num_tokens;
             }
             return a;
           },
           "Pending copy-on-write copies as int32 [m, 3] rows (src, dst, num_tokens); clears them.")
      .def("match",
           [](const BlockPool& p, di::CArray1<int32_t> toks, nb::bytes extra) {
             std::vector<int32_t> out;
             std::string e = as_string(extra);
             int64_t n;
             {
               nb::gil_scoped_release rel;
               n = p.match(toks.data(), static_cast<int64_t>(toks.shape(0)), e, out);
             }
             return std::make_tuple(n, vec_to_array(out));
           },
           nb::arg("tokens"), nb::arg("extra_key") = nb::bytes(""))
      .def("cache_blocks",
           [](BlockPool& p, di::CArray1<int32_t> toks, di::CArray1<int32_t> blocks, nb::bytes extra) {
             return p.cache_blocks(toks.data(), static_cast<int64_t>(toks.shape(0)), blocks.data(),
                                   static_cast<int64_t>(blocks.shape(0)), as_string(extra));
           },
           nb::arg("tokens"), nb::arg("blocks"), nb::arg("extra_key") = nb::bytes(""))
      .def("cache_seq",
           [](BlockPool& p, int64_t seq, di::CArray1<int32_t> toks, nb::bytes extra) {
             return p.cache_seq(seq, toks.data(), static_cast<int64_t>(toks.shape(0)), as_string(extra));
           },
           nb::arg("seq_id"), nb::arg("tokens"), nb::arg("extra_key") = nb::bytes(""))
      .def("allocate_with_prefix",
           [](BlockPool& p, int64_t seq, int64_t n, di::CArray1<int32_t> prefix) {
             return p.allocate_with_prefix(seq, n, prefix.data(), static_cast<int64_t>(prefix.shape(0)));
           },
           nb::arg("seq_id"), nb::arg("num_tokens"), nb::arg("prefix_blocks"))
      .def("allocate_cached",
           [](BlockPool& p, int64_t seq, di::CArray1<int32_t> toks, nb::bytes extra) {
             return p.allocate_cached(seq, toks.data(), static_cast<int64_t>(toks.shape(0)), as_string(extra));
           },
           nb::arg("seq_id"), nb::arg("tokens"), nb::arg("extra_key") = nb::bytes(""),
           "match + allocate in one step; cached tokens reused, or -1 (no change) if it does not fit.")
      .def("evict_all_cached", &BlockPool::evict_all_cached)
      .def("set_hash_mask_for_testing", &BlockPool::set_hash_mask_for_testing, nb::arg("mask"))
      .def("check_invariants", &BlockPool::check_invariants)
      // Batched forms: one boundary crossing for a whole engine step.
      .def("allocate_many",
           [](BlockPool& p, di::CArray1<int64_t> ids, di::CArray1<int64_t> ntok) {
             const size_t n = ids.shape(0);
             di::require(ntok.shape(0) == n, "allocate_many: num_tokens must have one entry per seq_id");
             auto ok = di::new_array<bool>({n});
             nb::gil_scoped_release rel;
             for (size_t i = 0; i < n; ++i) ok.data()[i] = p.allocate(ids.data()[i], ntok.data()[i]);
             return ok;
           },
           nb::arg("seq_ids"), nb::arg("num_tokens"))
      .def("append_slots_many",
           [](BlockPool& p, di::CArray1<int64_t> ids, int64_t ntok) {
             const size_t n = ids.shape(0);
             auto ok = di::new_array<bool>({n});
             nb::gil_scoped_release rel;
             for (size_t i = 0; i < n; ++i) ok.data()[i] = p.append_slots(ids.data()[i], ntok);
             return ok;
           },
           nb::arg("seq_ids"), nb::arg("num_tokens"))
      .def("free_many",
           [](BlockPool& p, di::CArray1<int64_t> ids) {
             nb::gil_scoped_release rel;
             for (size_t i = 0; i < ids.shape(0); ++i) p.free(ids.data()[i]);
           },
           nb::arg("seq_ids"));
}

}  // namespace di::kv

DI_SUBMODULE(kv, "paged KV block pool (with prefix cache) and per-sequence state pool bookkeeping") {
  di::kv::register_block_pool(m);
  di::kv::register_state_pool(m);
}
