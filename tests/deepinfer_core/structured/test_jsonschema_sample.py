"""A CI-sized subset of the real-world schema sample (issue #20's method; benchmarks/structured.py
--schemas runs all of it and prints the table per backend).

Absolute property: no document that fails the independent check finishes with ``stop``, on any backend.
Floors for ``auto`` (compiled, valid) are set below what the full dev sample measures (100% / 92.5%), so
that random sampling on a small subset does not flake; the benchmark holds the real numbers.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepinfer_core.structured import StructuredOutputManager, make_backend
from deepinfer_core.structured.evaluate import load_sample, run_sample, summarize

pytest.importorskip("jsonschema")

# the development sample beside the checkout when present, else the subset vendored for CI (36 schemas,
# 4 per set, drawn from it once: tests/data/jsonschema-ci/manifest.json)
DEV = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "jsonschema-dev"
SAMPLE = (
    DEV
    if (DEV / "manifest.json").exists()
    else Path(__file__).resolve().parents[2] / "data" / "jsonschema-ci"
)
PER_SET = 3  # 10 sets: 30 schemas


@pytest.fixture(scope="module")
def schemas() -> list[tuple[str, str]]:
    if not (SAMPLE / "manifest.json").exists():
        pytest.skip(f"the development sample is not at {SAMPLE}")
    rng = random.Random()
    sample = load_sample(SAMPLE)
    by_set: dict[str, list[tuple[str, str]]] = {}
    for name, text in sample:
        by_set.setdefault(name.split("/")[0], []).append((name, text))
    return [s for group in by_set.values() for s in rng.sample(group, PER_SET)]


@pytest.mark.parametrize("name", ["auto", "xgrammar", "llguidance"])
def test_no_invalid_document_finishes_as_stop(name: str, schemas, byte_tok) -> None:
    backend = make_backend(name, byte_tok, mask_threads=1)
    mgr = StructuredOutputManager(backend, compile_workers=1)
    seed = random.randrange(2**31)
    outs = run_sample(mgr, name, schemas, backend.vocab.token_bytes, seed=seed, max_tokens=3000)
    s = summarize(outs)
    bad = [(o.name, o.error) for o in outs if o.verdict == "invalid"]
    assert s["invalid_stop"] == 0, (seed, bad)
    assert all(o.finish != "stop" or o.tokens > 0 for o in outs)
    if name == "auto":
        assert s["compiled"] >= len(schemas) - 1, (seed, s)
        assert s["valid"] >= 0.65 * len(schemas), (seed, s)
    mgr.close()
