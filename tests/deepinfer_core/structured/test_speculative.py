"""Draft rows from the manager equal the masks obtained by stepping a matcher token by token."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from deepinfer_core.structured import GrammarSpec, StructuredOutputManager, make_backend

from ._decode import allowed_ids
from .test_end_to_end import EBNF, REGEXES, SCHEMA

SPECS = [GrammarSpec("regex", r) for r in REGEXES] + [
    GrammarSpec("json_schema", SCHEMA),
    GrammarSpec("ebnf", EBNF),
]


def _tail_clear(row: torch.Tensor, vocab: int) -> torch.Tensor:
    row = row.clone()
    if vocab % 32:
        row[-1] &= int(np.int32(np.uint32((1 << (vocab % 32)) - 1)))
    return row


def _stepwise(matcher, drafts: list[int], words: int, vocab: int) -> tuple[list[torch.Tensor], int]:
    """Reference: mask, accept d1, mask, ...; stop at a rejected draft, after EOS, or at a dead state."""
    buf = torch.zeros((1, words), dtype=torch.int32)
    matcher.fill_next_token_bitmask(buf, 0)
    rows, taken = [_tail_clear(buf[0], vocab)], 0
    for d in drafts:
        if not matcher.accept_token(d):
            break
        taken += 1
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(buf, 0)
        row = _tail_clear(buf[0], vocab)
        if not row.any():  # a state no token continues: the draft is cut before it
            taken -= 1
            break
        rows.append(row)
    matcher.rollback(taken)
    return rows, taken


class RowByRow:
    """The backend without its batch ``fill_rows``: the manager falls back to one matcher at a time."""

    def __init__(self, inner: object) -> None:
        self.inner, self.vocab_size = inner, inner.vocab_size

    def compile(self, spec: GrammarSpec) -> object:
        return self.inner.compile(spec)

    def matcher(self, compiled: object) -> object:
        return self.inner.matcher(compiled)


@pytest.mark.parametrize("path", ["batched", "row_by_row", "two_threads"])
@pytest.mark.parametrize("vocab", ["byte", "bpe"])
@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_draft_rows_equal_stepwise_masks(name: str, vocab: str, path: str, backend_for, tok_for) -> None:
    if path == "two_threads":  # xgrammar BatchGrammarMatcher(2), llguidance LLExecutor(2)
        backend = make_backend(name, tok_for(vocab), mask_threads=2)
    else:
        backend = backend_for(name, vocab) if path == "batched" else RowByRow(backend_for(name, vocab))
    V, words = backend.vocab_size, (backend.vocab_size + 31) // 32
    rng = np.random.default_rng(zlib.crc32(f"{name}-{vocab}-{path}".encode()))
    # The engines' own rows (the byte filter on top is tested against an independent UTF-8 oracle in
    # test_utf8.py, drafts included).
    mgr = StructuredOutputManager(backend, compile_workers=1, utf8=False)
    refs, rid = {}, 0
    for spec in SPECS:
        for _ in range(4):
            mgr.add_request(rid, spec)
            refs[rid] = backend.matcher(backend.compile(spec))
            rid += 1
    mgr.wait(refs)
    buf = torch.zeros((1, words), dtype=torch.int32)
    cuts = full = 0
    for _step in range(12):
        live = [r for r in refs if mgr.finish_reason(r) is None]
        if not live:
            break
        batch = []
        for r in live:
            ref, drafts, taken = refs[r], [], 0
            for _ in range(int(rng.integers(0, 6))):
                if rng.random() < 0.2 or ref.is_terminated():
                    drafts.append(int(rng.integers(0, V)))
                    continue
                ref.fill_next_token_bitmask(buf, 0)
                ok = allowed_ids(buf[0], V)
                t = int(rng.choice(ok))
                drafts.append(t)
                taken += ref.accept_token(t)
            ref.rollback(taken)
            batch.append((r, drafts))
        bm = mgr.fill_bitmask(batch)
        for j, (r, drafts) in enumerate(batch):
            rows, expect_k = _stepwise(refs[r], drafts, words, V)
            base, end = int(bm.offsets[j]), int(bm.offsets[j + 1])
            assert end - base == 1 + len(drafts)
            assert int(bm.num_drafts[j]) == expect_k, (r, drafts)
            for i, row in enumerate(rows):
                assert torch.equal(bm.bitmask[base + i], row), (name, r, i)
            # Rows past the last reachable state repeat the last real row: never all-masked.
            for i in range(base + len(rows), end):
                assert torch.equal(bm.bitmask[i], rows[-1])
            cuts += expect_k < len(drafts)
            full += expect_k == len(drafts) > 0
        # Commit a random number of the surviving drafts plus one sampled token, as a verifier would.
        for j, (r, drafts) in enumerate(batch):
            base, k = int(bm.offsets[j]), int(bm.num_drafts[j])
            acc = int(rng.integers(0, k + 1))
            ok = allowed_ids(bm.bitmask[base + acc], V)
            commit = [*drafts[:acc], int(rng.choice(ok))]
            n = mgr.advance(r, commit)
            for t in commit[:n]:
                assert refs[r].accept_token(t)
        # After fill + advance the manager's matcher is exactly at the committed state.
        for r in live:
            if mgr.finish_reason(r) is None:
                again = mgr.fill_bitmask([(r, [])])
                refs[r].fill_next_token_bitmask(buf, 0)
                assert torch.equal(again.bitmask[0], _tail_clear(buf[0], V))
    assert cuts > 10 and full > 10  # both paths exercised


def test_rejected_draft_cuts_and_eos_draft_ends(backend_for, byte_tok) -> None:
    backend = backend_for("xgrammar", "byte")
    mgr = StructuredOutputManager(backend)
    assert hasattr(backend, "fill_rows")  # the batched path
    mgr.add_request("r", GrammarSpec("regex", "ab?"))
    mgr.wait(["r"])
    a, b, z, eos = (*byte_tok.encode("abz"), byte_tok.eos_token_id)
    bm = mgr.fill_bitmask([("r", [a, z, b])])
    assert bm.num_drafts.tolist() == [1]  # 'z' is rejected: 'b' after it is not verified
    bm = mgr.fill_bitmask([("r", [a, eos, b])])
    assert bm.num_drafts.tolist() == [2]  # EOS draft survives, nothing after it
    rows = bm.bitmask
    assert torch.equal(rows[2], rows[1]) and torch.equal(rows[3], rows[1])  # repeated, not all-masked
    assert mgr.advance("r", [a, eos, b]) == 2
    assert mgr.finish_reason("r") == "stop"
