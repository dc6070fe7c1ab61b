"""Real-world JSON schemas through the manager: compiled / valid / invalid-but-``stop`` per backend.

The method of issue #20: every schema of a sample (JSONSchemaBench files, one schema per file) is one
request through :class:`~deepinfer_core.structured.StructuredOutputManager` exactly as the engine uses
it (``add_request`` -> ``wait`` -> ``fill_bitmask`` / ``advance`` / ``finish_reason``), decoded by
random sampling under the mask (each token uniform over the allowed ones: what a model with flat logits
would do, and the harshest test of an engine's approximations). A finished document is then checked
independently of the manager (:func:`judge`: strict UTF-8, strict JSON, jsonschema with format checks).

Counted per backend: ``compiled`` (the backend accepted the schema), ``valid`` (finished with ``stop``
and passed the check), ``invalid_stop`` (finished with ``stop`` but failed it: the number the issue
requires to be zero), ``violation`` (finished with ``grammar_violation``: the manager caught it),
``dead_end``, ``length`` (hit ``max_tokens``), ``unchecked`` (``stop``, but the schema check could not
run, e.g. an unresolvable ``$ref``; UTF-8 and JSON were checked). Mask cost: CPU time of
``fill_bitmask`` per token (``time.process_time`` around each call), over all steps of all schemas;
``advance`` likewise (it includes the byte filter's step and, once per document, the final check).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from deepinfer_core.structured.spec import GrammarSpec
from deepinfer_core.structured.validate import check_document, make_validator

log = logging.getLogger(__name__)


@attrs.frozen(slots=True)
class Outcome:
    """One schema through one backend."""

    name: str
    backend: str
    compiled: bool
    engine: str | None = None  # the engine that served it (auto: either)
    finish: str | None = None
    tokens: int = 0
    verdict: str = ""  # "valid" / "invalid" / "unchecked" / "" (not finished with stop)
    error: str | None = None
    mask_s: float = 0.0  # CPU seconds in fill_bitmask
    rows: int = 0
    advance_s: float = 0.0  # CPU seconds in advance (the byte filter's step and the final check included)


def load_sample(
    root: str | Path, sets: Sequence[str] | None = None, per_set: int | None = None
) -> list[tuple[str, str]]:
    """(``set/file``, schema text) for the sample under ``root`` (its manifest.json lists the files);
    the text is kept as written, so key order reaches the grammar unchanged."""
    root = Path(root)
    manifest = json.loads((root / "manifest.json").read_text())
    files = manifest["files"]
    if sets is not None:
        files = [f for f in files if f.split("/")[0] in sets]
    if per_set is not None:
        seen: Counter[str] = Counter()
        keep = []
        for f in sorted(files):
            s = f.split("/")[0]
            if seen[s] < per_set:
                seen[s] += 1
                keep.append(f)
        files = keep
    return [(f, (root / f).read_text()) for f in files]


def judge(data: bytes, schema_text: str) -> tuple[str, str | None]:
    """("valid" | "invalid" | "unchecked", message) of a finished document, from its bytes alone."""
    validator, why = make_validator(schema_text)
    v = check_document(data, validator, why)
    if not v.ok:
        return "invalid", v.error
    return ("valid", None) if v.checked else ("unchecked", v.error)


def _spec(text: str, options: dict[str, Any] | None) -> GrammarSpec | None:
    try:
        return GrammarSpec("json_schema", text, options=options)
    except ValueError:
        return None


def run_sample(
    mgr: Any,
    backend_name: str,
    schemas: Iterable[tuple[str, str]],
    token_bytes: Sequence[bytes],
    *,
    seed: int = 0,
    max_tokens: int = 2048,
    batch: int = 1,
    options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Outcome]:
    """Decode every schema once through ``mgr``; ``batch`` requests run together (refilled as they end)."""
    rng = np.random.default_rng(seed)
    V = mgr.vocab_size
    todo = list(schemas)
    outs: list[Outcome] = []
    live: dict[str, dict[str, Any]] = {}
    pending = 0

    def admit() -> None:
        nonlocal pending
        while todo and len(live) < batch:
            name, text = todo.pop(0)
            spec = _spec(text, options)
            if spec is None:
                outs.append(Outcome(name, backend_name, False, error="not a JSON object"))
                continue
            mgr.add_request(name, spec)
            mgr.wait([name])
            why = mgr.finish_reason(name)
            if why is not None:  # refused by the backend
                outs.append(Outcome(name, backend_name, False, finish=str(why), error=mgr.error(name)))
                mgr.remove_request(name)
                if progress:
                    progress(1)
                continue
            live[name] = {"text": text, "toks": [], "mask_s": 0.0, "rows": 0, "adv_s": 0.0}
            pending += 1

    admit()
    while live:
        ids = list(live)
        t0 = time.process_time()
        bm = mgr.fill_bitmask([(r, ()) for r in ids])
        dt = time.process_time() - t0
        bits = np.unpackbits(bm.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :V]
        for j, r in enumerate(ids):
            st = live[r]
            st["mask_s"] += dt / len(ids)
            st["rows"] += 1
            done = None
            if bm.dead_end[j]:
                done = str(mgr.finish_reason(r))
            else:
                t = int(rng.choice(np.flatnonzero(bits[j])))
                t1 = time.process_time()
                mgr.advance(r, [t])
                st["adv_s"] += time.process_time() - t1
                st["toks"].append(t)
                why = mgr.finish_reason(r)
                if why is not None:
                    done = str(why)
                elif len(st["toks"]) >= max_tokens:
                    done = "length"
            if done is None:
                continue
            data = b"".join(token_bytes[t] for t in st["toks"])
            verdict, err = judge(data, st["text"]) if done == "stop" else ("", mgr.error(r))
            engine = mgr.metrics(r).get("grammar_engine")
            outs.append(
                Outcome(
                    r,
                    backend_name,
                    True,
                    engine,
                    done,
                    len(st["toks"]),
                    verdict,
                    err,
                    st["mask_s"],
                    st["rows"],
                    st["adv_s"],
                )
            )
            mgr.remove_request(r)
            del live[r]
            if progress:
                progress(1)
        admit()
    return outs


def summarize(outs: Sequence[Outcome]) -> dict[str, Any]:
    """Counts (see the module docstring), fractions of all schemas, and the mask cost per token."""
    n = len(outs)
    c: Counter[str] = Counter()
    for o in outs:
        c["compiled"] += o.compiled
        c["valid"] += o.verdict == "valid"
        c["invalid_stop"] += o.verdict == "invalid"
        c["unchecked"] += o.verdict == "unchecked"
        c["violation"] += o.finish == "grammar_violation"
        c["dead_end"] += o.finish == "grammar_dead_end"
        c["length"] += o.finish == "length"
        if o.engine:
            c[f"served_{o.engine}"] += 1
    rows = sum(o.rows for o in outs)
    mask_s = sum(o.mask_s for o in outs)
    return {
        "schemas": n,
        **dict(c),
        "compiled_pct": round(100 * c["compiled"] / max(n, 1), 1),
        "valid_pct": round(100 * c["valid"] / max(n, 1), 1),
        "tokens": rows,
        "mask_us_per_token": round(1e6 * mask_s / max(rows, 1), 3),
        "advance_us_per_token": round(1e6 * sum(o.advance_s for o in outs) / max(rows, 1), 3),
    }
