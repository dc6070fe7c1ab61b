"""The bounded-replay planner: after a prefix hit, which tokens run through which layers, with which masks.

Plain data, no torch: another engine can take a :class:`ReplayPlan` and run it on its own kernels.

The model (v41_flash.md) has a causal encoder-decoder split: layers ``[0, E)`` are the encoder,
``[E, L)`` the decoder, whose global (compressed) KV comes from the hidden state entering layer ``E``.
Every layer also has a sliding-window (SWA) KV of ``w`` tokens that lives in a per-sequence ring, not
in the shared blocks. A prefix hit of ``h`` tokens therefore reuses the block KV but not the rings:

1. **Encoder SWA** at position ``hit``: restored from the host-memory copy when one exists (exact),
   else recomputed by an *encoder replay* of the last tokens of the hit through layers ``[0, E)``,
   each query's window truncated to the replayed span (``w`` tokens: approximate; the exact span
   ``E * (w - 1)``: exact). A replay writes only the rings, never the shared blocks.
2. **Encoder-only prefill** of the new tokens ``[hit, tail_start)``: encoder layers plus the layer-E
   source write (the decoder's global KV), no decoder work: this is what "nearly halves prefill".
3. **Tail** ``[tail_start, n)``: every layer; decoder layers attend only to SWA keys at positions
   ``>= tail_start`` (the decoder rings hold nothing before). With ``keep`` tokens this is DeepInfer's
   bounded replay: approximate, a cost independent of the context. The decoder state it leaves is
   used for decoding only; nothing of it is persisted.

Exactness: a decoder layer ``E + j``'s output at ``p`` depends on its SWA keys at ``[p - w + 1, p]``,
each a function of layer ``E + j - 1``'s output there, so truncating at ``a`` leaves layer ``E + j``'s
output exact for ``p >= a + (j + 1)(w - 1)``. The last logits (``p = n - 1``) of ``D = L - E`` decoder
layers are exact once the tail holds ``D (w - 1) + 1`` tokens (``20 * 127 + 1 = 2,541`` at the
released shape: the seeds' "2,560 tokens through 20 decoder layers"); a later rollback of ``d``
pending drafts needs ``d`` more. The same argument over the encoder gives its exact replay span.

The hit is trimmed (never extended): to a multiple of ``align`` (whole blocks, whole compression
groups, so no partial compressor group has to be rebuilt), and to at most ``n - tail`` so the tail is
made of new tokens (their block KV is written to private blocks; shared blocks are only read).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

BOUNDED = "bounded"
EXACT = "exact"
MODES = (BOUNDED, EXACT)

# step kinds
ENCODER_RESTORE = "encoder_restore"  # copy the persisted encoder SWA rings in (no compute)
ENCODER_REPLAY = "encoder_replay"  # recompute encoder rings over the last tokens of the hit (rings only)
ENCODER_PREFILL = "encoder_prefill"  # new tokens through the encoder + layer-E source write
TAIL = "tail"  # new tokens through every layer, decoder windows truncated at the tail's start
PREFILL = "prefill"  # no usable hit: an ordinary full prefill


def _err(field: str, msg: str) -> ValueError:
    return ValueError(f"{field}: {msg}")


def _int(field: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < lo:
        raise _err(field, f"{v!r}: must be an int >= {lo}")
    return int(v)


@attrs.frozen(kw_only=True)
class ReplayConfig:
    """Model shape and policy. ``keep``: tail tokens in bounded mode (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS,
    140 in the release: window plus speculative backtracking); ``encoder_replay``: tokens recomputed for
    the encoder when no host copy exists (None: ``window``, the issue's "last w tokens"). ``block_size``:
    hit granularity (the KV pool's block). ``compress_ratios`` per layer (0 = SWA only)."""

    window: int
    num_layers: int
    encoder_layers: int
    keep: int
    compress_ratios: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(x) for x in v), default=())
    block_size: int = 1
    mode: str = BOUNDED
    encoder_replay: int | None = None

    def __attrs_post_init__(self) -> None:
        _int("ReplayConfig.window", self.window, 1)
        _int("ReplayConfig.num_layers", self.num_layers, 1)
        e = _int("ReplayConfig.encoder_layers", self.encoder_layers, 1)
        if e > self.num_layers:
            raise _err("ReplayConfig.encoder_layers", f"{e}: must be <= num_layers={self.num_layers}")
        _int("ReplayConfig.keep", self.keep, 1)
        _int("ReplayConfig.block_size", self.block_size, 1)
        if self.mode not in MODES:
            raise _err("ReplayConfig.mode", f"{self.mode!r}: must be one of {list(MODES)}")
        if self.encoder_replay is not None:
            _int("ReplayConfig.encoder_replay", self.encoder_replay, 1)
        if self.compress_ratios and len(self.compress_ratios) < self.num_layers:
            raise _err(
                "ReplayConfig.compress_ratios",
                f"{len(self.compress_ratios)} values, need num_layers={self.num_layers}",
            )
        if any(r < 0 for r in self.compress_ratios):
            raise _err("ReplayConfig.compress_ratios", "values must be >= 0")

    @classmethod
    def from_model(
        cls,
        cfg: Any,  # duck-typed ModelConfig: no model import here
        keep: int,
        block_size: int = 1,
        mode: str = BOUNDED,
        encoder_replay: int | None = None,
    ) -> ReplayConfig:
        """From a ``deepinfer_core.model.ModelConfig`` (duck-typed: no model import here)."""
        n = int(cfg.num_hidden_layers)
        return cls(
            window=int(cfg.sliding_window),
            num_layers=n,
            encoder_layers=int(cfg.encoder_layers),
            keep=keep,
            compress_ratios=tuple(cfg.compress_ratios[:n]),
            block_size=block_size,
            mode=mode,
            encoder_replay=encoder_replay,
        )

    @property
    def decoder_layers(self) -> int:
        return self.num_layers - self.encoder_layers

    @property
    def align(self) -> int:
        """Hit granularity: whole blocks and whole compression groups of every layer."""
        a = self.block_size
        for r in self.compress_ratios[: self.num_layers]:
            if r > 1:
                a = a * r // math.gcd(a, r)
        return a

    def exact_tail(self, pending_drafts: int = 0) -> int:
        """Tail tokens that make the decoder state exact (see the module docstring)."""
        return self.decoder_layers * (self.window - 1) + 1 + pending_drafts

    def exact_encoder_replay(self) -> int:
        """Encoder replay tokens that rebuild the encoder rings at the hit exactly."""
        return self.encoder_layers * (self.window - 1)


