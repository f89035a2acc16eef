"""MARS fine-tuning on the Hugging Face ``Trainer`` (runs as is under ``accelerate launch`` / ``torchrun``).

:class:`MarsTrainer` swaps the LM loss for the MARS objective (MARS, arXiv 2604.07023;
DESIGN.md §2) and logs its two terms, ``loss_mask`` and ``loss_ar``, beside ``loss``.
:func:`run_training` loads the model and data, trains (full or LoRA), and writes a plain
Hugging Face checkpoint whose ``config.json`` records the mask token and block size.
"""

from __future__ import annotations

import gc
import logging
import shutil
import weakref
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel, Trainer, TrainingArguments, set_seed

from mars_export.model_source import load_model
from mars_export.training.config import LoraSettings, TrainConfig
from mars_export.training.data import ExampleDataset, MarsCollator, load_examples
from mars_export.training.objective import MarsLoss, compute_mars_loss
from mars_export.training.output_dir import ADAPTER_DIR, FINAL_WORK_DIR, find_resume_checkpoint, move_final_model

log = logging.getLogger(__name__)


class MarsTrainer(Trainer):
    """``Trainer`` whose loss is ``CE(noisy) + alpha * CE(clean)`` on two-stream batches.

    Batches come from :class:`~mars_export.training.data.MarsCollator` (``input_ids``,
    ``prompt_lengths``, ``lengths``). The loss is a per-batch token mean, so the Trainer
    divides it by the gradient accumulation steps.
    """

    loss_is_scaled_for_ga = False

    def __init__(self, *args, mask_token_id: int, block_size: int, alpha: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mask_token_id, self.block_size, self.alpha = mask_token_id, block_size, alpha
        self._term_sums = torch.zeros(2, device=self.args.device)  # [loss_mask, loss_ar] since the last log
        self._num_terms = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = compute_mars_loss(model, inputs["input_ids"], inputs["prompt_lengths"], inputs["lengths"],
                                self.mask_token_id, self.block_size, self.alpha, self.mask_dtype())
        if model.training:
            self._record_terms(out)
        terms = {"loss_mask": out.loss_mask, "loss_ar": out.loss_ar}
        return (out.loss, terms) if return_outputs else out.loss

    def mask_dtype(self) -> torch.dtype:
        """The dtype attention runs in: the autocast dtype under mixed precision, else the weights'."""
        if self.args.bf16:
            return torch.bfloat16
        if self.args.fp16:
            return torch.float16
        return next(self.model.parameters()).dtype

    def _record_terms(self, out: MarsLoss) -> None:
        terms = torch.stack([out.loss_mask.detach(), out.loss_ar.detach()])
        self._term_sums += terms.to(self._term_sums.device)
        self._num_terms += 1

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the mean ``loss_mask`` / ``loss_ar`` since the last log to each training log."""
        if "loss" in logs and self._num_terms:
            means = self.accelerator.reduce(self._term_sums / self._num_terms, reduction="mean")
            logs["loss_mask"], logs["loss_ar"] = round(means[0].item(), 4), round(means[1].item(), 4)
            self._term_sums.zero_()
            self._num_terms = 0
        super().log(logs, start_time)


def prepare_lora_model(model: PreTrainedModel, settings: LoraSettings, mask_token_id: int) -> PeftModel:
    """Wrap ``model`` with a LoRA adapter (and, if asked, a trainable mask-token embedding row).

    With ``settings.init`` the adapter saved there is loaded, trainable, instead of a fresh one.
    """
    if settings.init is not None:
        # an absolute local path: peft would take a missing directory for a Hub repo id
        return PeftModel.from_pretrained(model, str(Path(settings.init).resolve()), is_trainable=True)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=settings.target_modules, task_type="CAUSAL_LM",
                        trainable_token_indices=[mask_token_id] if settings.train_mask_embedding else None)
    return get_peft_model(model, config)


def choose_precision(precision: str) -> str:
    """``auto`` -> bf16 on a CUDA device that supports it, fp16 on other CUDA devices, fp32 otherwise.

    ``bf16`` also runs on CPU (autocast; fast on CPUs with AVX512_BF16 or AMX); ``fp16`` needs CUDA.
    """
    if precision != "auto":
        if precision == "fp16" and not torch.cuda.is_available():
            raise ValueError("--precision fp16 needs a CUDA device; use bf16 or fp32 on CPU")
        return precision
    if not torch.cuda.is_available():
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def make_training_args(config: TrainConfig) -> TrainingArguments:
    """``TrainingArguments`` for ``config``: no evaluation, no reporting integrations."""
    precision = choose_precision(config.precision)
    sampling = {"train_sampling_strategy": "group_by_length"} if config.group_by_length else {}
    return TrainingArguments(
        output_dir=config.output, per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum, learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler, warmup_steps=config.warmup_steps,
        num_train_epochs=config.epochs, max_steps=config.max_steps, seed=config.seed,
        save_strategy="steps" if config.save_steps else "no", save_steps=config.save_steps or 500,
        logging_steps=config.logging_steps, report_to="none", remove_unused_columns=False,
        dataloader_pin_memory=torch.cuda.is_available(),
        bf16=precision == "bf16", fp16=precision == "fp16", dataloader_num_workers=0, **sampling,
        use_cpu=not torch.cuda.is_available(),  # transformers refuses bf16 without a GPU unless told
    )


def prepare_trainer(config: TrainConfig) -> tuple[MarsTrainer, str | None]:
    """Load the model and data for ``config`` and build the trainer (full or LoRA).

    Returns:
        The trainer and the checkpoint to resume from (None for a fresh run).

    Raises:
        ValueError: a bad model spec, data file or mask token, or an ``--output`` that may not be written or
            resumed (:func:`~mars_export.training.output_dir.find_resume_checkpoint`, checked first).
    """
    resume_from = find_resume_checkpoint(config)
    set_seed(config.seed)
    loaded = load_model(config.model, config.mask_token, config.revision)
    examples, _ = load_examples(config.data, loaded.tokenizer, config.max_length)
    model = loaded.model.train()
    if config.lora is not None:
        model = prepare_lora_model(model, config.lora, loaded.mask_token_id)
    pad_id = loaded.tokenizer.pad_token_id
    trainer = MarsTrainer(
        model=model, args=make_training_args(config), train_dataset=ExampleDataset(examples),
        data_collator=MarsCollator(loaded.tokenizer.eos_token_id if pad_id is None else pad_id),
        processing_class=loaded.tokenizer, mask_token_id=loaded.mask_token_id,
        block_size=config.block_size, alpha=config.alpha,
    )
    return trainer, resume_from


def run_training(config: TrainConfig) -> Path:
    """Fine-tune ``config.model`` with the MARS objective and save the final checkpoint.

    Returns:
        ``config.output``, holding a plain Hugging Face checkpoint (LoRA merged in), the
        tokenizer, and for LoRA runs the adapter alone under ``adapter/``.
    """
    trainer, resume_from = prepare_trainer(config)
    trainer.train(resume_from_checkpoint=resume_from)
    save_final_model(trainer, config)
    return Path(config.output)


def save_final_model(trainer: MarsTrainer, config: TrainConfig) -> None:
    """Write the trained model to ``config.output`` as a plain checkpoint (LoRA merged).

    ``config.json`` keeps ``mars_mask_token(_id)`` and gains ``mars_block_size``. A LoRA run
    also writes its adapter (safetensors) to ``output/adapter``. The files are written to
    ``output/`` :data:`~mars_export.training.output_dir.FINAL_WORK_DIR` first (one left by a run
    killed while saving is replaced) and moved in when all are written, so a run killed meanwhile
    leaves no half-written model among them. Every process calls it (under ``accelerate launch``).
    """
    work = Path(config.output) / FINAL_WORK_DIR
    if trainer.is_world_process_zero():
        shutil.rmtree(work, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    write_final_model(trainer, config, work)
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        move_final_model(work, Path(config.output))


def write_final_model(trainer: MarsTrainer, config: TrainConfig, path: Path) -> None:
    """Write the trained model to ``path`` as :func:`save_final_model` describes (the adapter to ``path/adapter``)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if isinstance(model, PeftModel):
        trainer.save_model(str(path / ADAPTER_DIR))
        if trainer.is_world_process_zero():
            merged = model.merge_and_unload()
            merged.config.mars_block_size = config.block_size
            merged.save_pretrained(path)
            trainer.processing_class.save_pretrained(path)
        return
    model.config.mars_block_size = config.block_size
    trainer.save_model(str(path))


def end_process_group(trainer: MarsTrainer) -> None:
    """End a run under ``accelerate launch`` / ``torchrun`` so that no process hangs or aborts at exit.

    Every process waits for the main one to finish writing (a barrier), drops the DDP wrapper, then
    destroys the process group. The order is the fix of two failures seen in CI: a process that exits
    with gloo's worker threads alive can die of SIGABRT after a good run; and if the DDP wrapper's
    ``Reducer`` holds the last reference to the gloo process group, its destructor joins the worker
    threads with the GIL held while a worker waits for the GIL to free the barrier's tensors, and the
    process hangs for ever (pytorch/pytorch#56297). Dropped first, the wrapper leaves the process group's
    last reference to its Python object, whose destructor releases the GIL. In one process (no process
    group) this only frees the wrapper.
    """
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    wrapper = weakref.ref(trainer.model_wrapped) if trainer.model_wrapped is not trainer.model else None
    trainer.model_wrapped = trainer.model
    accelerator.free_memory()
    gc.collect()
    if wrapper is not None and wrapper() is not None:
        log.warning("the DDP-wrapped model outlived the run; if this process hangs at exit, report it")
    accelerator.end_training()
