"""Torch reference of ``moe_grouped_gemm``: the MoE's expert products over expert-sorted rows.

- ``x`` [R, K]: the rows (token, expert) pairs sorted by expert;
- ``w`` [E, N, K]: one weight matrix per expert (out_features x in_features, as ``nn.Linear`` keeps it);
- ``offs`` int32 [E]: the end offset of each expert's rows (ascending; expert e owns rows
  ``offs[e - 1] .. offs[e]``, expert 0 from 0), ``torch._grouped_mm``'s convention.

Returns [R, N] in x's dtype: row r of expert e is ``x[r] @ w[e].T`` (float32 accumulation); rows at or past
``offs[-1]`` are 0.

Also here, host-side and importable without a device (the cuda package is not): the cuda kernel's launch
configurations, :class:`GGConfig`, the table :data:`CONFIGS` per shape and the sweep's :data:`CANDIDATES`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer_kernels.registry import register


def check_grouped_gemm_inputs(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor
) -> tuple[int, int, int, int]:
    if x.dim() != 2:
        raise ValueError(f"x: must be [rows, in_features], got shape {tuple(x.shape)}")
    if w.dim() != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"w: must be [experts, out_features, {x.shape[1]}], got {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"w: dtype {w.dtype} must equal x's {x.dtype}")
    if offs.dim() != 1 or offs.shape[0] != w.shape[0] or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"offs: must be int32 [{w.shape[0]}] (each expert's end row), got {offs.dtype} {tuple(offs.shape)}"
        )
    return x.shape[0], x.shape[1], w.shape[0], w.shape[1]


@register("moe_grouped_gemm")
def moe_grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    r, _, e, n = check_grouped_gemm_inputs(x, w, offs)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = torch.arange(r, device=x.device)
    ends = offs.to(device=x.device, dtype=torch.long)
    expert = torch.searchsorted(ends, rows, right=True)  # rows past the last end get expert e (none)
    out = torch.zeros(r, n, dtype=acc, device=x.device)
    for j in range(e):  # a loop over experts, each one masked product (the reference: no host reads)
        sel = (expert == j).to(acc)[:, None]
        out += sel * (x.to(acc) @ w[j].to(acc).t())
    return out.to(x.dtype)


# --- launch configurations of the cuda kernel (cuda/grouped_gemm.py) ---

GG_BM = 64  # rows a tile: one wgmma M; an expert's rows at B = 64 never exceed it
_SMEM_BYTES = 227 * 1024  # H200 shared memory a CTA may use
_SM_SMEM = 228 * 1024  # an SM's, of which each resident CTA takes 1 KB for the system


class GGConfig(NamedTuple):
    """One launch configuration of the cuda kernel (see ``cuda/grouped_gemm``'s launch contract)."""

    bn: int = 128  # output columns a CTA (one weight slab of bn x K)
    bk: int = 64  # K block a pipeline stage (64 bf16 = one 128-byte swizzle row)
    stages: int = 3  # pipeline depth (weight + x blocks in flight a CTA)
    threads: int = 128  # consumer threads (one warpgroup per 64 x (bn / warpgroups) of the tile)
    min_blocks: int = 1  # CTAs an SM the registers are capped for (__launch_bounds__)
    ws: bool = True  # TileLang's warp specialisation (a 128-thread producer warpgroup issues the TMA loads)

    def smem_bytes(self, elem: int = 2) -> int:
        """Dynamic shared memory a CTA: ``stages`` x (x block + weight block)."""
        return self.stages * (GG_BM + self.bn) * self.bk * elem

    def valid(self) -> bool:
        """Whether the config can lower: wgmma tiles (bn / warpgroups a multiple of 8, at most 256),
        shared memory for ``min_blocks`` CTAs an SM, and at that occupancy registers enough a thread for
        its share of the accumulator (an estimate; ``scripts/tl_compile.py --grouped-sweep`` checks)."""
        wg = self.threads // 128
        total = self.threads + (128 if self.ws else 0)
        if self.threads % 128 or wg < 1 or self.bn % (8 * wg) or self.bn // wg > 256 or self.bk % 16:
            return False
        if (
            self.stages < 1
            or self.smem_bytes() > _SMEM_BYTES
            or (self.smem_bytes() + 1024) * self.min_blocks > _SM_SMEM
        ):
            return False
        # a 64 x (bn / wg) wgmma accumulator needs bn / wg / 2 registers a thread, plus ~26 (ptxas refused
        # 80 for bn 128 with one consumer warpgroup)
        return 65536 // (self.min_blocks * total) >= self.bn // wg // 2 + 26

    def takes(self, n: int, k: int) -> bool:
        return n % self.bn == 0 and k % self.bk == 0

    def name(self) -> str:
        return f"bn{self.bn}_bk{self.bk}_s{self.stages}_t{self.threads}_mb{self.min_blocks}" + (
            "" if self.ws else "_nows"
        )

    def pass_configs(self) -> dict[str, bool]:
        return {} if self.ws else {"tl.disable_warp_specialized": True}


DEFAULT = GGConfig()  # the configuration the H200 ran on 2026-12-01 (1.40 ms / 4.72 GB a wide step)
# (E, N, K) -> configuration, from the H200 sweep (benchmarks/grouped_gemm.py prints the best per shape):
# the wide config's gate / up packed, down, and the LM head as one group. The sweep of 2026-12-03 (main
# 4d8aa00, 384 rows of 64 tokens x top-6 of 8; B = 64 for the head) against the default and
# torch._grouped_mm: gate / up 97.6 us (default 116.6, torch 152.3), down 54.0 us (59.3, 73.8), head
# 322.7 us (327.5, 436.8); all three without warp specialisation.
# Since 2026-12-04 the MoE's decode calls are E = 9 (the 8 routed experts and the shared expert as one
# more group, ``moe.FUSE_SHARED``): their entries are the E = 8 sweep's configurations, not re-swept
# (per CTA the same work; the grid's 324 / 720 CTAs still all resident at 4 / 6 CTAs an SM).
CONFIGS: dict[tuple[int, int, int], GGConfig] = {
    (8, 4608, 5120): GGConfig(128, 64, 2, 128, 4, False),
    (8, 5120, 2304): GGConfig(64, 64, 2, 128, 6, False),
    (9, 4608, 5120): GGConfig(128, 64, 2, 128, 4, False),
    (9, 5120, 2304): GGConfig(64, 64, 2, 128, 6, False),
    (1, 129280, 5120): GGConfig(128, 128, 2, 128, 2, False),
}

# The sweep's candidates (benchmarks/grouped_gemm.py; scripts/tl_compile.py --grouped-sweep checks their
# registers), CTAs an SM as registers and shared memory allow, against the wide shapes' CTA counts (bn
# 128: 288 gate / up, 320 down, 1010 head; bn 64 twice, bn 256 half that):
# - the default: 2 an SM (92 registers x 256 threads), 264 slots: a second wave for gate / up and down;
# - without warp specialisation (no producer warpgroup; cp.async pipelines) 140 registers x 128 threads:
#   3 an SM at 72 KB (all of gate / up's and down's CTAs resident), 4 at 48 KB if capped to 128;
# - bn 64: 5 or 6 an SM at 32 KB (660 / 792 slots), or warp-specialised 4 an SM at 48 KB (528);
# - bn 256, two consumer warpgroups: half the x re-reads from L2, 2 an SM (264 slots for 144 / 160);
# - more bytes in flight a CTA: a fourth stage (without warp specialisation, 96 KB: 2 an SM); bk 32 with
#   6 stages (3 an SM); bk 128 (256 contiguous bytes a weight row and load; 96 KB: 2 an SM).
# ptxas (sm_90a, scripts/tl_compile.py --grouped-sweep): none of these spills. Dropped: warp-specialised bn
# 128 at 3 an SM (ptxas needs 90 registers for its wgmma, 80 allowed), and the warp-specialised 96 KB
# configs (4 stages, or bk 128 with 2): 149-152 registers, so 1 CTA an SM, and capped at 128 for 2 an SM
# they spill 156-172 bytes.
CANDIDATES: tuple[GGConfig, ...] = (
    DEFAULT,
    GGConfig(128, 64, 3, 128, 3, False),
    GGConfig(128, 64, 2, 128, 4, False),
    GGConfig(128, 32, 6, 128, 3, False),
    GGConfig(64, 64, 2, 128, 5, False),
    GGConfig(64, 64, 3, 128, 4, True),
    GGConfig(64, 64, 4, 128, 3, False),
    GGConfig(256, 64, 2, 256, 2, False),
    GGConfig(256, 32, 4, 256, 2, False),
    GGConfig(64, 64, 2, 128, 6, False),
    GGConfig(128, 64, 4, 128, 2, False),
    GGConfig(128, 128, 2, 128, 2, False),
)

# the wide config's (E, N, K) at B = 64 with their rows (benchmarks/grouped_gemm.py, tl_compile.py): the
# experts' gate / up and down with the shared expert's group (E = 8 + 1), the LM head as one group
SWEEP_SHAPES: tuple[tuple[int, int, int], ...] = ((9, 4608, 5120), (9, 5120, 2304), (1, 129280, 5120))


def load_configs(path: str) -> dict[tuple[int, int, int], GGConfig]:
    """A tuned table from a JSON file (``benchmarks/grouped_gemm.py --write``: a list of ``{"shape": [E, N,
    K], "config": {GGConfig's fields}}``), as vLLM keeps tuned MoE configurations per device. Each entry
    is checked (:meth:`GGConfig.valid`; unknown fields or a bad shape raise ``ValueError`` naming the
    entry), so a stale or hand-edited file fails at load, not inside a kernel launch."""
    import json

    with open(path) as fh:
        rows = json.load(fh)
    if not isinstance(rows, list):
        raise ValueError(f"{path}: must be a JSON list of {{'shape': [E, N, K], 'config': {{...}}}}")
    out: dict[tuple[int, int, int], GGConfig] = {}
    for i, row in enumerate(rows):
        try:
            shape = tuple(int(v) for v in row["shape"])
            cfg = GGConfig(**row["config"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{path} entry {i}: {e!r} (need 'shape': [E, N, K] and 'config' with fields "
                f"{', '.join(GGConfig._fields)})"
            ) from None
        if len(shape) != 3 or min(shape) < 1 or not cfg.valid():
            raise ValueError(f"{path} entry {i}: shape {shape} / config {cfg} is not a valid launch")
        out[shape] = cfg
    return out


_LOADED: list[bool] = [False]


def _tuned() -> dict[tuple[int, int, int], GGConfig]:
    """:data:`CONFIGS`, updated once from the file named by ``DEEPINFER_GG_CONFIGS`` if set."""
    if not _LOADED[0]:
        from deepinfer_core.envs import gg_configs_path

        _LOADED[0] = True
        if path := gg_configs_path():
            CONFIGS.update(load_configs(path))
    return CONFIGS


def config_for(e: int, n: int, k: int) -> GGConfig | None:
    """The configuration for this shape: the table's (``DEEPINFER_GG_CONFIGS`` entries first), else the
    entry of the same weight shape [N, K] with the nearest group count E (the MoE's shared expert run as
    one more group is E + 1: each CTA does the same work, the grid has one more column of CTAs), else the
    default; None if none of them tiles it."""
    table = _tuned()
    c = table.get((e, n, k))
    if c is None:
        near = sorted((abs(key[0] - e), key[0]) for key in table if key[1:] == (n, k))
        c = table[(near[0][1], n, k)] if near else DEFAULT
    if c.takes(n, k):
        return c
    return DEFAULT if DEFAULT.takes(n, k) else None
