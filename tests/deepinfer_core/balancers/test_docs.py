"""The python examples of docs/balancers.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "balancers.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_doc_example_runs(i):
    exec(compile(BLOCKS[i], f"{DOC.name}[{i}]", "exec"), {})


def test_doc_has_examples():
    assert len(BLOCKS) >= 1
