"""DEEPINFER_KERNEL_LIBS: parsing, the auto default, and libraries that are named but not importable."""

from __future__ import annotations

import logging

import pytest

from deepinfer_core.envs import EnvError, kernel_libs
from deepinfer_kernels.libs import switch


def test_parsing() -> None:
    assert kernel_libs({}) == "auto"
    assert kernel_libs({"DEEPINFER_KERNEL_LIBS": " Auto "}) == "auto"
    assert kernel_libs({"DEEPINFER_KERNEL_LIBS": "none"}) == ()
    assert kernel_libs({"DEEPINFER_KERNEL_LIBS": "deep_select, deep_gemm,deep_select"}) == (
        "deep_select",
        "deep_gemm",
    )
    with pytest.raises(EnvError, match=r"DEEPINFER_KERNEL_LIBS.*deep_ep"):
        kernel_libs({"DEEPINFER_KERNEL_LIBS": "deep_gemm,deep_ep"})


def test_auto_is_the_measured_set_and_none_turns_all_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPINFER_KERNEL_LIBS", raising=False)
    assert switch.selected() == switch.AUTO_LIBRARIES
    monkeypatch.setenv("DEEPINFER_KERNEL_LIBS", "none")
    assert not any(switch.enabled(lib) for lib in switch.SWITCHABLE)


def test_named_but_missing_library_is_off_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    missing = [lib for lib in switch.SWITCHABLE if not switch.importable(lib)]
    if not missing:
        pytest.skip("every library is importable here")
    monkeypatch.setenv("DEEPINFER_KERNEL_LIBS", ",".join(missing))
    monkeypatch.setattr(switch, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=switch.__name__):
        assert not switch.enabled(missing[0])
        assert not switch.enabled(missing[0])
    assert sum(missing[0] in r.getMessage() for r in caplog.records) == 1  # once, not per call
    with pytest.raises(RuntimeError, match=missing[0]):
        switch.require(missing[0])
    with pytest.raises(ValueError, match="lib"):
        switch.enabled("cublas")
