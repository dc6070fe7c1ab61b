"""Checkpoint loading (shipped, random, any directory), the batched training forward against the oracle,
and the training loop for a few CPU steps."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer_core.model.checkpoint import TINY_DIR, CheckpointError, load_model
from deepinfer_core.model.config import ConfigError, tiny_config
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.model.training import batched_forward, drafter_block, drafter_loss, lm_loss
from deepinfer_core.model.weights import INDEX_FILE, WeightsError, quantize_weights_, save_weights

REPO = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("train_tiny", REPO / "scripts" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.fixture(scope="module")
def m64() -> DeepSeekV41:
    return DeepSeekV41.from_config(tiny_config(), seed=random.randrange(1 << 30), dtype=torch.float64)


def test_batched_forward_equals_the_oracle(m64: DeepSeekV41) -> None:
    # every feature on (CSA top-k, candidate pools, SWA, MoE, mHC, Engram); lengths past the window
    rng = random.Random()
    t = rng.randrange(30, 60)
    tok = torch.randint(0, 512, (3, t))
    lg, counts, caps = batched_forward(m64, tok, capture=m64.drafter.target_layers)
    total = torch.zeros_like(counts)
    for i in range(3):
        ref, c, rcaps = m64.forward_full(tok[i], capture=m64.drafter.target_layers)
        torch.testing.assert_close(lg[i], ref, rtol=0, atol=1e-10)
        for lid in m64.drafter.target_layers:
            torch.testing.assert_close(caps[lid].view(3, t, -1)[i], rcaps[lid], rtol=0, atol=1e-10)
        total += c
    assert torch.equal(counts, total)  # expert counts add up over the batch


def test_drafter_block_equals_draft_full(m64: DeepSeekV41) -> None:
    t = 40
    tok = torch.randint(0, 512, (2, t))
    _, _, caps = batched_forward(m64, tok, capture=m64.drafter.target_layers)
    rows_b, rows_q, y, hidden = drafter_block(m64, tok, caps)
    dr = m64.drafter
    for r in random.sample(range(len(y)), 4):
        b, q = int(rows_b[r]), int(rows_q[r])
        want = dr.draft_full(m64, tok[b, :q], int(tok[b, q]))
        got = dr.heads(m64, hidden[r : r + 1], y[r : r + 1], torch.zeros(1, dtype=torch.float64))
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.confidence, want.confidence, rtol=0, atol=1e-10)


def test_drafter_loss_is_differentiable_and_counts_acceptance(m64: DeepSeekV41) -> None:
    tok = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        lg, _, caps = batched_forward(m64, tok, capture=m64.drafter.target_layers)
    loss, st = drafter_loss(m64, tok, lg.argmax(-1), caps)
    loss.backward()
    assert m64.drafter.markov_out.grad is not None and torch.isfinite(m64.drafter.markov_out.grad).all()
    assert 0 <= st["accepted"] <= m64.cfg.dspark_block_size and len(st["acc"]) == m64.cfg.dspark_block_size
    m64.zero_grad(set_to_none=True)


def _release_model(seed: int) -> DeepSeekV41:
    m = DeepSeekV41.from_config(tiny_config(), seed=seed)
    quantize_weights_(m)
    with torch.no_grad():
        from deepinfer_core.model.weights import _entries

        q = {e.param for e in _entries(m, True, True) if e.kind != "plain"}
        for name, p in m.named_parameters():
            if name not in q:
                p.copy_(p.to(torch.bfloat16).float())
    return m


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DeepSeekV41]:
    m = _release_model(random.randrange(1 << 30))
    d = tmp_path_factory.mktemp("ckpt")
    save_weights(m, d, dtype=torch.bfloat16, max_shard_bytes=3 << 20)  # several shards
    shutil.copy(TINY_DIR / "tokenizer.json", d / "tokenizer.json")
    return d, m


def test_round_trip_save_load_identical_logits(release_dir: tuple[Path, DeepSeekV41]) -> None:
    d, m = release_dir
    assert len(list(d.glob("model-*.safetensors"))) > 1
    got, tok = load_model(str(d))
    for (n, a), (_, b) in zip(m.named_parameters(), got.named_parameters()):
        assert torch.equal(a, b), n
    ids = torch.randint(0, 512, (37,))
    assert torch.equal(m.forward_full(ids)[0], got.forward_full(ids)[0])
    assert tok.vocab_size == 512 and tok.noise_token_id == got.cfg.dspark_noise_token_id


def test_random_model_goes_through_the_loader() -> None:
    seed = random.randrange(1 << 30)
    got, tok = load_model("tiny-random", seed=seed, dtype=torch.float64)
    want = DeepSeekV41.from_config(tiny_config(), seed=seed, dtype=torch.float64)
    for (n, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), n
    assert type(tok).__name__ == "ByteTokenizer"


def test_loader_errors(release_dir: tuple[Path, DeepSeekV41], tmp_path: Path) -> None:
    src, _ = release_dir
    with pytest.raises(CheckpointError, match="not a built-in model"):
        load_model(str(tmp_path / "nope"))

    def copy(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(src, d)
        return d

    d = copy("no_tok")
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing"):
        load_model(str(d))
    d = copy("no_shard")
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(WeightsError, match=r"model-00002-of-.*missing"):
        load_model(str(d))
    d = copy("unknown_field")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_flavour"] = "spicy"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="moe_flavour='spicy': unknown config field"):
        load_model(str(d))
    d = copy("shape")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match=r"shape .* does not match parameter"):
        load_model(str(d))
    d = copy("missing_tensor")
    idx = json.loads((d / INDEX_FILE).read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if not k.startswith("norm.")}
    (d / INDEX_FILE).write_text(json.dumps(idx))
    with pytest.raises(WeightsError, match="norm: missing from the checkpoint"):
        load_model(str(d))


def test_shipped_checkpoint_is_a_release_directory() -> None:
    files = {p.name: p.stat().st_size for p in TINY_DIR.iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(files)
    assert sum(files.values()) <= 8 << 20, files
    cfg = json.loads((TINY_DIR / "config.json").read_text())
    assert (
        cfg["compress_ratios"] == list(tiny_config().compress_ratios) and cfg["num_nextn_predict_layers"] == 2
    )
    from safetensors import safe_open

    with safe_open(str(TINY_DIR / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("layers.3.ffn.experts.5.w1.weight").dtype == torch.uint8  # MXFP4 codes
        assert f.get_tensor("layers.3.attn.wq_a.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.3.attn.wq_a.scale").dtype == torch.float8_e8m0fnu
    m, tok = load_model("tiny")
    assert m.cfg == tiny_config() and tok.vocab_size == 512
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_training_loop_cpu_steps(tmp_path: Path) -> None:
    mod = _script()
    import argparse

    rng = np.random.default_rng()
    stream = rng.integers(3, 512, 4000).astype(np.uint16)
    args = argparse.Namespace(
        steps=4,
        time_budget=None,
        lr=2e-3,
        warmup=2,
        batch=2,
        seq=24,
        seed=int(rng.integers(1 << 20)),
        device="cpu",
        drafter_steps=3,
        drafter_time_budget=None,
    )
    m = mod.init_model(args.seed, "cpu")
    tables = mod._tables(m, "cpu")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    logd: dict = {}
    mod.train_target(m, stream, args, tables, logd)
    assert logd["target"]["steps"] == 4 and logd["target"]["skipped_nonfinite"] == 0
    moved = [n for n, p in m.named_parameters() if not torch.equal(p, before[n])]
    assert "embed" in moved and not any(n.startswith("drafter.") for n in moved)
    chains = mod.greedy_chains(m, torch.from_numpy(stream[:48].astype(np.int64)).view(2, 24), 4, tables)
    assert chains.shape == (2, 28)
    target = {n: p.detach().clone() for n, p in m.named_parameters() if not n.startswith("drafter.")}
    mod.train_drafter(m, stream, chains[:, :24], args, tables, logd)
    assert logd["drafter"]["steps"] == 3
    assert not torch.equal(m.drafter.conf_w, before["drafter.conf_w"])
    assert all(torch.equal(p, target[n]) for n, p in m.named_parameters() if n in target)  # target frozen


def test_training_overfits_one_batch() -> None:
    # the differentiable forward really trains: one fixed batch, loss falls
    torch.manual_seed(random.randrange(1 << 30))
    m = _script().init_model(random.randrange(1 << 20), "cpu")
    x = torch.randint(3, 512, (2, 20))
    params = [p for n, p in m.named_parameters() if not n.startswith("drafter")]
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for _ in range(6):
        loss = lm_loss(batched_forward(m, x)[0], x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
