"""Adaptive masks (runtime.decode.mask_backoff): the backoff rule, and the engine feeding masks only while they pay,
on a tiny random model (its masks never pass tau 0.9, so every probe misses); where every step is W wide (the block
scheme, a fixed-window graph) a request for them is refused, naming the fix."""

from __future__ import annotations

import shutil

import pytest
from support import fix_window
from transformers import AutoTokenizer

from mars_export.parity import chat_prompt_ids
from runtime import generate
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.admission import why_no_adaptive_masks
from runtime.decode.decoder import Decoder
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.mask_backoff import MAX_BACKOFF, MaskBackoff, tokens_from_masks
from runtime.decode.params import DecodeParams, ParamError

MAX_NEW = 80


def test_misses_double_the_run_without_masks_up_to_the_cap_and_a_gain_resets_it():
    backoff, fed = MaskBackoff(), []
    for _ in range(120):
        fed.append(backoff.feeds_masks)
        backoff.record(fed_masks=fed[-1], gained=False)
    gaps = [len(run) for run in "".join("x" if f else "." for f in fed).split("x")[1:-1]]
    assert gaps == [1, 2, 4, 8] + [16] * 5
    assert MAX_BACKOFF == 16
    backoff.record(fed_masks=False, gained=True)  # a kept mask draft in a step without fresh masks
    assert backoff.feeds_masks and backoff.backoff == 0
    backoff.record(fed_masks=True, gained=False)
    assert (backoff.skip, backoff.backoff) == (1, 1)


@pytest.mark.parametrize("num_tokens, num_drafts, from_masks, expected", [
    (1, 0, False, 0),   # the exact token only
    (3, 0, False, 2),   # two masks passed tau
    (3, 2, False, 0),   # two lookup drafts kept, then the exact token
    (4, 2, False, 1),   # lookup drafts kept, the exact token, one mask passed tau
    (2, 3, False, 0),   # the first lookup draft kept, the second corrected
    (3, 3, True, 2),    # two mask drafts kept
    (1, 3, True, 0),    # the first mask draft wrong
])
def test_tokens_from_masks_counts_mask_made_tokens_only(num_tokens, num_drafts, from_masks, expected):
    assert tokens_from_masks(num_tokens, num_drafts, from_masks) == expected


def test_adaptive_masks_must_be_a_bool():
    with pytest.raises(ParamError, match="adaptive_masks must be true or false") as info:
        DecodeParams(adaptive_masks="yes")
    assert info.value.field == "adaptive_masks"


@pytest.mark.parametrize("mode, draft, tau, expected", [
    ("ar", "masks", 0.5, False), ("threshold", "masks", 1.0, False), ("threshold", "masks", 0.9, True),
    ("threshold", "lookup", 1.0, False), ("threshold", "lookup", 0.9, True), ("threshold", "both", 1.0, True),
    ("verify", "masks", 1.0, True), ("verify", "lookup", 1.0, False), ("verify", "both", 1.0, True),
])
def test_which_settings_feed_masks(mode, draft, tau, expected):
    assert DecodeParams(tau=tau, mode=mode, draft=draft).uses_masks(tau) is expected


@pytest.fixture(scope="module")
def tiny(tiny_bundle):
    """(backend, config, prompts) of a tiny Llama, B = W = 4, dynamic window axis."""
    ckpt, bundle = tiny_bundle("llama", 4)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    prompts = [chat_prompt_ids(tokenizer, text) for text in ("Count to ten.", "Name three colours.", "Hi")]
    backend = OnnxBackend(bundle, load_config(bundle))
    assert backend.is_window_dynamic
    return backend, load_config(bundle), prompts


def run(tiny, params, batch_size=1, prompts=None, outputs=None):
    """Generate with a spy on the backend: (token ids per prompt, decode forwards per prompt, decode-step windows
    when batch_size is 1); ``outputs``, a list, gets (window, what the step asked for: "ids", "gate" or "logits")
    of each decode step."""
    backend, config, all_prompts = tiny
    windows = []

    class Spy:  # the backend (its greedy head and gate included), recording each decode step
        def __getattr__(self, name):
            return getattr(backend, name)

        def step(self, ids, positions, mask, past, **kwargs):
            if ids.shape[1] <= config.window and not engine.scheduler.running[0].is_prefilling:
                windows.append(ids.shape[1])
                asked = "gate" if kwargs.get("confidence_tau") is not None else "ids" if kwargs else "logits"
                outputs is None or outputs.append((ids.shape[1], asked))
            return backend.step(ids, positions, mask, past, **kwargs)

    engine = Engine(backend, config, EngineConfig(max_batch_size=batch_size, prefill_chunk=256))
    engine.backend = Spy()
    results = engine.generate(prompts or all_prompts[:1], params)
    return [r.token_ids for r in results], [r.num_forwards for r in results], windows


def test_missed_probes_back_off_and_the_output_stays_that_of_masks_every_step(tiny):
    """Masks that never pass tau: the row probes with a W-token step, then runs 1, 2, 4, 8, 16, 16 .. W = 1 steps;
    the tokens are those of feeding masks every step (nothing accepted either way: greedy AR)."""
    _, config, _ = tiny
    params = DecodeParams(tau=0.9, max_new_tokens=MAX_NEW, stop_ids=frozenset())
    full, _, full_windows = run(tiny, params)
    assert set(full_windows) == {config.window}, "every masked step is W wide"
    outputs = []
    adaptive, forwards, windows = run(tiny, DecodeParams(tau=0.9, max_new_tokens=MAX_NEW, stop_ids=frozenset(),
                                                         adaptive_masks=True), outputs=outputs)
    assert adaptive == full and forwards == [MAX_NEW]
    # a step without masks reads no confidence: the greedy head's ids, as an AR step
    assert {asked for width, asked in outputs if width == 1} == {"ids"}
    assert {asked for width, asked in outputs if width > 1} <= {"gate", "logits"}
    ar, _, _ = run(tiny, DecodeParams(mode="ar", max_new_tokens=MAX_NEW, stop_ids=frozenset()))
    assert adaptive == ar
    gaps = [len(run) for run in "".join("x" if w > 1 else "." for w in windows).split("x")[1:-1]]
    assert set(windows) == {1, config.window} and windows[0] == config.window
    assert gaps == ([1, 2, 4, 8] + [16] * MAX_NEW)[:len(gaps)] and len(gaps) >= 5


