"""The two-stream MARS attention mask on hand-made cases (DESIGN.md §2), then on a tiny model."""

from __future__ import annotations

import pytest
import torch
from tiny_mars import make_model

from mars_export.training.attention import prepare_mars_attention_mask, prepare_position_ids, to_additive_mask


def as_matrix(rows: str) -> torch.Tensor:
    """'10 01' style rows (spaces ignored inside a row, one row per line) -> bool matrix."""
    lines = [line.replace(" ", "") for line in rows.strip().splitlines()]
    return torch.tensor([[c == "1" for c in line] for line in lines])


# L = 5, B = 2: blocks {0, 1}, {2, 3}, {4}. Columns: noisy keys 0..4 | clean keys 0..4.
EXPECTED_L5_B2 = as_matrix("""
    10000 00000
    11000 00000
    00100 11000
    00110 11000
    00001 11110
    00000 10000
    00000 11000
    00000 11100
    00000 11110
    00000 11111
""")


def mask_l5_b2(lengths=(5,)) -> torch.Tensor:
    return prepare_mars_attention_mask(torch.tensor(lengths), max_length=5, block_size=2)


def test_full_pattern_l5_b2():
    mask = mask_l5_b2()
    assert mask.shape == (1, 1, 10, 10) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], EXPECTED_L5_B2)


def test_clean_to_clean_is_plain_causal():
    assert torch.equal(mask_l5_b2()[0, 0, 5:, 5:], torch.ones(5, 5, dtype=torch.bool).tril())


def test_noisy_to_noisy_is_causal_inside_the_block_only():
    expected = as_matrix("10000\n11000\n00100\n00110\n00001")
    assert torch.equal(mask_l5_b2()[0, 0, :5, :5], expected)


def test_noisy_to_clean_sees_only_earlier_complete_blocks():
    expected = as_matrix("00000\n00000\n11000\n11000\n11110")
    assert torch.equal(mask_l5_b2()[0, 0, :5, 5:], expected)


def test_clean_never_sees_noisy():
    for block_size in (1, 2, 3, 8):
        mask = prepare_mars_attention_mask(torch.tensor([7]), max_length=7, block_size=block_size)
        assert not mask[0, 0, 7:, :7].any()


def test_block_size_one_noisy_sees_itself_and_all_earlier_clean():
    mask = prepare_mars_attention_mask(torch.tensor([4]), max_length=4, block_size=1)[0, 0]
    assert torch.equal(mask[:4, :4], torch.eye(4, dtype=torch.bool))
    assert torch.equal(mask[:4, 4:], torch.ones(4, 4, dtype=torch.bool).tril(-1))


def test_right_padding_is_never_attended_and_padded_rows_are_empty():
    mask = mask_l5_b2(lengths=(5, 3))
    assert torch.equal(mask[0, 0], EXPECTED_L5_B2)
    expected = as_matrix("""
        10000 00000
        11000 00000
        00100 11000
        00000 00000
        00000 00000
        00000 10000
        00000 11000
        00000 11100
        00000 00000
        00000 00000
    """)
    assert torch.equal(mask[1, 0], expected)


def test_position_ids_repeat_for_both_streams():
    assert prepare_position_ids(2, 3).tolist() == [[0, 1, 2, 0, 1, 2]] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_additive_mask_uses_the_dtype_minimum_not_inf(dtype):
    additive = to_additive_mask(mask_l5_b2(lengths=(3,)), dtype)
    assert additive.dtype == dtype and torch.isfinite(additive).all()
    assert torch.equal(additive == 0, mask_l5_b2(lengths=(3,)))
    assert (additive[~mask_l5_b2(lengths=(3,))] == torch.finfo(dtype).min).all()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="block_size"):
        prepare_mars_attention_mask(torch.tensor([3]), 3, 0)
    with pytest.raises(ValueError, match="lengths"):
        prepare_mars_attention_mask(torch.tensor([4]), 3, 2)
    with pytest.raises(ValueError, match="bool"):
        to_additive_mask(torch.zeros(1, 1, 2, 2), torch.float32)


def test_additive_mask_agrees_across_eager_and_sdpa_without_nan():
    lengths, max_length = torch.tensor([9, 5]), 9
    ids = torch.randint(4, 260, (2, 2 * max_length))
    mask = prepare_mars_attention_mask(lengths, max_length, block_size=4)
    inputs = {"input_ids": ids, "position_ids": prepare_position_ids(2, max_length)}
    eager = make_model("eager")(**inputs, attention_mask=to_additive_mask(mask, torch.float32)).logits
    sdpa = make_model("sdpa")(**inputs, attention_mask=to_additive_mask(mask, torch.float32)).logits
    sdpa_bool = make_model("sdpa")(**inputs, attention_mask=mask).logits
    assert torch.isfinite(eager).all() and torch.isfinite(sdpa).all()
    real = mask[:, 0].any(dim=-1)  # [N, S]: rows of real tokens
    torch.testing.assert_close(eager[real], sdpa[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sdpa_bool[real], sdpa[real], atol=1e-5, rtol=1e-5)
