"""Train the shipped tiny V4.1 checkpoint (target + DSpark drafter) on text every machine has.

Corpus: the Python standard library's sources (the running interpreter's lib dir, no tests, no
site-packages) and this project's docs/*.md. Files are split by a hash of their path: 1 in 32 is held out
(never trained on) and used for the bits-per-byte evaluation beside ``xz -9`` on the same bytes.

    python scripts/train_tiny.py prepare --data .gpu/tiny_data.npz      # tokenizer + token streams (CPU)
    python scripts/train_tiny.py train --data .gpu/tiny_data.npz --out DIR [--device cuda] [--steps N]

``prepare`` trains the byte-level BPE (``tokenizers``, vocab = the config's 512, V4.1 control tokens) and
writes ``tokenizer.json`` next to the token streams. ``train`` trains the target (AdamW, cosine schedule,
aux-loss-free expert balancing), rounds it to the release quantisation (FP8 dense, MXFP4 experts, bf16
rest), generates greedy continuations with it, trains the drafter + confidence head on the target's own
greedy predictions (the target frozen), rounds the drafter, evaluates and writes the release directory
(config.json, safetensors, tokenizer.json) plus ``train_log.json``. Reproducible from ``--seed`` for a
given step count (``--max-seconds`` only cuts a run short, and the log says where).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import lzma
import math
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

try:
    from deepinfer_core import _C  # noqa: F401
except ImportError:  # a bare GPU machine: training touches no C++ component (pools, scheduler), so the
    import sys  # kv package only needs the name to import
    import types

    import deepinfer_core

    sys.modules["deepinfer_core._C"] = deepinfer_core._C = types.ModuleType("deepinfer_core._C")  # type: ignore[attr-defined]

from deepinfer_core.model import DeepSeekV41, tiny_config
from deepinfer_core.model.training import (
    balance_experts_,
    batched_forward,
    drafter_block,
    drafter_loss,
    engram_rows_batched,
    lm_loss,
)
from deepinfer_core.model.weights import quantize_weights_, save_weights
from deepinfer_core.tokenizer import V41Tokenizer, train_bpe

log = logging.getLogger("train_tiny")
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- corpus
def corpus_files() -> list[tuple[str, str]]:
    """(name, text) of every corpus file, sorted by name."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(lib.rglob("*.py")):
        rel = p.relative_to(lib).as_posix()
        parts = set(rel.split("/"))
        if parts & {"site-packages", "test", "tests", "idle_test", "__pycache__"}:
            continue
        try:
            out.append((f"stdlib/{rel}", p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    for p in sorted((REPO / "docs").glob("*.md")):
        out.append((f"docs/{p.name}", p.read_text(encoding="utf-8")))
    return out


def held_out(name: str) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 32 == 0


def prepare(data: Path, vocab_size: int) -> None:
    files = corpus_files()
    train = [t for n, t in files if not held_out(n)]
    test = [(n, t) for n, t in files if held_out(n)]
    log.info(
        "corpus: %d files (%.1f MB), %d held out (%.2f MB)",
        len(files),
        sum(len(t) for _, t in files) / 1e6,
        len(test),
        sum(len(t) for _, t in test) / 1e6,
    )
    tok = train_bpe(train, vocab_size)
    data.parent.mkdir(parents=True, exist_ok=True)
    tpath = data.with_name("tokenizer.json")
    tok.save(str(tpath))
    vt = V41Tokenizer(tok)
    eos = vt.eos_token_id

    def stream(texts: list[str]) -> np.ndarray:
        ids: list[int] = []
        for t in tqdm(texts, desc="tokenize", unit="file"):
            ids += [*vt.encode(t), eos]
        return np.asarray(ids, np.uint16)

    tr, te = stream(train), stream([t for _, t in test])
    nbytes = sum(len(t.encode()) for _, t in test)
    np.savez(
        data,
        train=tr,
        heldout=te,
        heldout_bytes=np.int64(nbytes),
        heldout_names=np.asarray([n for n, _ in test]),
    )
    log.info(
        "tokens: train %d, held out %d (%.3f bytes/token); wrote %s and %s",
        len(tr),
        len(te),
        nbytes / len(te),
        data,
        tpath,
    )


def xz_bits_per_byte(data: Path) -> float:
    files = dict(corpus_files())
    names = [str(n) for n in np.load(data)["heldout_names"]]
    raw = b"".join(files[n].encode() for n in names)
    return 8 * len(lzma.compress(raw, preset=9)) / len(raw)


# ---------------------------------------------------------------- training
def _batches(stream: np.ndarray, batch: int, seq: int, gen: torch.Generator, device: str):
    n = len(stream) - seq - 1
    s = torch.from_numpy(stream.astype(np.int64))
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen)
        yield torch.stack([s[i : i + seq] for i in starts.tolist()]).to(device)


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1))))


