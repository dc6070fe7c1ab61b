"""Bytes per token of each cache format, without importing torch (the planner and pools stay light).

Must agree with ``formats.get_format(name, dim).bytes_per_token`` (asserted in the tests).
"""

from __future__ import annotations

# name -> (values' bytes per element as a fraction, group size of one scale, scale bytes, dim multiple)
_RULES: dict[str, tuple[float, int, int, int]] = {
    "fp4": (0.5, 16, 1, 32),
    "fp8": (1.0, 32, 1, 32),
    "mxfp4": (0.5, 32, 1, 32),
    "bf16": (2.0, 0, 0, 1),
    "fp16": (2.0, 0, 0, 1),
    "fp32": (4.0, 0, 0, 1),
}
V32_ROPE_DIM = 64


def bytes_per_token(name: str, dim: int) -> int:
    """Bytes of one token's ``dim`` values in format ``name`` (ValueError for unknown names or bad dims)."""
    if name == "v32":  # 512 e4m3 + fp32 scale per 128 + 64 bf16 RoPE
        nope = dim - V32_ROPE_DIM
        if nope <= 0 or nope % 128:
            raise ValueError(f"v32: dim - {V32_ROPE_DIM} must be a positive multiple of 128, got dim={dim}")
        return nope + 4 * (nope // 128) + 2 * V32_ROPE_DIM
    if name not in _RULES:
        raise ValueError(f"unknown cache format {name!r}; allowed: {', '.join([*_RULES, 'v32'])}")
    per, group, sbytes, mult = _RULES[name]
    if not isinstance(dim, int) or dim <= 0 or dim % mult:
        raise ValueError(f"{name}: dim must be a positive multiple of {mult}, got {dim!r}")
    return int(dim * per) + (dim // group * sbytes if group else 0)
