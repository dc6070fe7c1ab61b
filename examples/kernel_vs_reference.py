"""A device op checked against its reference: ``apply_token_bitmask`` (grammar masks on logits).

    python examples/kernel_vs_reference.py [--rows 64] [--vocab 129280] [--trials 5] [--quick]

Every op in ``deepinfer_kernels`` has a torch reference (the ground truth, any device) and, where it
pays, a CUDA kernel behind the same name: ``get_op(name, "reference")`` / ``get_op(name, "cuda")``. This
script checks the reference against a brute-force numpy reading of the bitmask layout (bit ``t % 32`` of
word ``t // 32`` allows token ``t``; columns past the mask are banned), on fresh random inputs with odd
vocabulary widths and row subsets; then, on a machine with CUDA and TileLang, the CUDA kernel against the
reference (bit-for-bit equal logits) and their times. Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from deepinfer_kernels import get_op, list_ops


def brute_force(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """The layout read literally, one token at a time (the independent oracle)."""
    out = logits.copy()
    words = bitmask.shape[1]
    for r in range(logits.shape[0]) if rows is None else rows:
        for t in range(logits.shape[1]):
            allowed = t < 32 * words and (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = -np.inf
    return out


def random_case(
    rng: np.random.Generator, rows: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    words = (vocab + 31) // 32 - int(rng.integers(0, 2))  # sometimes a mask narrower than the logits
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32))
    density = rng.uniform(0.01, 0.99)  # sparse to dense masks
    bits = rng.random((rows, words, 32)) < density
    # word w holds tokens 32w .. 32w + 31, token 32w + b in bit b
    packed = (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=-1).astype(np.uint32)
    bitmask = torch.from_numpy(packed.view(np.int32).copy())
    subset = (
        torch.from_numpy(np.sort(rng.choice(rows, size=int(rng.integers(1, rows + 1)), replace=False)))
        if rng.random() < 0.5
        else None
    )
    return logits, bitmask, subset


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1000, help="vocabulary width of the brute-force checks")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=None, help="default: fresh random inputs each run")
    ap.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows, vocab, trials = (4, 200, 3) if args.quick else (args.rows, args.vocab, args.trials)

    ref = get_op("apply_token_bitmask", "reference")
    bad = 0
    for _ in range(trials):
        v = int(rng.integers(vocab // 2, vocab + 1))  # odd widths too
        logits, bitmask, subset = random_case(rng, rows, v)
        want = brute_force(logits.numpy(), bitmask.numpy(), None if subset is None else subset.numpy())
        got = ref(logits.clone(), bitmask, subset).numpy()
        ok = np.array_equal(got, want)
        bad += not ok
        print(
            f"  reference vs brute force, {rows} x {v} logits, {bitmask.shape[1]} mask words, rows "
            f"{'all' if subset is None else subset.tolist()}: {'equal' if ok else 'MISMATCH'}"
        )

    has_cuda_kernel = "cuda" in list_ops().get("apply_token_bitmask", [])
    if not (torch.cuda.is_available() and has_cuda_kernel):
        why = (
            "no CUDA device"
            if not torch.cuda.is_available()
            else "no cuda kernel registered (TileLang missing?)"
        )
        print(f"  cuda kernel vs reference: skipped ({why})")
    else:
        cuda = get_op("apply_token_bitmask", "cuda")
        for r, v in ((1, 129_280), (64, 129_280), (512, 129_280)):
            logits, bitmask, subset = random_case(rng, r, v)
            logits, bitmask = logits.cuda(), bitmask.cuda()
            want = ref(logits.clone(), bitmask)
            got = cuda(logits.clone(), bitmask)
            ok = torch.equal(got, want)
            bad += not ok
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = {}
            for name, fn in (("cuda", cuda), ("reference", ref)):
                x = logits.clone()
                fn(x, bitmask)
                torch.cuda.synchronize()
                start.record()
                for _ in range(20):
                    fn(x, bitmask)
                end.record()
                torch.cuda.synchronize()
                times[name] = start.elapsed_time(end) / 20 * 1e3
            print(
                f"  cuda kernel vs reference, {r} x {v}: {'equal' if ok else 'MISMATCH'}; "
                f"{times['cuda']:.0f} us vs {times['reference']:.0f} us per call"
            )
    print("all equal" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
