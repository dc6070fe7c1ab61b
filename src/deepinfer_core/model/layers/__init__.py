"""Layers of the V4.1 model: RMSNorm, RoPE, MoE, attention projections, compressor, lightning indexer."""
