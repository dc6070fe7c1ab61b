"""DeepEPEngramTable's own logic (id checks, int32 indices, hook call, fp8 dequantisation, shapes) against a
stand-in ``deep_ep`` module that emulates a one-rank ElasticBuffer per DeepEP's documented engram API."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from deepinfer_core.engram import DeepEPEngramTable, LocalEngramTable, make_storage, random_values


class _FakeElasticBuffer:
    def __init__(self, group, **kwargs) -> None:
        self.kwargs = kwargs
        self.storage: torch.Tensor | None = None
        self.sf: torch.Tensor | None = None

    def engram_write(self, storage: torch.Tensor, sf: torch.Tensor | None = None) -> None:
        self.storage, self.sf = storage.clone(), sf

    def engram_fetch(self, indices: torch.Tensor):
        assert indices.dtype == torch.int32 and indices.dim() == 1
        idx = indices.long()

        def hook():
            if self.sf is None:
                return self.storage[idx]
            return self.storage[idx], self.sf[idx]

        return hook


@pytest.fixture
def fake_deep_ep(monkeypatch):
    mod = types.ModuleType("deep_ep")
    mod.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None)
    mod.ElasticBuffer = _FakeElasticBuffer
    monkeypatch.setitem(sys.modules, "deep_ep", mod)
    return mod


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_adapter_matches_local_table(fake_deep_ep, fmt: str) -> None:
    values = random_values(40, 64, seed=5)
    data, scales = make_storage(values, fmt)
    table = DeepEPEngramTable(data, 40, group=None, scales=scales, num_cpu_bytes=123)  # type: ignore[arg-type]
    assert table.buffer.kwargs == {"num_cpu_bytes": 123}  # sizing arguments pass through
    if fmt == "fp8":
        assert table.buffer.sf.dtype == torch.float8_e8m0fnu  # scales handed over as ue8m0
    ids = torch.randint(0, 40, (6, 5))
    assert torch.equal(table.fetch(ids), LocalEngramTable(data, scales).fetch(ids))
    with pytest.raises(IndexError, match="row_ids: id 40"):
        table.fetch(torch.tensor([40]))
