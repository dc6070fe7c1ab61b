"""The executor's "local" Engram tables live on the model's device (issue #24: the asynchronous overlap
hashes a decode step's n-grams on the device and fetches rows without reading the ids back; a host table
there made the engine fail on the H200 with out-of-range ids read from an unfinished copy).

CPU: ``LocalEngramTable.to`` keeps rows, scales, output dtype and gather op (oracle: the original
table's fetch); the executor's local tables are on the model's device. GPU: the same with a CUDA model,
and device-hashed ids fetched through the check-free gather equal the host-hashed fetch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_core.engram import LocalEngramTable
from deepinfer_core.engram.tables import random_values
from deepinfer_core.model import ModelExecutor
from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.engram_context import hashed_row_tables
from deepinfer_core.model.model import DeepSeekV41


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_table_to_keeps_rows_and_op(fmt: str) -> None:
    t = LocalEngramTable.from_values(random_values(50, 32, seed=3), fmt)
    u = t.to("cpu")
    ids = torch.randint(0, 50, (7, 3), generator=torch.Generator().manual_seed(1))
    assert torch.equal(t.fetch(ids), u.fetch(ids))
    assert u.fmt == t.fmt and u.out_dtype == t.out_dtype and u._gather is t._gather
    assert (u.scales is None) == (t.scales is None)


def _executor(device: str) -> ModelExecutor:
    model = DeepSeekV41.from_config(tiny_config(), seed=0, dtype=torch.float32, device=device)
    return ModelExecutor(model, 64, 16, 4)


def test_local_tables_are_on_the_model_device() -> None:
    ex = _executor("cpu")
    assert ex.engram_tables and all(t.device == ex.device for t in ex.engram_tables.values())


@pytest.mark.gpu
def test_cuda_local_tables_on_device_and_device_ids_fetch_equal() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ex = _executor("cuda")
    h = ex.model.engram_hasher
    assert all(t.device.type == "cuda" for t in ex.engram_tables.values())
    tokens = np.random.default_rng(0).integers(0, ex.cfg.vocab_size, 40)
    ids = torch.from_numpy(
        h.hash_host(tokens, np.array([0, 40]), np.full((1, ex.cfg.engram_max_ngram - 1), -1))
    )
    host = ex.model.engram_fetch(ids, ex.engram_tables)
    dev = ex.model.engram_fetch(ids.cuda(), hashed_row_tables(ex.engram_tables))
    assert all(torch.equal(host[lid], dev[lid]) for lid in host)
