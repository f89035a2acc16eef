"""Self-distillation data: the model answers the training prompts itself with greedy AR.

MARS (arXiv 2604.07023) fine-tunes on instruction data; training on the model's own
greedy answers keeps the multi-token predictions close to what the AR model would say.

:func:`distill` generates through this project's batched engine (:class:`runtime.decode.engine.Engine`,
continuous batching, tau = 1, so exactly greedy AR) over an ONNX bundle of the model: the
bundle given, or one exported into a temporary directory. :func:`generate_greedy` is the
transformers ``generate`` path, kept for machines without onnxruntime (the GPU script,
``scripts/gpu_train.py``).

An answer that reaches ``max_new_tokens`` without its end-of-turn token is cut there and
kept, marked ``"cut": true``: it is still the model's own greedy text, only unfinished.
The training loader gives a cut answer no end-of-turn target (:func:`~mars_export.training.data.prepare_example`).

Dimension letters: N batch, T prompt tokens (left-padded), G generated tokens.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mars_export.hub_model import check_revision
from mars_export.training.data import Messages, read_records, record_prompt_messages
from runtime.bundle import CONFIG_FILE
from runtime.command_line import check_path_given

EXPORT_BLOCK_SIZE = 4  # block size of the temporary export; distillation runs at tau 1, so any B works


@dataclass
class DistillReport:
    """What :func:`distill` wrote: answers, how many were cut, generated tokens and wall time (s)."""

    num_prompts: int = 0
    num_written: int = 0
    num_cut: int = 0
    num_tokens: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        rate = self.num_tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"{self.num_written} of {self.num_prompts} answers written, {self.num_cut} of them cut at "
                f"--max-new-tokens (marked \"cut\": true); {self.num_tokens} tokens in {self.seconds:.1f} s "
                f"({rate:.1f} tokens/s)")


def read_prompts(paths: list[str | Path], max_prompts: int | None = None) -> list[Messages]:
    """The prompts (chat messages without the answer) of every record of ``paths``, in order.

    Raises:
        ValueError: a malformed record or data file, or ``max_prompts`` below 1.
    """
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"--max-prompts must be >= 1, got {max_prompts}")
    prompts = [record_prompt_messages(r) for path in paths for r in read_records(path)]
    return prompts[:max_prompts]


def prepare_record(prompt: Messages, answer_ids: list[int], stop_ids: set[int],
                   decode: Callable[[list[int]], str]) -> dict:
    """The chat record of one greedy answer: ``{"messages": prompt + [answer], "cut": bool}``.

    ``answer_ids`` ends with a stop id when the answer finished; otherwise it was cut at
    the token cap and ``cut`` is True. The stop token itself is not part of the text.
    """
    is_cut = not answer_ids or answer_ids[-1] not in stop_ids
    text = decode(answer_ids if is_cut else answer_ids[:-1])
    return {"messages": prompt + [{"role": "assistant", "content": text}], "cut": is_cut}


@contextmanager
def open_bundle(model_spec: str, mask_token: str | None = None, revision: str | None = None) -> Iterator[Path]:
    """A bundle directory of ``model_spec``: the spec itself if it is one, else a temporary export.

    The temporary bundle (block size 4, float32, parity-checked as ``mars-export`` does) is
    removed on exit.

    Raises:
        ValueError: as :func:`mars_export.model_source.load_model`; ParityError if the export fails its check.
    """
    if (Path(model_spec) / CONFIG_FILE).is_file():
        yield Path(model_spec)
        return
    from mars_export.bundle_writer import write_bundle
    from mars_export.cli import FP32_PARITY_TOL
    from mars_export.model_source import load_model

    loaded = load_model(model_spec, mask_token, revision)
    with tempfile.TemporaryDirectory(prefix="mars-distill-") as tmp:
        write_bundle(loaded, Path(tmp) / "bundle", EXPORT_BLOCK_SIZE, EXPORT_BLOCK_SIZE, FP32_PARITY_TOL)
        del loaded
        yield Path(tmp) / "bundle"


def distill(model_spec: str, prompts_paths: list[str | Path], output_path: str | Path, max_new_tokens: int = 512,
            batch_size: int = 8, max_prompts: int | None = None, mask_token: str | None = None,
            num_threads: int = 0, revision: str | None = None) -> DistillReport:
    """Write one chat record per prompt (:func:`prepare_record`) with the engine's greedy answer.

    Args:
        model_spec: a bundle directory (``mars-export`` output), or a model spec as for
            :func:`mars_export.model_source.load_model`, exported to a temporary bundle first.
        prompts_paths: data files :mod:`mars_export.training.data` reads; answers in them are ignored.
        output_path: the chat JSONL to write, in prompt order: written to a hidden file beside it (flushed
            as answers finish) that replaces ``output_path`` only once every answer is in, so a failed run
            leaves an existing file as it was.
        max_new_tokens: the token cap; longer answers are cut there and marked.
        batch_size: engine slots (rows decoding at once; continuous batching).
        num_threads: onnxruntime intra-op threads (0: its choice).
        revision: the branch, tag or commit of a ``model_spec`` given as a hub id (None: ``main``).

    Raises:
        ValueError: a bad argument (``output_path`` empty, a directory or in a missing one: before any export),
            a malformed prompt record, or a prompt too long for the model.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"--max-new-tokens and --batch-size must be >= 1, got {max_new_tokens}, {batch_size}")
    check_path_given(str(output_path), "--output", "the path of the JSONL file to write")
    output_path = Path(output_path)
    if output_path.is_dir():
        raise ValueError(f"--output {output_path} is a directory; give the path of the JSONL file to write")
    if not output_path.parent.is_dir():
        raise ValueError(f"--output {output_path}: the folder {output_path.parent} does not exist; create it first")
    check_revision(model_spec, revision)
    from runtime.decode.engine import Engine, EngineConfig
    from runtime.backends.loading import load_backend
    from runtime.decode.params import DecodeParams
    from runtime.text.tokenizer import Tokenizer

    prompts = read_prompts(prompts_paths, max_prompts)
    with open_bundle(model_spec, mask_token, revision) as bundle_dir:
        backend, config, _ = load_backend(bundle_dir, "cpu", num_threads)
        tokenizer = Tokenizer(bundle_dir)
        engine = Engine(backend, config, EngineConfig(max_batch_size=batch_size))
        params = DecodeParams(tau=1.0, mode="ar", max_new_tokens=max_new_tokens)
        start = time.perf_counter()
        request_ids = [engine.add_request(tokenizer.encode_chat(p), params) for p in prompts]
        answers: dict[str, list[int]] = {}
        report = DistillReport(num_prompts=len(prompts))
        with _replacing(output_path) as sink:
            while engine.has_unfinished():
                answers.update((o.request_id, o.result.token_ids) for o in engine.step() if o.finished)
                while report.num_written < len(prompts) and request_ids[report.num_written] in answers:
                    ids = answers.pop(request_ids[report.num_written])
                    record = prepare_record(prompts[report.num_written], ids, set(config.eos_token_ids),
                                            tokenizer.decode)
                    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                    report.num_written += 1
                    report.num_cut += record["cut"]
                    report.num_tokens += len(ids)
                sink.flush()
        report.seconds = time.perf_counter() - start
    return report


@contextmanager
def _replacing(path: Path) -> Iterator:
    """A text file to write that replaces ``path`` when the block ends normally. Otherwise ``path`` is kept as it
    was, and what was written (if anything) is kept as ``path`` + ``.partial``, named on stderr."""
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as sink:
            yield sink
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; give it a new file's mode
        os.replace(tmp, path)
    except BaseException:
        partial = path.with_name(path.name + ".partial")
        if Path(tmp).stat().st_size:  # an interrupted run keeps its answers so far
            os.replace(tmp, partial)
            print(f"the answers written before this stop are kept in {partial}", file=sys.stderr)
        else:
            Path(tmp).unlink()
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@torch.no_grad()
def generate_greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[Messages],
                    max_new_tokens: int) -> list[list[int]]:
    """Greedy AR continuations of one batch of chat prompts with transformers ``generate``.

    The batch is left-padded so every row's generation starts at the same index.

    Returns:
        Per prompt, the generated ids up to and including the first end-of-turn token
        (``tokenizer.eos_token_id``), or all ``max_new_tokens`` ids when none came (a cut answer).
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
