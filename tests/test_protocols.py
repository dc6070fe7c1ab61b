"""Each concrete component that exists satisfies its protocol (runtime_checkable isinstance).

Components register themselves here as they land: (protocol, factory) pairs. A factory that raises
ImportError means the component has not been built in this tree yet.
"""

from __future__ import annotations

import inspect

import pytest

from deepinfer_core import protocols as P
from deepinfer_kernels import get_backend

CASES = [
    ("Tokenizer", lambda: __import__("deepinfer_core.tokenizer", fromlist=["x"]).ByteTokenizer()),
    ("Backend", lambda: get_backend("reference")),
]


@pytest.mark.parametrize(("proto", "factory"), CASES, ids=[c[0] for c in CASES])
def test_component_satisfies_protocol(proto: str, factory) -> None:
    obj = factory()
    assert isinstance(obj, getattr(P, proto))


def test_every_protocol_method_documented() -> None:
    for name in P.__all__:
        cls = getattr(P, name)
        assert cls.__doc__, name
        for attr, member in vars(cls).items():
            if attr.startswith("_"):
                continue
            fn = member.fget if isinstance(member, property) else member
            if inspect.isfunction(fn):
                assert fn.__doc__, f"{name}.{attr} has no contract docstring"
