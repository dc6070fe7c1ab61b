"""The component demo runs and shows the seed's memory figure."""

from __future__ import annotations

import re

from deepinfer_core.engram.demo import demo


def test_demo_prints_working_component(capsys) -> None:
    demo()
    out = capsys.readouterr().out
    # canonical map: 'The cat sat' == 'the CAT sat' (every row id of the two variants equal)
    m = re.search(r"case variants hash to the same rows: (\d+) of (\d+)", out)
    assert m and m.group(1) == m.group(2) and int(m.group(2)) > 0, out
    assert "202.76 GB; over 64 rank(s): 3.168 GB per rank" in out
