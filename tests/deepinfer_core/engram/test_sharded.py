"""ShardedEngramTable over 2 and 4 gloo processes equals a local lookup (see deepinfer_core.engram.selfcheck)."""

from __future__ import annotations

import pytest

from deepinfer_core.engram import selfcheck


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_fetch_equals_local(world: int, tmp_path) -> None:
    # Each rank asserts its fetches against LocalEngramTable; a failure in any rank raises here.
    selfcheck.spawn(world, str(tmp_path / "init"))
