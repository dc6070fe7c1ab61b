"""Every Engram table satisfies the EngramTable protocol (runtime isinstance)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepinfer_core.engram import (
    DeepEPEngramTable,
    HostEngramTable,
    LocalEngramTable,
    ShardedEngramTable,
    deep_ep_available,
    random_values,
)
from deepinfer_core.protocols import EngramTable


@pytest.mark.parametrize("cls", [LocalEngramTable, HostEngramTable])
def test_single_process_tables(cls) -> None:
    t = cls.from_values(random_values(8, 32), "fp8")
    assert isinstance(t, EngramTable)
    assert t.num_rows == 8 and t.row_dim == 32


def test_sharded_table_in_a_group_of_one(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        values = random_values(8, 32)
        t = ShardedEngramTable.from_full(values, "bf16")
        assert isinstance(t, EngramTable)
        assert torch.equal(t.fetch(torch.tensor([7, 0])), values[[7, 0]].to(torch.bfloat16))
    finally:
        dist.destroy_process_group()


def test_sharded_table_needs_a_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedEngramTable(torch.zeros(2, 32, dtype=torch.bfloat16), None, 2)


def test_deepep_adapter_only_with_deep_ep() -> None:
    if deep_ep_available():
        pytest.skip("deep_ep present: the adapter is exercised by GPU runs")
    assert hasattr(DeepEPEngramTable, "fetch") and hasattr(DeepEPEngramTable, "num_rows")
    with pytest.raises(ImportError, match="deep_ep is not importable"):
        DeepEPEngramTable(torch.zeros(2, 32, dtype=torch.bfloat16), 2, None)  # type: ignore[arg-type]
