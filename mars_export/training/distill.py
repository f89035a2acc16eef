"""Self-distillation data: the model answers the training prompts itself with greedy AR.

MARS (arXiv 2604.07023) fine-tunes on instruction data; training on the model's own
greedy answers keeps the multi-token predictions close to what the AR model would say.
Answers cut by ``max_new_tokens`` (no end-of-turn token) are dropped and counted, so no
truncated answer is later taught as complete.

Dimension letters: N batch, T prompt tokens (left-padded), G generated tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mars_export.model_source import load_model
from mars_export.training.data import Messages, read_records, record_prompt_messages


@dataclass
class DistillReport:
    """How many prompts were answered, and how many answers were dropped as unfinished."""

    num_prompts: int = 0
    num_written: int = 0
    num_unfinished: int = 0

    def __str__(self) -> str:
        return (f"{self.num_written} of {self.num_prompts} answers written; {self.num_unfinished} dropped "
                "as unfinished (raise --max-new-tokens to keep them)")


@torch.no_grad()
def generate_greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[Messages],
                    max_new_tokens: int) -> list[list[int]]:
    """Greedy AR continuations of one batch of chat prompts.

    The batch is left-padded so every row's generation starts at the same index.

    Returns:
        Per prompt, the generated ids up to and including the first end-of-turn token
        (``tokenizer.eos_token_id``), or all ``max_new_tokens`` ids when none came.
    """
    tokenizer.padding_side = "left"
    enc = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, padding=True,
                                        return_tensors="pt", return_dict=True).to(model.device)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad,
                         eos_token_id=eos)  # [N, T + G]
    rows = out[:, enc["input_ids"].shape[1]:].tolist()  # [N, G]
    return [row[:row.index(eos) + 1] if eos in row else row for row in rows]


def distill(model_spec: str, prompts_path: str | Path, output_path: str | Path, max_new_tokens: int = 512,
            batch_size: int = 8, max_prompts: int | None = None, mask_token: str | None = None) -> DistillReport:
    """Write ``{"messages": prompt + [assistant answer]}`` lines for the prompts of ``prompts_path``.

    Args:
        model_spec: as for :func:`mars_export.model_source.load_model`.
        prompts_path: any data file :mod:`mars_export.training.data` reads; answers in it are ignored.
        output_path: the chat JSONL to write (replaced).
        max_prompts: answer only the first this many prompts.

    Raises:
        ValueError: ``max_new_tokens`` or ``batch_size`` below 1, or a malformed prompt record.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"--max-new-tokens and --batch-size must be >= 1, got {max_new_tokens}, {batch_size}")
    loaded = load_model(model_spec, mask_token)
    model = loaded.model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    prompts = [record_prompt_messages(r) for r in read_records(prompts_path)][:max_prompts]
    report = DistillReport(num_prompts=len(prompts))
    with open(output_path, "w", encoding="utf-8") as sink:
        for start in tqdm(range(0, len(prompts), batch_size), desc="distill", unit="batch"):
            batch = prompts[start:start + batch_size]
            for prompt, ids in zip(batch, generate_greedy(model, loaded.tokenizer, batch, max_new_tokens)):
                if not ids or ids[-1] != loaded.tokenizer.eos_token_id:
                    report.num_unfinished += 1
                    continue
                answer = loaded.tokenizer.decode(ids[:-1], skip_special_tokens=True)
                record = {"messages": prompt + [{"role": "assistant", "content": answer}]}
                sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                report.num_written += 1
    return report
