"""Settings of a MARS fine-tuning run, validated where they are made (no globals)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mars_export.hub_model import check_revision
from runtime.command_line import check_path_given

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
LR_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


@dataclass
class LoraSettings:
    """A LoRA adapter: rank, scaling alpha, dropout and target modules.

    ``targets`` is ``"all-linear"`` (every linear layer but the LM head) or comma-separated
    module names such as ``"q_proj,v_proj"``. ``train_mask_embedding`` also trains the
    embedding row of the mask token, which the base model never learned. ``init`` is a
    LoRA adapter directory (peft format) to continue training from instead of a fresh
    adapter; its own rank, alpha and targets then apply.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: str = "all-linear"
    train_mask_embedding: bool = True
    init: str | None = None

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--lora-rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if self.init is not None:
            check_adapter_dir(Path(self.init))
        if not self.target_modules:
            raise ValueError("--lora-targets is empty; give 'all-linear' or module names like 'q_proj,v_proj'")

    @property
    def target_modules(self) -> str | list[str]:
        if self.targets == "all-linear":
            return self.targets
        return [name.strip() for name in self.targets.split(",") if name.strip()]


def check_adapter_dir(path: Path) -> None:
    """Raise ValueError unless ``path`` holds a peft LoRA adapter (readable config and weights)."""
    hint = "give a LoRA adapter directory such as mars_export/data/smollm2-135m-mars or a run's adapter/"
    config = path / "adapter_config.json"
    if not config.is_file():
        raise ValueError(f"--lora-init {path}: no adapter_config.json there; {hint}")
    try:
        json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--lora-init: {config} is not valid JSON ({e}); {hint}") from e
    if not any((path / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ValueError(f"--lora-init {path}: no adapter_model.safetensors (or .bin) there; {hint}")


@dataclass
class TrainConfig:
    """One ``mars-train`` run (DESIGN.md §2 for ``block_size`` and ``alpha``).

    ``max_steps`` > 0 overrides ``epochs``. ``save_steps`` 0 saves no periodic checkpoints.
    ``lora`` None means full fine-tuning. ``group_by_length`` batches examples of similar
    length together (less padding), in a random order of such groups. ``revision`` is the branch,
    tag or commit of a ``model`` given as a Hugging Face hub id (None: ``main``).
    """

    model: str
    data: list[str]
    output: str
    block_size: int = 4
    alpha: float = 1.0
    max_length: int | None = 1024
    mask_token: str | None = None
    lora: LoraSettings | None = None
    epochs: float = 1.0
    max_steps: int = -1
    learning_rate: float = 1e-5
    lr_scheduler: str = "linear"
    warmup_steps: int = 0
    batch_size: int = 1
    grad_accum: int = 1
    seed: int = 0
    save_steps: int = 500
    logging_steps: int = 10
    resume: bool = False
    precision: str = "auto"
    group_by_length: bool = False
    revision: str | None = None

    def __post_init__(self) -> None:
        check_revision(self.model, self.revision)
        if not self.data:
            raise ValueError("give at least one --data FILE")
        check_path_given(self.output, "--output", "the directory to write the checkpoints and the final model to")
        checks = {"--block-size": self.block_size, "--batch-size": self.batch_size,
                  "--grad-accum": self.grad_accum, "--logging-steps": self.logging_steps}
        for name, value in checks.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.alpha < 0:
            raise ValueError(f"--alpha must be >= 0, got {self.alpha}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"--max-length must be >= 2, got {self.max_length}")
        if self.save_steps < 0 or self.learning_rate <= 0 or (self.max_steps <= 0 and self.epochs <= 0):
            raise ValueError("--save-steps must be >= 0, --lr > 0, and --epochs or --max-steps > 0")
        if self.lr_scheduler not in LR_SCHEDULERS or self.warmup_steps < 0:
            raise ValueError(f"--lr-scheduler must be one of {', '.join(LR_SCHEDULERS)} and --warmup-steps >= 0, "
                             f"got {self.lr_scheduler!r}, {self.warmup_steps}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
