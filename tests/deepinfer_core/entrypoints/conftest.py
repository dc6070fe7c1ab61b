"""The server tests: one ``deepinfer serve`` child process per module (tiny model, batch-invariant mode, on
127.0.0.1, stopped by its pid) and the offline reference engine with the same settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from deepinfer_core.engine import LLM
from deepinfer_core.entrypoints.openai.launch import ServerProcess

SERVER_ARGS = (
    "--model",
    "tiny",
    "--seed",
    "0",
    "--batch-invariant",
    "--max-num-seqs",
    "64",
    "--num-blocks",
    "2048",
)


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SERVER_ARGS, env={"OMP_NUM_THREADS": "1"}) as srv:
        yield srv


@pytest.fixture(scope="session")
def ref() -> LLM:
    """The same model and mode offline: a request alone through LLM.generate."""
    before = torch.get_num_threads()
    llm = LLM("tiny", seed=0, batch_invariant=True, max_num_seqs=64, num_blocks=2048)
    torch.set_num_threads(before)
    return llm


def wait_idle(srv: ServerProcess, timeout: float = 30.0) -> dict[str, float]:
    """Every request ended in the server: no live request, stream, KV block or state slot in use."""
    import time

    t0 = time.monotonic()
    while True:
        m = srv.metrics()
        if all(
            m[k] == 0
            for k in (
                "deepinfer_requests_live",
                "deepinfer_streams_open",
                "deepinfer_kv_blocks_used",
                "deepinfer_state_slots_used",
            )
        ):
            return m
        assert time.monotonic() - t0 < timeout, {k: v for k, v in m.items() if "bucket" not in k}
        time.sleep(0.05)
