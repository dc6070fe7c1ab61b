"""The spec policies satisfy the VerifyScheduler protocol (runtime isinstance)."""

from __future__ import annotations

import pytest

from deepinfer_core.protocols import VerifyScheduler
from deepinfer_core.spec import FixedLength, MTPVarlen, NoSpec


@pytest.mark.parametrize("cls", [MTPVarlen, FixedLength, NoSpec])
def test_policies_satisfy_verify_scheduler(cls: type) -> None:
    assert isinstance(cls(), VerifyScheduler)
