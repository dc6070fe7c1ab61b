"""The python examples of the component docs run as written (each block in a fresh namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
# doc -> the fewest python examples it must keep (a doc that lost its examples fails, not passes)
MIN_EXAMPLES = {"balancers.md": 1, "kvstore.md": 2}
BLOCKS = {
    name: re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), flags=re.S) for name in MIN_EXAMPLES
}


@pytest.mark.parametrize(("doc", "i"), [(d, i) for d, blocks in BLOCKS.items() for i in range(len(blocks))])
def test_doc_example_runs(doc: str, i: int) -> None:
    exec(compile(BLOCKS[doc][i], f"{doc}[{i}]", "exec"), {})


@pytest.mark.parametrize("doc", sorted(MIN_EXAMPLES))
def test_doc_has_examples(doc: str) -> None:
    assert len(BLOCKS[doc]) >= MIN_EXAMPLES[doc]