def test_masks_that_always_pay_are_fed_every_step(tiny):
    """tau 0: every mask prediction passes, so no step misses: the same tokens and forwards as without backoff."""
    params = dict(tau=0.0, max_new_tokens=MAX_NEW, stop_ids=frozenset())
    full, full_forwards, full_windows = run(tiny, DecodeParams(**params))
    adaptive, forwards, windows = run(tiny, DecodeParams(**params, adaptive_masks=True))
    assert (adaptive, forwards, windows) == (full, full_forwards, full_windows)
    assert forwards[0] < MAX_NEW


@pytest.mark.parametrize("mode, draft, tau", [("verify", "masks", 1.0), ("verify", "both", 1.0),
                                              ("threshold", "both", 1.0), ("threshold", "both", 0.9)])
def test_adaptive_rows_keep_greedy_ar_where_drafts_are_verified(tiny, mode, draft, tau):
    """Verify mode and tau >= 1 stay exactly greedy AR with backoff; so does tau 0.9 here, where no mask passes."""
    _, _, prompts = tiny
    ar, _, _ = run(tiny, DecodeParams(mode="ar", max_new_tokens=MAX_NEW), prompts=prompts)
    adaptive, _, _ = run(tiny, DecodeParams(mode=mode, draft=draft, tau=tau, max_new_tokens=MAX_NEW,
                                            adaptive_masks=True), prompts=prompts)
    assert adaptive == ar


def test_an_adaptive_row_yields_the_same_beside_other_rows(tiny):
    """The backoff reads only the row's own tokens: in a batch beside rows that feed masks every step (so the step
    stays W wide), an adaptive row yields its solo tokens."""
    _, _, prompts = tiny
    adaptive = DecodeParams(tau=0.5, max_new_tokens=MAX_NEW, adaptive_masks=True)
    solo = [run(tiny, adaptive, prompts=[p])[0][0] for p in prompts]
    backend, config, _ = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=len(prompts) + 1, prefill_chunk=256))
    ids = [engine.add_request(p, adaptive) for p in prompts]
    engine.add_request(prompts[0], DecodeParams(tau=0.5, max_new_tokens=MAX_NEW))
    results = {}
    while engine.has_unfinished():
        results.update((o.request_id, o.result.token_ids) for o in engine.step() if o.finished)
    assert [results[i] for i in ids] == solo


# ------------------------------------------------------------------ where every step is W wide: refused, never ignored
def adaptive(**fields) -> DecodeParams:
    return DecodeParams(tau=0.9, max_new_tokens=8, adaptive_masks=True, **fields)


def test_the_block_scheme_refuses_adaptive_masks_and_serves_the_other_requests(tiny):
    """The block scheme runs every step W wide (it re-runs the block), so adaptive masks could not skip one: the
    request is refused, naming the scheme and the fix; the engine then runs other requests as before."""
    backend, config, prompts = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=2, scheme="block"))
    with pytest.raises(ParamError, match=r"block scheme runs every step W wide.*--scheme continuous") as info:
        engine.add_request(prompts[0], adaptive())
    assert info.value.field == "adaptive_masks" and "\n" not in str(info.value)
    assert not engine.has_unfinished()
    plain = DecodeParams(tau=0.9, max_new_tokens=8)
    assert [r.token_ids for r in engine.generate(prompts[:1], plain)] == run(tiny, plain)[0]


@pytest.fixture(scope="module")
def fixed_window(tiny_bundle, tmp_path_factory):
    """A copy of the tiny bundle whose graph has a fixed window axis, as exports before 2026-11-30."""
    _, bundle = tiny_bundle("llama", 4)
    old = fix_window(shutil.copytree(bundle, tmp_path_factory.mktemp("fixed") / "bundle"), 4)
    return old, OnnxBackend(old, load_config(old))


def test_a_fixed_window_bundle_refuses_adaptive_masks(tiny, fixed_window):
    """A graph that takes only W-token windows cannot run a step without masks: refused, naming the re-export;
    the same request on the dynamic graph runs (why_no_adaptive_masks is the one rule)."""
    backend, config, prompts = tiny
    old, fixed = fixed_window
    assert not fixed.is_window_dynamic
    with pytest.raises(ParamError, match=r"model\.onnx takes exactly W = 4 tokens per step.*re-export the bundle "
                                         r"with mars-export") as info:
        Decoder(fixed, config).generate(prompts[0], adaptive())
    assert info.value.field == "adaptive_masks"
    assert why_no_adaptive_masks(backend) is None  # the dynamic graph, continuous scheme
    assert Decoder(fixed, config).generate(prompts[0], DecodeParams(tau=0.9, max_new_tokens=8)).num_tokens == 8


def test_generate_on_a_fixed_window_bundle_with_adaptive_masks_is_one_error_line(fixed_window, capsys):
    old, _ = fixed_window
    assert generate.main([str(old), "--prompt", "hi", "--tau", "0.9", "--adaptive-masks"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and err[0].startswith("error: adaptive masks")
    assert "re-export" in err[0]
