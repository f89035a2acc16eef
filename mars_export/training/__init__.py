"""MARS fine-tuning (MARS, arXiv 2604.07023; DESIGN.md §2): two-stream attention, objective, data, trainer.

The ``mars-train`` command lives in :mod:`mars_export.training.cli`.
"""

from mars_export.training.attention import prepare_mars_attention_mask, to_additive_mask
from mars_export.training.objective import MarsLoss, compute_mars_loss

__all__ = ["MarsLoss", "compute_mars_loss", "prepare_mars_attention_mask", "to_additive_mask"]
