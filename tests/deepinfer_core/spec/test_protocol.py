"""The spec policies satisfy the VerifyScheduler protocol (runtime isinstance)."""

from __future__ import annotations

import pytest

from deepinfer_core.protocols import VerifyScheduler
from deepinfer_core.spec import FixedLength, MTPVarlen, NoSpec


@pytest.mark.parametrize("cls", [MTPVarlen, FixedLength, NoSpec])
def test_policies_satisfy_verify_scheduler(cls: type) -> None:
    assert isinstance(cls(), VerifyScheduler)


def test_planners_do_not_import_torch() -> None:
    # An engine that only wants the verify-length planner must not pay for torch.
    import subprocess
    import sys

    code = "import sys, numpy as np, deepinfer_core.spec as s; s.MTPVarlen().plan(np.full((4, 5), 0.7)); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