@attrs.frozen(kw_only=True)
class ReplayStep:
    """Positions ``[start, end)`` through layers ``[layers[0], layers[1])``. Layers in
    ``[floor_layers[0], floor_layers[1])`` attend only to SWA keys at positions ``>= floor`` (the truncated
    window); the others see their normal window (keys already in their rings). ``source_layer``: a layer
    whose KV-source write (compressor only, no attention) ends the step (encoder-only steps).
    ``writes_blocks``: whether the step writes paged (block) KV; ``logits``: whether it produces the
    next-token logits (the last row)."""

    kind: str
    start: int
    end: int
    layers: tuple[int, int]
    floor: int
    floor_layers: tuple[int, int]
    source_layer: int | None
    writes_blocks: bool
    logits: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def swa_mask(self, layer: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(key positions [K], mask [num_tokens, K]): which SWA keys each query of ``layer`` sees.

        Keys span ``[max(0, start - window + 1), end)``; query at ``p`` sees ``p - w < k <= p``, and
        ``k >= floor`` when ``layer`` is a truncated one.
        """
        if not self.layers[0] <= layer < self.layers[1]:
            raise _err("layer", f"{layer}: this step runs layers [{self.layers[0]}, {self.layers[1]})")
        q = np.arange(self.start, self.end)
        k = np.arange(max(0, self.start - window + 1), self.end)
        m = (k[None, :] <= q[:, None]) & (k[None, :] > q[:, None] - window)
        if self.floor_layers[0] <= layer < self.floor_layers[1]:
            m &= k[None, :] >= self.floor
        return k, m


@attrs.frozen(kw_only=True)
class ReplayPlan:
    """What to run for one sequence of ``num_tokens`` known tokens after a hit of ``requested_hit``.

    ``hit``: tokens whose block KV is reused (trimmed, see the module docstring); ``steps`` in order.
    ``encoder_replay_tokens``: cached tokens recomputed for the encoder rings; ``decoder_replay_tokens``:
    tail tokens whose decoder windows are truncated (the bounded replay). ``exact``: whether every logit
    and every ring the steps leave equals a no-cache run's (up to rounding).
    """

    num_tokens: int
    requested_hit: int
    hit: int
    mode: str
    encoder_restored: bool
    steps: tuple[ReplayStep, ...]
    encoder_replay_tokens: int
    decoder_replay_tokens: int
    exact: bool

    @property
    def tail_start(self) -> int:
        return self.steps[-1].start

    @property
    def replayed_tokens(self) -> int:
        return self.encoder_replay_tokens + self.decoder_replay_tokens

    def token_layer_counts(self) -> dict[str, int]:
        """Token x layer work by kind (for FLOP accounting); the source write counts as one layer."""
        out: dict[str, int] = {}
        for s in self.steps:
            lay = s.layers[1] - s.layers[0] + (s.source_layer is not None)
            out[s.kind] = out.get(s.kind, 0) + s.num_tokens * lay
        return out


def plan_replay(
    cfg: ReplayConfig,
    num_tokens: int,
    hit: int,
    pending_drafts: int = 0,
    host_state: bool | Sequence[int] = False,
) -> ReplayPlan:
    """Plan the prefill of ``num_tokens`` tokens whose first ``hit`` have cached block KV.

    ``pending_drafts``: draft tokens that may be rolled back right after (the tail keeps ``w + d`` tokens
    at least). ``host_state``: whether the encoder rings are persisted at the hit (True / False), or the
    positions at which they are (restored when the trimmed hit is one of them, else the encoder is
    replayed).
    """
    n = _int("num_tokens", num_tokens, 1)
    h0 = _int("hit", hit, 0)
    if h0 > n:
        raise _err("hit", f"{h0}: must be <= num_tokens={n}")
    d = _int("pending_drafts", pending_drafts, 0)
    w, e, nl = cfg.window, cfg.encoder_layers, cfg.num_layers
    exact_mode = cfg.mode == EXACT
    tail = cfg.exact_tail(d) if exact_mode else max(cfg.keep, w + d)
    has_decoder = cfg.decoder_layers > 0
    if not has_decoder:
        tail = 1  # no decoder to rebuild: only the last token must be computed
    al = cfg.align
    h = min(h0, n - tail) if has_decoder else min(h0, n - 1)
    h = max(0, h) // al * al
    restored = False
    if h > 0 and not isinstance(host_state, bool):
        ok = sorted({int(p) for p in host_state if 0 < int(p) <= h and int(p) % al == 0})
        if ok and ok[-1] == h:
            restored = True
    elif h > 0:
        restored = bool(host_state)
    if h == 0:
        full = ReplayStep(
            kind=PREFILL,
            start=0,
            end=n,
            layers=(0, nl),
            floor=0,
            floor_layers=(0, 0),
            source_layer=None,
            writes_blocks=True,
            logits=True,
        )
        return ReplayPlan(
            num_tokens=n,
            requested_hit=h0,
            hit=0,
            mode=cfg.mode,
            encoder_restored=False,
            steps=(full,),
            encoder_replay_tokens=0,
            decoder_replay_tokens=0,
            exact=True,
        )
    steps: list[ReplayStep] = []
    enc_exact = True
    if restored:
        steps.append(
            ReplayStep(
                kind=ENCODER_RESTORE,
                start=h,
                end=h,
                layers=(0, 0),
                floor=h,
                floor_layers=(0, 0),
                source_layer=None,
                writes_blocks=False,
                logits=False,
            )
        )
        enc_tokens = 0
    else:
        span = cfg.exact_encoder_replay() if exact_mode else (cfg.encoder_replay or w)
        a = max(0, h - span)
        enc_exact = a == 0 or h - a >= cfg.exact_encoder_replay()
        if h > a:  # (a window of 1 has no state to rebuild)
            steps.append(
                ReplayStep(
                    kind=ENCODER_REPLAY,
                    start=a,
                    end=h,
                    layers=(0, e),
                    floor=a,
                    floor_layers=(0, e),
                    source_layer=None,
                    writes_blocks=False,
                    logits=False,
                )
            )
        enc_tokens = h - a
    t0 = max(h, n - tail) if has_decoder else h
    if t0 > h:
        steps.append(
            ReplayStep(
                kind=ENCODER_PREFILL,
                start=h,
                end=t0,
                layers=(0, e),
                floor=0,
                floor_layers=(0, 0),
                source_layer=e,
                writes_blocks=True,
                logits=False,
            )
        )
    steps.append(
        ReplayStep(
            kind=TAIL,
            start=t0,
            end=n,
            layers=(0, nl),
            floor=t0,
            floor_layers=(e, nl),
            source_layer=None,
            writes_blocks=True,
            logits=True,
        )
    )
    dec_exact = not has_decoder or t0 == 0 or n - t0 >= cfg.exact_tail(d)
    return ReplayPlan(
        num_tokens=n,
        requested_hit=h0,
        hit=h,
        mode=cfg.mode,
        encoder_restored=restored,
        steps=tuple(steps),
        encoder_replay_tokens=enc_tokens,
        decoder_replay_tokens=(n - t0) if has_decoder else 0,
        exact=enc_exact and dec_exact,
    )
