"""``StepStats``: the engine's cumulative stage times and counts (the benchmarks read the ratios)."""

from __future__ import annotations

import attrs


@attrs.define
class StepStats:
    """Cumulative wall time per stage (seconds) and counts; the benchmark reads the ratios."""

    steps: int = 0
    schedule_s: float = 0.0
    build_s: float = 0.0
    execute_s: float = 0.0
    sample_s: float = 0.0  # mask + sample + grammar advance
    update_s: float = 0.0
    tokens_sampled: int = 0
    verify_rows: int = 0  # decode rows that verified drafts
    overlap_steps: int = 0  # launched before the previous step's tokens were read (engine/overlap.py)
    host_wait_steps: int = (
        0  # async steps that waited for the previous tokens first (structured rows, host Engram)
    )
    land_wait_s: float = 0.0  # host time blocked on a step's tokens after the next one was launched
