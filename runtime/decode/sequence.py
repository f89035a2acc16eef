"""One request's decoding state: plain data that the scheduler and the engine read and update.

A sequence is prefilling while prompt tokens other than the last remain uncached; then
every step feeds its ``uncached`` real tokens (the last prompt token first, later the tokens
accepted in the previous step), the verify-mode ``drafts``, and mask tokens up to the
window W (DESIGN.md §3). Drafts (verify mode, or threshold mode with a lookup source) are
chosen before each step from the request's draft source: a prompt-lookup proposal over
prompt + generated ids (:mod:`runtime.decode.lookup`) and/or the previous step's mask predictions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.decode.lookup import NgramIndex
from runtime.decode.mask_backoff import MaskBackoff
from runtime.decode.params import DecodeParams, GenerationResult
from runtime.decode.sampling import is_greedy


@dataclass
class Sequence:
    """A request from admission to its last token.

    Attributes:
        request_id: the caller's id.
        prompt_ids: prompt token ids (>= 1).
        params: the request's :class:`DecodeParams`.
        block_size: B for this request (params.block_size or the bundle's).
        stop_ids: ids that end it.
        slot: its KV-cache slot (= batch row) while running, else None.
        num_prefilled: prompt tokens whose KV is committed.
        uncached: real tokens whose KV is not cached yet, fed first in the next step.
        drafts: this step's draft ids, fed after ``uncached`` (:meth:`prepare_drafts`).
        drafts_from_masks: ``drafts`` are the previous step's mask predictions (not a lookup proposal).
        mask_drafts: the previous step's predictions at its masks after the last token it
            yielded (empty unless every draft of that step was kept).
        lookup: n-gram index of prompt + generated ids when the draft source uses lookup, else None.
        mask_backoff: whether the next step feeds masks, with ``params.adaptive_masks``; else None (always).
        rng: random generator (sampling only).
        result: tokens and counters so far.
        start_time: ``time.perf_counter()`` at admission.
    """

    request_id: str
    prompt_ids: list[int]
    params: DecodeParams
    block_size: int
    stop_ids: frozenset[int]
    slot: int | None = None
    num_prefilled: int = 0
    uncached: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    drafts_from_masks: bool = False
    mask_drafts: list[int] = field(default_factory=list)
    lookup: NgramIndex | None = None
    mask_backoff: MaskBackoff | None = None
    rng: np.random.Generator | None = None
    result: GenerationResult = field(default_factory=GenerationResult)
    start_time: float = 0.0

    def __post_init__(self):
        self.uncached = [self.prompt_ids[-1]]
        if self.params.draft in ("lookup", "both"):
            self.lookup = NgramIndex(self.prompt_ids)
        if self.params.adaptive_masks:
            self.mask_backoff = MaskBackoff()
        if not is_greedy(self.params.temperature):
            self.rng = np.random.default_rng(self.params.seed)

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < len(self.prompt_ids) - 1

    @property
    def num_remaining(self) -> int:
        """Tokens it may still generate."""
        return self.params.max_new_tokens - self.result.num_tokens

    @property
    def finish_reason(self) -> str | None:
        """The finish rule: ``stop`` after an end token, ``length`` once max_new_tokens are out, else None."""
        tokens = self.result.token_ids
        if tokens and tokens[-1] in self.stop_ids:
            return "stop"
        return "length" if self.num_remaining == 0 else None

    def tau(self, default_tau: float) -> float:
        """The threshold this row uses now: 1 in ar and verify mode, else its own tau or the engine's live default."""
        if self.params.mode in ("ar", "verify"):
            return 1.0
        return default_tau if self.params.tau is None else self.params.tau

    def prefill_chunk(self, window: int) -> list[int]:
        """The next at most W prompt tokens to prefill (never the last prompt token)."""
        return self.prompt_ids[self.num_prefilled:min(self.num_prefilled + window, len(self.prompt_ids) - 1)]

    def step_ids(self, width: int, mask_token_id: int, pad_token_id: int) -> list[int]:
        """The ``width`` ids this row feeds: a prefill chunk then padding, or uncached + drafts + masks."""
        if self.is_prefilling:
            chunk = self.prefill_chunk(width)
            return chunk + [pad_token_id] * (width - len(chunk))
        real = self.uncached[:width] + self.drafts[:width - min(len(self.uncached), width)]
        return real + [mask_token_id] * (width - len(real))

    def add_tokens(self, token_ids: list[int]) -> None:
        """Record tokens a step yielded (and index them for lookup drafts)."""
        self.result.token_ids.extend(token_ids)
        if self.lookup is not None:
            self.lookup.extend(token_ids)

    def prepare_drafts(self) -> None:
        """Set this step's ``drafts`` (rows whose params use drafts), at most min(B, tokens left) - 1.

        A lookup proposal when the draft source uses lookup and one exists; otherwise the
        previous step's mask predictions when the source uses masks; otherwise none.
        """
        max_drafts = min(self.block_size, self.num_remaining) - 1
        proposal = self.lookup.propose(max_drafts) if self.lookup is not None else []
        self.drafts = proposal or (self.mask_drafts[:max_drafts] if self.params.draft != "lookup" else [])
        self.drafts_from_masks = not proposal and bool(self.drafts)
