from __future__ import annotations

import pytest

from deepinfer_core.envs import EnvError, Envs


def test_defaults() -> None:
    e = Envs.from_environ({})
    assert e.enable_mtp_varlen is True
    assert e.use_nextn_decode == 5
    assert e.max_backtracking_tokens == 6  # drafts + 1: the SWA ring is 128 + 6 = 134 tokens
    assert e.batch_invariant is False
    assert e.yoco_prefill_keep_tokens == 140
    assert e.cuda_graphs is True and e.fuse_glue is False
    # unset: the executor's default (model.fused_kernels), neither forced on nor off
    assert e.fused_attention is None and e.fused_moe is None and e.fused_head is None


@pytest.mark.parametrize(
    ("env", "field", "value"),
    [
        ({"DEEPINFER_ENABLE_MTP_VARLEN": "0"}, "enable_mtp_varlen", False),
        ({"DEEPINFER_ENABLE_MTP_VARLEN": " True "}, "enable_mtp_varlen", True),
        ({"DEEPINFER_USE_NEXTN_DECODE": "3"}, "use_nextn_decode", 3),
        ({"DEEPINFER_USE_NEXTN_DECODE": "3"}, "max_backtracking_tokens", 4),  # default follows drafts
        ({"DEEPINFER_USE_NEXTN_DECODE": "0"}, "speculative", False),
        ({"DEEPINFER_MAX_BACKTRACKING_TOKENS": "9"}, "max_backtracking_tokens", 9),
        ({"DEEPINFER_BATCH_INVARIANT": "yes"}, "batch_invariant", True),
        ({"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "128"}, "yoco_prefill_keep_tokens", 128),
        ({"DEEPINFER_CUDA_GRAPHS": "0"}, "cuda_graphs", False),
        ({"DEEPINFER_FUSE_GLUE": "1"}, "fuse_glue", True),
        ({"DEEPINFER_FUSED_ATTENTION": "on"}, "fused_attention", True),
        ({"DEEPINFER_FUSED_MOE": "1"}, "fused_moe", True),
        ({"DEEPINFER_FUSED_HEAD": "true"}, "fused_head", True),
        ({"DEEPINFER_FUSED_MOE": "0"}, "fused_moe", False),
    ],
)
def test_good_values(env: dict[str, str], field: str, value: object) -> None:
    assert getattr(Envs.from_environ(env), field) == value


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"DEEPINFER_ENABLE_MTP_VARLEN": "maybe"}, "DEEPINFER_ENABLE_MTP_VARLEN"),
        ({"DEEPINFER_USE_NEXTN_DECODE": "-1"}, "DEEPINFER_USE_NEXTN_DECODE"),
        ({"DEEPINFER_USE_NEXTN_DECODE": "99"}, "DEEPINFER_USE_NEXTN_DECODE"),
        ({"DEEPINFER_USE_NEXTN_DECODE": "five"}, "DEEPINFER_USE_NEXTN_DECODE"),
        ({"DEEPINFER_MAX_BACKTRACKING_TOKENS": "2"}, "DEEPINFER_MAX_BACKTRACKING_TOKENS"),  # < 5 drafts
        ({"DEEPINFER_MAX_BACKTRACKING_TOKENS": "1.5"}, "DEEPINFER_MAX_BACKTRACKING_TOKENS"),
        ({"DEEPINFER_BATCH_INVARIANT": "2"}, "DEEPINFER_BATCH_INVARIANT"),
        ({"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "0"}, "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"),
        ({"DEEPINFER_FUSED_ATTENTION": "sometimes"}, "DEEPINFER_FUSED_ATTENTION"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(EnvError, match=name):
        Envs.from_environ(env)


def test_direct_construction_validates() -> None:
    with pytest.raises(EnvError, match="DEEPINFER_MAX_BACKTRACKING_TOKENS"):
        Envs(use_nextn_decode=5, max_backtracking_tokens=1)


def test_tool_settings_read_at_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The three tool settings go through envs too, and are read when asked (not cached by get_envs)."""
    from deepinfer_core import envs

    monkeypatch.delenv("DEEPINFER_TL_ARCH", raising=False)
    monkeypatch.delenv("DEEPINFER_FUSE_BACKEND", raising=False)
    assert envs.tl_arch() is None and envs.fuse_backend() == "inductor" and envs.gg_configs_path({}) is None
    monkeypatch.setenv("DEEPINFER_TL_ARCH", "sm_90a")
    monkeypatch.setenv("DEEPINFER_FUSE_BACKEND", "aot_eager")
    assert envs.tl_arch() == "sm_90a" and envs.fuse_backend() == "aot_eager"
    assert envs.gg_configs_path({"DEEPINFER_GG_CONFIGS": " /tmp/gg.json "}) == "/tmp/gg.json"
    with pytest.raises(EnvError, match="DEEPINFER_TL_ARCH"):
        envs.tl_arch({"DEEPINFER_TL_ARCH": "hopper"})
