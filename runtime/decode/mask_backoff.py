"""Adaptive masks: a row feeds its mask tokens only while they pay (``DecodeParams.adaptive_masks``).

A step that feeds masks costs more than a one-token (AR) step: on the default model, 2 cores, a W = 2 or W = 4
step of the fused graph costs 1.12-1.23x a W = 1 step (BENCHMARKS.md), most of it already at W = 2. A row whose
masks yield no token pays that and gains nothing; with the shipped adapter (TPF about 1.03 at tau 0.9) plain MARS
decoded 0.83x as fast as tau 1.0. With adaptive masks a row backs off exponentially, like a sender after a
collision: after a step whose masks gained no token it runs 1, then 2, 4, ... :data:`MAX_BACKOFF` steps without
masks (real tokens and lookup drafts only), then feeds masks again once (a probe); a step whose masks gain a token
puts it back to masks every step.

A mask "gains a token" when its prediction is accepted by tau, or, fed as the next step's draft (draft ``masks`` /
``both``), is kept there. The policy reads only the row's own tokens, never a clock, so a request's output is the
same on any machine and beside any other rows. It changes which steps carry masks, so in threshold mode at
tau < 1 the tokens can differ from a row that feeds masks every step (more of them are exact AR tokens); where the
output is greedy AR whatever the masks (tau >= 1, verify mode), only the forward count changes.

A step without masks saves work only by being narrower than W: the continuous scheme on a graph whose window axis is
dynamic. In the block scheme, on a TensorRT engine (its profile fixes W) and on step graphs exported before
2026-11-30 every step is W wide, so the engine refuses a request for adaptive masks there, naming the fix
(:func:`runtime.decode.admission.why_no_adaptive_masks`), rather than ignoring it.
"""

from __future__ import annotations

from dataclasses import dataclass

# The longest run of steps without masks between two probes. Plain MARS with the shipped adapter gains a token from
# about 4% of its masked steps, so the backoff mostly sits here (one W-token step per 17 once there; about one step
# in ten in a 96-token answer): measured 0.96-1.03x the speed of AR (BENCHMARKS.md, "Adaptive masks").
MAX_BACKOFF = 16


@dataclass
class MaskBackoff:
    """One row's backoff state.

    Attributes:
        skip: steps left to run without masks (0: the next step feeds masks).
        backoff: the length of the last run without masks (0 after a step whose masks gained a token).
    """

    skip: int = 0
    backoff: int = 0

    @property
    def feeds_masks(self) -> bool:
        """Whether the row's next step feeds mask tokens."""
        return self.skip == 0

    def record(self, fed_masks: bool, gained: bool) -> None:
        """Update after one decode step of the row.

        Args:
            fed_masks: the step fed at least one mask token that the row read.
            gained: a token came from a mask: a mask prediction accepted by tau in this step, or a draft kept in
                this step that was a mask prediction of the step before.
        """
        if gained:
            self.skip = self.backoff = 0
        elif fed_masks:
            self.backoff = min(max(2 * self.backoff, 1), MAX_BACKOFF)
            self.skip = self.backoff
        else:
            self.skip = max(self.skip - 1, 0)


def tokens_from_masks(num_tokens: int, num_drafts: int, drafts_from_masks: bool) -> int:
    """How many of one step's yielded tokens a mask produced.

    Args:
        num_tokens: the tokens the step yielded (>= 1; the first is the exact token after the real inputs, or after
            the kept drafts).
        num_drafts: the drafts the step fed and read.
        drafts_from_masks: those drafts were the previous step's mask predictions (not a lookup proposal).

    Returns:
        Mask-made tokens: with mask drafts, every token after the first (kept drafts, then tau-accepted masks);
        otherwise the tokens beyond the kept drafts and the exact token (tau-accepted masks only).
    """
    if drafts_from_masks:
        return num_tokens - 1
    return max(num_tokens - 1 - num_drafts, 0)
