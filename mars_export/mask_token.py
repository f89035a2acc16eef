"""Choose the MARS mask token and record it with the model (DESIGN.md §1).

The mask token is either a spare special token already in the vocabulary or one new
token appended to it (one new embedding row). Its string and id are stored in
``model.config`` as ``mars_mask_token`` / ``mars_mask_token_id`` so they travel with every
checkpoint saved from the model and every export.
"""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase


def resolve_mask_token(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       requested: str | None) -> tuple[str, int, str]:
    """Return ``(mask_token, mask_token_id, origin)``, adding the token to the vocabulary if new
    (one more embedding row, unless the model has padding rows beyond the tokenizer).

    The token is, in order: ``requested`` (``--mask-token``); the one recorded with the model
    (``config.mars_mask_token``); the tokenizer's ``mask_token``, which is how the paper's
    published checkpoints carry it (``<|mask|>``, an added special token whose id lies in the
    embedding rows Qwen2.5 pads its vocabulary with, so nothing is resized). ``origin`` says
    which, for the export log.

    Raises:
        ValueError: no token is requested, recorded or set as the tokenizer's mask token; the
            requested token is empty, or differs from the one the model was trained with; the
            token is one generation uses (bos/eos/pad), or in the vocabulary but not a spare special
            token (:func:`spare_special_tokens`: an ordinary token, which the model could never write
            again, or one the chat template writes); or the
            tokenizer gives it an id past the model's embedding rows.
    """
    recorded = getattr(model.config, "mars_mask_token", None)
    if requested is not None and recorded is not None and requested != recorded:
        raise ValueError(f"this model records mask token {recorded!r} but --mask-token {requested!r} was given; "
                         "drop --mask-token to use the recorded one")
    token, origin = _choose(requested, recorded, tokenizer)
    spares = spare_special_tokens(tokenizer)
    spare = ", ".join(spares[:6]) or "none found"
    if not token:
        raise ValueError(f"the mask token must not be empty; pass --mask-token TOKEN: a spare special token ({spare}) "
                         "or a new token name")
    if token in {tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token}:
        raise ValueError(f"mask token {token!r} is the bos/eos/pad token; choose a spare one such as {spare}")
    if token in tokenizer.get_vocab() and token not in spares:
        raise ValueError(f"mask token {token!r} is in the vocabulary but not a spare special token (an ordinary token, "
                         "which the model could then never write, or one the chat template writes); choose a spare "
                         f"special token ({spare}) or a new token name")
    if token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [token]})
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # else it took a padding row
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    token_id = tokenizer.convert_tokens_to_ids(token)
    num_rows = model.get_input_embeddings().num_embeddings
    if token_id >= num_rows:
        raise ValueError(f"mask token {token!r} has id {token_id} but the model has only {num_rows} embedding rows: "
                         "the tokenizer and the weights do not belong together")
    model.config.mars_mask_token = token
    model.config.mars_mask_token_id = token_id
    return token, token_id, origin


def _choose(requested: str | None, recorded: str | None, tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """The mask token and where it came from, or a ValueError naming the fix."""
    if requested is not None:
        return requested, "--mask-token"
    if recorded is not None:
        return recorded, "recorded with the model"
    from_tokenizer = tokenizer.special_tokens_map.get("mask_token")
    if from_tokenizer is not None:
        return str(from_tokenizer), "the tokenizer's mask_token"
    raise ValueError("no MARS mask token is recorded with this model and its tokenizer has no mask_token; "
                     "pass --mask-token TOKEN: a spare special token of its vocabulary "
                     f"({', '.join(spare_special_tokens(tokenizer)[:6]) or 'none found'}) "
                     "or a new token name, which is appended as one embedding row")


def spare_special_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Special tokens that are neither bos/eos/pad/unk nor written by the chat template."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    used = {tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token, tokenizer.unk_token}
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return [t for t in added if t not in used and t not in template]