_CALIBRATION_STEPS = 10


def _calibrate(step: int, steps: int, t0: float, budget: float | None, what: str) -> int:
    """With a time budget, fix the step count after the first steps' timing (inside the warm-up, so a
    rerun with ``--steps`` = the logged count reproduces the run)."""
    if budget is None or step != _CALIBRATION_STEPS:
        return steps
    per = (time.time() - t0) / step
    n = max(step + 1, int(budget / per))
    log.info("%s: %.3f s/step -> %d steps in %.0f s", what, per, n, budget)
    return n


def _trim() -> None:
    """Give freed heap back to the OS: on CPU, autograd's many odd-sized buffers fragment glibc's heap
    and the resident size grows ~45 MB a step without this (measured), until the machine swaps."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


try:
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _LIBC = None


def _finite_step(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Clip and step, unless the gradient is not finite (the GPU run of 2026-12-01 went NaN at step
    ~340 without this guard: one bad batch poisons every weight through Adam)."""
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    if not torch.isfinite(norm):
        opt.zero_grad(set_to_none=True)
        return False
    opt.step()
    return True


def init_model(seed: int, device: str) -> DeepSeekV41:
    """The tiny config with the library's seeded init, norms reset to 1 and residual outputs scaled down
    (a deep stack trains more stably when each sublayer starts as a small update)."""
    m = DeepSeekV41.from_config(tiny_config(), seed=seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            if name.endswith(("attn.wo_b", "ffn.w2", "ffn.s_w2")):
                p.mul_(1 / math.sqrt(2 * m.cfg.num_hidden_layers))
    return m.to(device)


def train_target(
    m: DeepSeekV41, train: np.ndarray, args: argparse.Namespace, tables: dict, logd: dict
) -> None:
    params = [
        p for n, p in m.named_parameters() if not n.startswith("drafter") and not n.endswith("gate_bias")
    ]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    it = _batches(train, args.batch, args.seq, gen, args.device)
    t0 = time.time()
    steps = args.steps
    bar = tqdm(total=steps, desc="target", unit="step")
    hist = []
    step = skipped = 0
    while step < steps:
        steps = _calibrate(step, steps, t0, args.time_budget, "target")
        bar.total = steps
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, args.lr, args.warmup)
        x = next(it)
        logits, counts, _ = batched_forward(m, x, engram_rows=engram_rows_batched(m, x, tables))
        loss = lm_loss(logits, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if _finite_step(opt, params):
            balance_experts_(m, counts)
        else:
            skipped += 1
        if args.device == "cpu":
            _trim()
        if step % 25 == 0 or step == steps - 1:
            hist.append((step, loss.item()))
            bar.set_postfix(loss=f"{loss.item():.3f}")
        step += 1
        bar.update(1)
    bar.close()
    logd["target"] = {"steps": steps, "skipped_nonfinite": skipped, "seconds": time.time() - t0, "loss": hist}


@torch.no_grad()
def greedy_chains(m: DeepSeekV41, prompts: torch.Tensor, new: int, tables: dict) -> torch.Tensor:
    """Greedy continuations [P, L0 + new] by full recompute (exactly the target's argmax chain)."""
    x = prompts
    for _ in tqdm(range(new), desc="greedy chains", unit="tok"):
        lg, _, _ = batched_forward(m, x, engram_rows=engram_rows_batched(m, x, tables))
        x = torch.cat((x, lg[:, -1].argmax(-1, keepdim=True)), 1)
    return x


def train_drafter(
    m: DeepSeekV41,
    train: np.ndarray,
    chains: torch.Tensor,
    args: argparse.Namespace,
    tables: dict,
    logd: dict,
) -> None:
    for p in m.parameters():
        p.requires_grad_(False)
    params = list(m.drafter.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    it = _batches(train, args.batch, args.seq, gen, args.device)
    t0 = time.time()
    hist = []
    steps = args.drafter_steps
    bar = tqdm(total=steps, desc="drafter", unit="step")
    step = skipped = 0
    while step < steps:
        steps = _calibrate(step, steps, t0, args.drafter_time_budget, "drafter")
        bar.total = steps
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, args.lr, args.warmup // 2)
        if step % 2:  # half the batches are the target's own greedy chains: what the engine drafts on
            x = chains[torch.randint(0, chains.shape[0], (args.batch,), generator=gen)].to(args.device)
        else:
            x = next(it)
        with torch.no_grad():
            lg, _, caps = batched_forward(
                m, x, capture=m.drafter.target_layers, engram_rows=engram_rows_batched(m, x, tables)
            )
            nxt = lg.argmax(-1)
        loss, st = drafter_loss(m, x, nxt, caps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        skipped += not _finite_step(opt, params)
        if args.device == "cpu":
            _trim()
        if step % 25 == 0 or step == steps - 1:
            hist.append((step, st))
            bar.set_postfix(ce=f"{st['ce']:.3f}", acc_len=f"{st['accepted']:.2f}")
        step += 1
        bar.update(1)
    bar.close()
    for p in m.parameters():
        p.requires_grad_(False)
    logd["drafter"] = {
        "steps": steps,
        "skipped_nonfinite": skipped,
        "seconds": time.time() - t0,
        "stats": hist,
    }


# ---------------------------------------------------------------- evaluation
@torch.no_grad()
def bits_per_byte(
    m: DeepSeekV41,
    stream: np.ndarray,
    nbytes: int,
    seq: int,
    device: str,
    tables: dict,
    limit_tokens: int | None = None,
) -> float:
    """Every token but the first predicted once (chunks of ``seq`` overlapping by one), in bits per byte of
    the held-out text; the first token costs log2(vocab) bits."""
    s = torch.from_numpy(stream.astype(np.int64))
    if limit_tokens is not None and len(s) > limit_tokens:
        nbytes = int(nbytes * limit_tokens / len(s))  # proportional share (only for quick CPU runs)
        s = s[:limit_tokens]
    nats = math.log(m.cfg.vocab_size)
    starts = list(range(0, len(s) - 1, seq - 1))
    for i in range(0, len(starts), 32):
        chunk = [s[c : c + seq] for c in starts[i : i + 32]]
        ln = min(len(c) for c in chunk)
        full = [c for c in chunk if len(c) == ln]
        rest = [c for c in chunk if len(c) != ln]
        for group in (full, *([c] for c in rest)):
            if not group or len(group[0]) < 2:
                continue
            x = torch.stack(group).to(device)
            lg, _, _ = batched_forward(m, x, engram_rows=engram_rows_batched(m, x, tables))
            nats += float(
                torch.nn.functional.cross_entropy(
                    lg[:, :-1].reshape(-1, lg.shape[-1]).float(), x[:, 1:].reshape(-1), reduction="sum"
                )
            )
    return nats / math.log(2) / nbytes


@torch.no_grad()
def draft_eval(m: DeepSeekV41, chains: torch.Tensor, prompt_len: int, tables: dict) -> dict:
    """Greedy drafts at every anchor of the generated part of held-out chains, scored against the chain
    (the target's own greedy tokens): accepted drafts per verify (5 drafts) and the reliability table."""
    dr = m.drafter
    lg, _, caps = batched_forward(
        m, chains, capture=dr.target_layers, engram_rows=engram_rows_batched(m, chains, tables)
    )
    rows_b, rows_q, y, hidden = drafter_block(m, chains, caps)
    keep = rows_q >= prompt_len
    rows_b, rows_q, y, hidden = rows_b[keep], rows_q[keep], y[keep], hidden[keep]
    res = dr.heads(m, hidden, y, torch.zeros(y.shape[0], dtype=hidden.dtype, device=y.device))
    blk = dr.block
    labels = lg.argmax(-1)[rows_b[:, None], rows_q[:, None] + torch.arange(blk, device=y.device)[None, :]]
    right = (res.tokens == labels).long()
    acc_prefix = torch.cumprod(right, 1)
    earlier = torch.cat((torch.ones_like(right[:, :1]), acc_prefix[:, :-1]), 1).bool()
    table = []
    for k in range(blk):
        e = earlier[:, k]
        table.append(
            {
                "draft": k + 1,
                "rows": int(e.sum()),
                "predicted": float(res.confidence[e, k].mean()),
                "observed": float(right[e, k].float().mean()),
            }
        )
    conf = res.confidence[earlier]
    obs = right[earlier].float()
    bins = []
    for lo in np.linspace(0, 0.9, 10):
        sel = (conf >= lo) & (conf < lo + 0.1 + (1e-9 if lo >= 0.9 else 0))
        if sel.any():
            bins.append(
                {
                    "bin": f"{lo:.1f}-{lo + 0.1:.1f}",
                    "rows": int(sel.sum()),
                    "predicted": float(conf[sel].mean()),
                    "observed": float(obs[sel].mean()),
                }
            )
    return {
        "anchors": int(y.shape[0]),
        "accepted_per_verify": float(acc_prefix.sum(1).float().mean()),
        "tokens_per_verify": 1 + float(acc_prefix.sum(1).float().mean()),
        "per_position": table,
        "bins": bins,
    }


def _tables(m: DeepSeekV41, device: str) -> dict:
    return {lid: t.data.to(device).float() for lid, t in m.engram_tables.items()}


def round_release_(m: DeepSeekV41) -> None:
    """FP8 / MXFP4 rounding of what the checkpoint stores quantised, bf16 rounding of the rest (what
    ``save_weights(dtype=bfloat16)`` writes), so the checkpoint reloads to exactly this model."""
    from deepinfer_core.model.weights import _entries

    quantize_weights_(m)
    quantised = {e.param for e in _entries(m, True, True) if e.kind != "plain"}
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name not in quantised:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))


def single_file_(out: Path) -> None:
    """One shard: store it as ``model.safetensors`` without the index (the usual single-file release
    layout; the index alone is 48 KB of the 8 MiB budget)."""
    from deepinfer_core.model.weights import INDEX_FILE

    shards = sorted(out.glob("model-*-of-*.safetensors"))
    if len(shards) == 1:
        shards[0].rename(out / "model.safetensors")
        (out / INDEX_FILE).unlink()


def train(args: argparse.Namespace) -> None:
    t_start = time.time()
    torch.manual_seed(args.seed)
    if args.device == "cpu":
        torch.set_num_threads(
            args.threads
        )  # the tiny model is dispatch-bound: one thread is fastest on a shared CPU
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    d = np.load(args.data)
    train_s, held, nbytes = d["train"], d["heldout"], int(d["heldout_bytes"])
    out = Path(args.out)
    logd: dict = {
        "args": vars(args),
        "train_tokens": len(train_s),
        "heldout_tokens": len(held),
        "heldout_bytes": nbytes,
    }
    if args.init is not None:  # continue from a checkpoint (e.g. more drafter steps with --steps 0)
        from deepinfer_core.model.checkpoint import load_model

        m = load_model(str(args.init), device=args.device)[0]
        prev = args.init / "train_log.json"
        if prev.is_file():
            logd["init_log"] = json.loads(prev.read_text())
    else:
        m = init_model(args.seed, args.device)
    tables = _tables(m, args.device)
    if args.steps > 0:
        train_target(m, train_s, args, tables, logd)
        lim = args.eval_tokens
        if args.eval_float:
            logd["bpb_float"] = bits_per_byte(m, held, nbytes, args.seq, args.device, tables, lim)
        round_release_(m)
        logd["bpb_release"] = bits_per_byte(m, held, nbytes, args.seq, args.device, tables, lim)
        log.info(
            "held-out bits/byte: %s (float) %.4f (release rounding)",
            logd.get("bpb_float"),
            logd["bpb_release"],
        )
    if args.backup is not None:
        save_weights(m, args.backup, dtype=torch.bfloat16, max_shard_bytes=64 << 20)
    g = torch.Generator().manual_seed(args.seed + 2)
    s = torch.from_numpy(train_s.astype(np.int64))
    starts = torch.randint(0, len(s) - args.chain_prompt, (args.chains,), generator=g).tolist()
    prompts = torch.stack([s[i : i + args.chain_prompt] for i in starts]).to(args.device)
    chains = greedy_chains(m, prompts, args.seq - args.chain_prompt, tables)
    train_drafter(m, train_s, chains, args, tables, logd)
    round_release_(m)
    save_weights(m, out, dtype=torch.bfloat16, max_shard_bytes=64 << 20)  # before the evaluation: keep it
    single_file_(out)
    shutil.copy(Path(args.data).with_name("tokenizer.json"), out / "tokenizer.json")
    try:
        h = torch.from_numpy(held.astype(np.int64))
        hs = torch.randint(0, len(h) - args.chain_prompt, (args.eval_chains,), generator=g).tolist()
        hp = torch.stack([h[i : i + args.chain_prompt] for i in hs]).to(args.device)
        logd["draft_eval"] = draft_eval(
            m, greedy_chains(m, hp, args.eval_new, tables), args.chain_prompt, tables
        )
        log.info(
            "drafts on held-out greedy chains: %.3f accepted per verify",
            logd["draft_eval"]["accepted_per_verify"],
        )
    except Exception as e:  # the checkpoint is written; the log says what failed
        log.exception("draft evaluation failed")
        logd["draft_eval_error"] = repr(e)
    logd["seconds"] = time.time() - t_start
    logd["bytes"] = sum(f.stat().st_size for f in out.iterdir())
    (out / "train_log.json").write_text(json.dumps(logd, indent=1, default=str))
    log.info("wrote %s (%d bytes)", out, logd["bytes"])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--data", type=Path, default=REPO / ".gpu" / "tiny_data.npz")
    p.add_argument("--vocab-size", type=int, default=tiny_config().vocab_size)
    x = sub.add_parser("xz")
    x.add_argument("--data", type=Path, default=REPO / ".gpu" / "tiny_data.npz")
    t = sub.add_parser("train")
    t.add_argument("--data", type=Path, default=REPO / ".gpu" / "tiny_data.npz")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--drafter-steps", type=int, default=600)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--chains", type=int, default=256)
    t.add_argument("--chain-prompt", type=int, default=64)
    t.add_argument("--eval-chains", type=int, default=64)
    t.add_argument("--eval-new", type=int, default=96)
    t.add_argument(
        "--eval-tokens", type=int, default=None, help="cap on held-out tokens evaluated (CPU runs)"
    )
    t.add_argument(
        "--eval-float",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also evaluate before the release rounding",
    )
    t.add_argument(
        "--time-budget", type=float, default=None, help="seconds for the target phase (sets --steps)"
    )
    t.add_argument("--drafter-time-budget", type=float, default=None)
    t.add_argument("--init", type=Path, default=None, help="start from this checkpoint directory")
    t.add_argument(
        "--backup",
        type=Path,
        default=None,
        help="also write the rounded target here before the drafter phase",
    )
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.data, args.vocab_size)
    elif args.cmd == "xz":
        print(json.dumps({"xz9_bits_per_byte": xz_bits_per_byte(args.data)}))
    else:
        train(args)


if __name__ == "__main__":
    main()
