"""The engine on the cuda backend (model on the GPU, cache writes, mask and sampling through the cuda
ops) gives the reference backend's tokens. Skipped without CUDA."""

from __future__ import annotations

import random
import re

import pytest

from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import random_prompts


@pytest.mark.gpu
def test_cuda_backend_matches_reference() -> None:
    seed = random.randrange(2**31)
    prompts = random_prompts(seed, 4, 20, 80)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=seed, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=seed + 1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=seed + 2, max_tokens=16, so_args={"regex": "[0-9]{3}-[a-z]{2}"}),
    ]
    kw = {
        "model": "tiny-random",
        "seed": seed % 1000,
        "dtype": "float64",
        "quantize": False,
        "num_blocks": 128,
        "max_num_seqs": 8,
    }
    ref = LLM(backend="reference", **kw).generate(prompts, params, use_tqdm=False)
    got = LLM(backend="cuda", **kw).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref], f"seed {seed}"
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", got[3].text)


@pytest.mark.gpu
def test_default_cuda_engine_replays_graphs() -> None:
    """The engine's default cuda setup (the shipped tiny model, quantised caches, no speculation)
    captures its decode steps in CUDA graphs instead of falling back to eager steps, and the greedy
    tokens equal the same engine's with graphs off."""
    from deepinfer_core.envs import Envs

    prompts = random_prompts(5, 4, 20, 60)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(
            backend="cuda", num_blocks=128, max_num_seqs=8, envs=Envs(use_nextn_decode=0, cuda_graphs=graphs)
        )
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        ex = llm.engine.executor
        assert ex.cuda_graphs == graphs
        if graphs:
            g = ex.graphs()
            assert not g.failed and g.captures >= 1 and g.replays >= 8
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_boundary_snapshots_replay_graphs_and_serve_follow_ups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows that cross a block boundary ask for an encoder-ring snapshot (prefix caching): those
    steps replay the graph too (no eager decode step after the warm-ups), and a follow-up turn that hits
    the published snapshots gets the reference backend's tokens (exact caches, float64)."""
    from deepinfer_core.model import decode_step

    calls = {"body": 0}
    real = decode_step.decode_body

    def counted(*a: object, **kw: object) -> object:
        calls["body"] += 1
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_step, "decode_body", counted)
    seed = random.randrange(2**31)
    prompts = random_prompts(seed, 3, 20, 30)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # crosses 2-3 boundaries of 16
    kw = {
        "model": "tiny-random",
        "seed": seed % 1000,
        "dtype": "float64",
        "quantize": False,
        "num_blocks": 128,
        "max_num_seqs": 4,
    }
    outs = {}
    for backend in ("reference", "cuda"):
        llm = LLM(backend=backend, **kw)
        first = llm.generate(prompts, sp, use_tqdm=False)
        if backend == "cuda":
            g = llm.engine.executor.graphs()
            # every body call is a warm-up or capture (2 per captured key) or a prefill-free eager step: none
            assert not g.failed and calls["body"] == 2 * g.captures, (calls, g.captures, g.replays)
        enc = llm.engine.tokenizer.encode
        follow = [list(enc(p)) + list(o.token_ids) + list(enc(p[:8])) for p, o in zip(prompts, first)]
        second = llm.generate(
            follow, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )
        outs[backend] = ([o.token_ids for o in first], [o.token_ids for o in second])
    assert outs["cuda"] == outs["reference"], f"seed {seed}"


def held_out_prompts(n: int, chars: int = 160) -> list[str]:
    """``n`` pieces (a file's opening, then its middle) of the standard-library files the shipped tiny
    model never trained on (scripts/train_tiny.py holds out 1 file in 32 by a hash of its corpus name)."""
    import hashlib
    import sysconfig
    from pathlib import Path

    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(lib.rglob("*.py")):
        rel = p.relative_to(lib).as_posix()
        if set(rel.split("/")) & {"site-packages", "test", "tests", "idle_test", "__pycache__"}:
            continue
        if int(hashlib.sha1(f"stdlib/{rel}".encode()).hexdigest(), 16) % 32:
            continue
        try:
            text = p.read_text(encoding="utf-8").strip()
        except (UnicodeDecodeError, OSError):
            continue
        mid = len(text) // 2
        for piece in (text[:chars], text[mid : mid + chars] if mid >= chars else ""):
            if len(piece) == chars and len(out) < n:
                out.append(piece)
        if len(out) == n:
            return out
    raise AssertionError(f"only {len(out)} held-out files of >= {chars} characters")


@pytest.mark.gpu
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_trained_tiny_cuda_equals_reference_on_held_out_prompts(graphs: bool, speculative: bool) -> None:
    """Issue #32's check: the shipped trained ``tiny`` model's greedy tokens on 16 held-out prompts (first
    32 tokens each) are the reference backend's, graphs on and off, speculation on and off."""
    from deepinfer_core.envs import Envs

    prompts = held_out_prompts(16)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kw = {"model": "tiny", "num_blocks": 512, "max_num_seqs": 16, "speculative": speculative}
    ref = LLM(backend="reference", **kw).generate(prompts, sp, use_tqdm=False)
    llm = LLM(backend="cuda", envs=Envs(cuda_graphs=graphs), **kw)
    got = llm.generate(prompts, sp, use_tqdm=False)
    diff = [i for i, (a, b) in enumerate(zip(got, ref)) if a.token_ids != b.token_ids]
    assert not diff, f"prompts {diff} differ (graphs={graphs}, speculative={speculative})"
    if graphs and not speculative:
        assert llm.engine.executor.graphs().replays > 0
