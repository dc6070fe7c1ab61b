"""The C++ pass over filled bitmasks (_C.structured.finish_rows) against the numpy fallback."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_core.structured import manager as M


@pytest.mark.skipif(M._C_FINISH_ROWS is None, reason="extension built without csrc/structured")
@pytest.mark.parametrize("seed", range(8))
def test_cpp_pass_equals_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, words = int(rng.integers(0, 40)), int(rng.integers(1, 70))
    a = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    a[rng.random(rows) < 0.4] = 0  # dead rows
    sparse = rng.random(rows) < 0.3
    a[sparse, :-1] = 0  # live only through the last word: the padding decides
    tail_bits = int(rng.integers(0, 32))
    keep = None if tail_bits == 0 else np.int32(np.uint32((1 << tail_bits) - 1))
    keep_c = -1 if tail_bits == 0 else (1 << tail_bits) - 1
    b = a.copy()
    got = M._finish_rows(a, a[:, -1] if keep is not None else None, keep, keep_c)
    want = M._finish_rows_numpy(b, b[:, -1] if keep is not None else None, keep)
    assert got == want
    assert np.array_equal(a, b)


def test_cpp_pass_refuses_copies() -> None:
    if M._C_FINISH_ROWS is None:
        pytest.skip("extension built without csrc/structured")
    a = np.zeros((2, 4), dtype=np.int32)
    with pytest.raises(TypeError):
        M._C_FINISH_ROWS(a[:, :2], 1)  # a strided view would be copied, and the copy cleared
    with pytest.raises(TypeError):
        M._C_FINISH_ROWS(a.astype(np.int64), 1)
