"""The component demo runs and shows the seed's memory figure."""

from __future__ import annotations

from deepinfer_core.engram.demo import demo


def test_demo_prints_working_component(capsys) -> None:
    demo()
    out = capsys.readouterr().out
    assert "case variants share all 44/44" in out  # canonical map: 'The cat sat' == 'the CAT sat'
    assert "202.76 GB; over 64 rank(s): 3.168 GB per rank" in out
