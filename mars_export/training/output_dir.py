"""Where ``mars-train`` may write (``--output DIR``), checked before the model loads so that nothing is lost.

Training writes straight into ``--output``: checkpoints (``checkpoint-N/``) as it goes, then the final model
(``config.json``, the weights, the tokenizer files, a LoRA run's ``adapter/``), replacing files of those names.
The checkpoints are the run's resumable state, so unlike ``mars-export -o`` (:mod:`mars_export.output_dir`) nothing
is written elsewhere first and renamed. Hence: a fresh run takes a missing or empty directory; ``--resume`` takes
one that holds a run's checkpoints (that run's own ``--output``); neither a file, nor the model it trains, the
adapter it starts from (``--lora-init``) or a folder holding them.
"""

from __future__ import annotations

from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

from mars_export.output_dir import check_apart_from_model, model_paths
from mars_export.training.config import TrainConfig


def find_resume_checkpoint(config: TrainConfig) -> str | None:
    """The checkpoint to resume from, or None for a fresh run; nothing is touched.

    Raises:
        ValueError: ``--output`` is a file, is or contains the model or the ``--lora-init`` adapter, or is
            not empty on a fresh run (naming ``--resume`` when it holds checkpoints); ``--resume`` without a
            checkpoint in ``--output``.
    """
    output = Path(config.output)
    sources = model_paths(config.model) + ([Path(config.lora.init)] if config.lora and config.lora.init else [])
    check_apart_from_model(output, sources, "--output")
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file, not a directory; choose another --output")
    last = get_last_checkpoint(str(output)) if output.is_dir() else None
    if config.resume and last is None:
        raise ValueError(f"--resume: no checkpoint-* directory in {output}")
    if not config.resume and last is not None:
        raise ValueError(f"{output} already holds {Path(last).name}; pass --resume to continue "
                         "from it, or choose another --output")
    if not config.resume and output.is_dir() and any(output.iterdir()):
        raise ValueError(f"--output {output} is not empty and holds no checkpoint-N to --resume; training would "
                         "overwrite files there (config.json, the weights): choose a new or empty directory")
    return last
