"""Hypothesis stateful test: PagedKVPool + PrefixIndex driven through long random operation sequences.

The test keeps its own model: each live sequence's tokens, and a simulated KV memory where slot (block,
offset) holds the *whole prefix* that produced it (KV at position p depends on tokens[: p + 1]). After
every step it checks, independently of the C++ checker:
- refcount of every block == number of live tables holding it; block 0 never handed out;
- free count == usable blocks - distinct blocks in use (no block both free and used, no leak);
- tables have ceil(n / block_size) entries;
- every write goes to a block no one else can see (refcount 1, not cached): copy-on-write works;
- every block returned by match holds exactly the KV of the queried prefix: evicted or colliding
  entries are never returned.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deepinfer_core.kv import PagedKVPool, PrefixIndex

BS = 4
# A few shared stems plus random tails over a 3-token vocabulary: many shared prefixes and near misses.
STEMS = [[], [0, 1, 2, 0, 1, 2, 0, 1], [0] * 8, [0, 1, 2, 0, 1, 2, 0, 2], [1, 2] * 6]
PROMPT = st.builds(
    lambda stem, tail: stem + tail, st.sampled_from(STEMS), st.lists(st.integers(0, 2), max_size=10)
)
KEY = st.sampled_from([None, b"salt"])


class PoolMachine(RuleBasedStateMachine):
    num_blocks = 40
    hash_mask: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagedKVPool(self.num_blocks, BS)
        if self.hash_mask is not None:
            self.pool.impl.set_hash_mask_for_testing(self.hash_mask)
        self.index = PrefixIndex(self.pool)
        self.tokens: dict[int, list[int]] = {}
        self.keys: dict[int, bytes | None] = {}
        self.kv: dict[int, list[tuple[int, ...] | None]] = {}
        self.next_id = 0

    # ---- helpers ----
    def _pick(self, i: int) -> int:
        live = sorted(self.tokens)
        return live[i % len(live)]

    def _apply_copies(self) -> None:
        for src, dst, n in self.pool.take_copy_ops().tolist():
            event("copy-on-write")
            assert self.pool.refcount(dst) == 1 and not self.index.is_cached(dst)
            self.kv[dst] = list(self.kv[src][:n]) + [None] * (BS - n)

    def _write(self, sid: int, start: int) -> None:
        """Simulate the forward writing KV for positions [start, n) of sequence sid."""
        toks = self.tokens[sid]
        table = self.pool.block_table(sid).tolist()
        for p in range(start, len(toks)):
            b = table[p // BS]
            # never write into memory another sequence or the prefix cache can read
            assert self.pool.refcount(b) == 1, (b, self.pool.refcount(b))
            assert not self.index.is_cached(b)
            self.kv.setdefault(b, [None] * BS)[p % BS] = tuple(toks[: p + 1])

    def _check_match(self, toks: list[int], key: bytes | None, n: int, blocks: list[int]) -> None:
        assert n == len(blocks) * BS and n <= len(toks)
        if n:
            event("prefix hit")
        for i, b in enumerate(blocks):
            assert 0 < b < self.num_blocks
            for j in range(BS):
                assert self.kv[b][j] == tuple(toks[: i * BS + j + 1]), "match returned wrong KV"

    # ---- rules ----
    @rule(toks=PROMPT, key=KEY, use_cache=st.booleans(), then_insert=st.booleans())
    def new_seq(self, toks: list[int], key: bytes | None, use_cache: bool, then_insert: bool) -> None:
        sid = self.next_id
        self.next_id += 1
        free_before = self.pool.num_free_blocks
        cached_before = self.index.num_cached_blocks
        if use_cache:
            n_hit, hit = self.index.match(toks, key)
            self._check_match(toks, key, n_hit, hit)
            cached = self.index.allocate(sid, toks, key)
            if cached is None:
                assert not self.pool.contains(sid) and self.pool.num_free_blocks == free_before
                return
            assert cached == n_hit
        else:
            if not self.pool.allocate(sid, len(toks)):
                assert not self.pool.can_allocate(len(toks))
                assert not self.pool.contains(sid) and self.pool.num_free_blocks == free_before
                return
            cached = 0
        if self.index.num_cached_blocks < cached_before:
            event("eviction by allocation")
        if cached:
            event("allocated with a cached prefix")
        self.tokens[sid] = list(toks)
        self.keys[sid] = key
        self._write(sid, cached)
        if then_insert:
            self.index.insert_seq(sid, toks, key)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 10**6), more=st.lists(st.integers(0, 2), min_size=0, max_size=6))
    def append(self, i: int, more: list[int]) -> None:
        sid = self._pick(i)
        n = len(self.tokens[sid])
        can = self.pool.can_append(sid, len(more))
        table_before = self.pool.block_table(sid).tolist()
        ok = self.pool.append_slots(sid, len(more))
        assert ok == can
        if not ok:
            assert self.pool.block_table(sid).tolist() == table_before
            assert self.pool.take_copy_ops().shape == (0, 3)
            return
        self._apply_copies()
        self.tokens[sid].extend(more)
        self._write(sid, n)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 10**6), k=st.integers(0, 6))
    def reject_drafts(self, i: int, k: int) -> None:
        sid = self._pick(i)
        keep = max(0, len(self.tokens[sid]) - k)
        self.pool.truncate(sid, keep)
        del self.tokens[sid][keep:]

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 10**6))
    def fork(self, i: int) -> None:
        sid = self._pick(i)
        child = self.next_id
        self.next_id += 1
        self.pool.fork(sid, child)
        self.tokens[child] = list(self.tokens[sid])
        self.keys[child] = self.keys[sid]

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 10**6))
    def free(self, i: int) -> None:
        sid = self._pick(i)
        self.pool.free(sid)
        del self.tokens[sid]
        del self.keys[sid]

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 10**6))
    def insert(self, i: int) -> None:
        sid = self._pick(i)
        self.index.insert_seq(sid, self.tokens[sid], self.keys[sid])

    @rule(toks=PROMPT, key=KEY)
    def match(self, toks: list[int], key: bytes | None) -> None:
        n, blocks = self.index.match(toks, key)
        self._check_match(toks, key, n, blocks)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 10**6))
    def match_live(self, i: int) -> None:
        # a live, inserted sequence's own prefix should be found (unless a duplicate copy is cached)
        sid = self._pick(i)
        n, blocks = self.index.match(self.tokens[sid], self.keys[sid])
        self._check_match(self.tokens[sid], self.keys[sid], n, blocks)

    @rule()
    def evict_all(self) -> None:
        evictable = self.index.num_evictable_blocks
        assert self.index.evict_all() == evictable
        assert self.index.num_evictable_blocks == 0

    # ---- invariants ----
    @invariant()
    def consistent(self) -> None:
        self.pool.check_invariants()
        users: Counter[int] = Counter()
        for sid, toks in self.tokens.items():
            table = self.pool.block_table(sid).tolist()
            assert len(table) == -(-len(toks) // BS)
            assert self.pool.num_tokens(sid) == len(toks)
            users.update(table)
        assert 0 not in users
        for b in range(1, self.num_blocks):
            assert self.pool.refcount(b) == users.get(b, 0)
        assert self.pool.num_free_blocks == (self.num_blocks - 1) - len(users)
        assert self.index.num_evictable_blocks <= self.pool.num_free_blocks

    def teardown(self) -> None:
        for sid in list(self.tokens):
            self.pool.free(sid)
        assert self.pool.num_free_blocks == self.num_blocks - 1  # no leak
        self.index.evict_all()
        assert self.index.num_cached_blocks == 0
        assert self.index.match([0] * 20)[0] == 0
        self.pool.check_invariants()


class TightPoolMachine(PoolMachine):
    num_blocks = 14  # small, so allocation often has to evict cached blocks


class CollidingPoolMachine(PoolMachine):
    hash_mask = 0x3  # 4 distinct hash values: nearly every lookup meets colliding entries


for _m in (PoolMachine, TightPoolMachine, CollidingPoolMachine):
    _m.TestCase.settings = settings(max_examples=50, stateful_step_count=60, deadline=None)
TestPoolMachine = PoolMachine.TestCase
TestTightPoolMachine = TightPoolMachine.TestCase
TestCollidingPoolMachine = CollidingPoolMachine.TestCase
