"""Choose the MARS mask token and record it with the model (DESIGN.md §1).

The mask token is either a spare special token already in the vocabulary or one new
token appended to it (one new embedding row). Its string and id are stored in
``model.config`` as ``mars_mask_token`` / ``mars_mask_token_id`` so they travel with every
checkpoint saved from the model and every export.
"""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase


def resolve_mask_token(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       requested: str | None) -> tuple[str, int]:
    """Return ``(mask_token, mask_token_id)``, appending the token to the vocabulary if new.

    Raises:
        ValueError: no token is requested and none is recorded with the model; the
            requested token differs from the one the model was trained with; or the token
            is one the chat template or generation uses (bos/eos/pad).
    """
    recorded = getattr(model.config, "mars_mask_token", None)
    if requested is None and recorded is None:
        raise ValueError("no MARS mask token is recorded with this model; pass --mask-token TOKEN: "
                         f"a spare special token of its vocabulary ({', '.join(spare_special_tokens(tokenizer)[:6]) or 'none found'}) "
                         "or a new token name, which is appended as one embedding row")
    if requested is not None and recorded is not None and requested != recorded:
        raise ValueError(f"this model records mask token {recorded!r} but --mask-token {requested!r} was given; "
                         "drop --mask-token to use the recorded one")
    token = requested if requested is not None else recorded
    reserved = {tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token}
    if token in reserved:
        raise ValueError(f"mask token {token!r} is the bos/eos/pad token; choose a spare one such as "
                         f"{', '.join(spare_special_tokens(tokenizer)[:6])}")
    if token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [token]})
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    token_id = tokenizer.convert_tokens_to_ids(token)
    model.config.mars_mask_token = token
    model.config.mars_mask_token_id = token_id
    return token, token_id


def spare_special_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Special tokens that are neither bos/eos/pad/unk nor written by the chat template."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    used = {tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token, tokenizer.unk_token}
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return [t for t in added if t not in used and t not in template]
