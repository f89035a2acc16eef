"""The MARS objective: noisy stream, AR-aligned targets, loss terms (DESIGN.md §2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_mars import EOS_ID, MASK_ID, make_model

from mars_export.training.objective import (
    IGNORE_INDEX, compute_mars_loss, mars_loss, prepare_mars_inputs, prepare_noisy_ids, prepare_targets,
)

X = IGNORE_INDEX
# Two examples: prompt 10 11, response 12 13 14 EOS (pad = eos = 2); prompt 20 21 22, response 23 EOS.
IDS = torch.tensor([[10, 11, 12, 13, 14, EOS_ID, EOS_ID],
                    [20, 21, 22, 23, EOS_ID, EOS_ID, EOS_ID]])
PROMPT_LENGTHS, LENGTHS = torch.tensor([2, 3]), torch.tensor([6, 5])


def test_noisy_stream_masks_response_positions_only():
    expected = [[10, 11, MASK_ID, MASK_ID, MASK_ID, MASK_ID, EOS_ID],
                [20, 21, 22, MASK_ID, MASK_ID, EOS_ID, EOS_ID]]
    assert prepare_noisy_ids(IDS, PROMPT_LENGTHS, LENGTHS, MASK_ID).tolist() == expected


def test_targets_are_the_next_response_token_and_include_eos_but_not_pad():
    expected = [[X, 12, 13, 14, EOS_ID, X, X],
                [X, X, 23, EOS_ID, X, X, X]]
    assert prepare_targets(IDS, PROMPT_LENGTHS, LENGTHS).tolist() == expected


def test_inputs_concatenate_noisy_then_clean_with_repeated_positions():
    inputs = prepare_mars_inputs(IDS, PROMPT_LENGTHS, LENGTHS, MASK_ID, block_size=2, mask_dtype=torch.float32)
    assert inputs["input_ids"].shape == (2, 14) and torch.equal(inputs["input_ids"][:, 7:], IDS)
    assert inputs["position_ids"][0].tolist() == list(range(7)) * 2
    assert inputs["attention_mask"].shape == (2, 1, 14, 14)


def reference_ce(logits: torch.Tensor, stream: int) -> torch.Tensor:
    """CE written out position by position: output at i predicts token i+1 of the response."""
    max_length, terms = IDS.shape[1], []
    for n in range(IDS.shape[0]):
        for i in range(max_length - 1):
            if PROMPT_LENGTHS[n] <= i + 1 < LENGTHS[n]:
                row = logits[n, stream * max_length + i]
                terms.append(-F.log_softmax(row, dim=-1)[IDS[n, i + 1]])
    return torch.stack(terms).mean()


def test_loss_terms_match_a_position_by_position_reference():
    torch.manual_seed(0)
    logits = torch.randn(2, 14, 40)
    out = mars_loss(logits, prepare_targets(IDS, PROMPT_LENGTHS, LENGTHS), alpha=0.5)
    torch.testing.assert_close(out.loss_mask, reference_ce(logits, stream=0))
    torch.testing.assert_close(out.loss_ar, reference_ce(logits, stream=1))
    torch.testing.assert_close(out.loss, out.loss_mask + 0.5 * out.loss_ar)


def test_invalid_lengths_raise():
    with pytest.raises(ValueError, match="prompt_length < length"):
        prepare_targets(IDS, torch.tensor([2, 5]), LENGTHS)
    with pytest.raises(ValueError, match="2 \\* 7"):
        mars_loss(torch.zeros(2, 7, 4), prepare_targets(IDS, PROMPT_LENGTHS, LENGTHS))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_clean_stream_equals_plain_causal_forward(attn):
    model = make_model(attn)
    ids = torch.randint(4, 260, (2, 7)).masked_fill(torch.arange(7) >= LENGTHS[:, None], EOS_ID)
    inputs = prepare_mars_inputs(ids, PROMPT_LENGTHS, LENGTHS, MASK_ID, block_size=2, mask_dtype=torch.float32)
    clean = model(**inputs).logits[:, 7:]  # [N, L, V]
    plain = model(ids, attention_mask=(torch.arange(7) < LENGTHS[:, None]).long()).logits
    real = torch.arange(7) < LENGTHS[:, None]
    torch.testing.assert_close(clean[real], plain[real], atol=1e-5, rtol=1e-5)


def test_ar_term_is_ordinary_sft_loss_and_alpha_weights_it():
    model = make_model("eager")
    labels = IDS.masked_fill(torch.arange(7) < PROMPT_LENGTHS[:, None], X)
    labels = labels.masked_fill(torch.arange(7) >= LENGTHS[:, None], X)  # by length: eos stays a label
    sft = model(IDS, attention_mask=(labels != X) | (torch.arange(7) < LENGTHS[:, None]), labels=labels).loss
    out = compute_mars_loss(model, IDS, PROMPT_LENGTHS, LENGTHS, MASK_ID, block_size=2, alpha=2.0)
    torch.testing.assert_close(out.loss_ar, sft, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.loss - out.loss_mask, 2.0 * sft, atol=1e-6, rtol=1e-6)
    off = compute_mars_loss(model, IDS, PROMPT_LENGTHS, LENGTHS, MASK_ID, block_size=2, alpha=0.0)
    torch.testing.assert_close(off.loss, off.loss_mask)


def test_noisy_output_sees_the_clean_stream_only_through_earlier_blocks():
    """Change clean token 5 (block 1 of 3, B = 4): noisy rows see it iff they lie in block 2."""
    model, length, block = make_model("sdpa"), 12, 4
    ids = torch.randint(4, 260, (1, length))
    lengths, prompts = torch.tensor([length]), torch.tensor([1])
    base = model(**prepare_mars_inputs(ids, prompts, lengths, MASK_ID, block, torch.float32)).logits
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] - 4 + 1) % 256 + 4  # another byte token
    after = model(**prepare_mars_inputs(changed, prompts, lengths, MASK_ID, block, torch.float32)).logits
    moved = (after - base).abs().amax(dim=-1)[0] > 0  # [S]
    assert moved.tolist() == [False] * 8 + [True] * 4 + [False] * 5 + [True] * 7


def test_padded_batch_has_finite_gradients():
    model = make_model("eager").train()
    out = compute_mars_loss(model, IDS, PROMPT_LENGTHS, LENGTHS, MASK_ID, block_size=2)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bf16_autocast_with_a_bf16_mask_stays_finite(attn):
    """Mixed precision on CPU: a mask in the autocast dtype gives a finite loss and gradients."""
    model = make_model(attn).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compute_mars_loss(model, IDS, PROMPT_LENGTHS, LENGTHS, MASK_ID, block_size=2,
                                mask_dtype=torch.bfloat16)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
