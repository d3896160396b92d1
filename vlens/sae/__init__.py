"""Sparse autoencoders inside the engine: `SAE` (loading, SAELens's formulas), the per-step readout that
encodes every request's rows of one SAE at once (readout), and the clamp edit a tap applies (clamp)."""

from vlens.sae.model import SAE

__all__ = ["SAE"]
