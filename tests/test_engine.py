"""The batched engine on tiny random models: batch rows equal solo runs, verify mode equals
greedy AR, abort frees the slot at once, the live default tau, sampling with a seed, and
the cache handed to the graph without a copy."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support import real_prompts
from transformers import AutoTokenizer

from mars_export.parity import chat_prompt_ids
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config, step_feeds
from runtime.decode.admission import SettingError, check_max_batch_size, check_max_seq_len, min_seq_len
from runtime.decode.decoder import Decoder
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.params import DecodeParams
from runtime.text.tokenizer import Tokenizer
from runtime.trt_build import TrtBuildOptions, profile_limits, profile_shapes

MAX_NEW = 24


@pytest.fixture(scope="module", params=[("llama", 4), ("qwen2", 8)], ids=["llama-w4", "qwen2-w8"])
def tiny(request, tiny_bundle, shared_data):
    """(backend, config, prompts): 16 real prompts of mixed lengths, 1 to ~500 tokens."""
    ckpt, bundle = tiny_bundle(*request.param)
    config = load_config(bundle)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    prompts = [chat_prompt_ids(tokenizer, text[:300]) for _, text in real_prompts(7)]
    prompts += [[tokenizer.convert_tokens_to_ids("H")], tokenizer.encode("Hi")]  # one-token and tiny prompts
    return OnnxBackend(bundle, config), config, prompts


def solo(tiny, params):
    backend, config, prompts = tiny
    return [Decoder(backend, config).generate(p, params).token_ids for p in prompts]


@pytest.mark.parametrize("scheme", ["continuous", "block"])
@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_tau_one_batch_rows_equal_solo_runs(tiny, scheme, batch_size):
    backend, config, prompts = tiny
    params = DecodeParams(tau=1.0, max_new_tokens=MAX_NEW)
    engine = Engine(backend, config, EngineConfig(max_batch_size=batch_size, scheme=scheme))
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == solo(tiny, params)
    # the block scheme re-runs full blocks while slower rows catch up: those forwards count
    assert all(r.tpf == 1.0 if scheme == "continuous" or batch_size == 1 else r.tpf <= 1.0 for r in results)


@pytest.mark.parametrize("chunk", [0, 5, 64])
def test_prefill_forwards_give_the_tokens_of_window_prefill(tiny, chunk):
    """T-token prefill forwards (any chunk) and W-token prefill (chunk 0) decode the same ids."""
    backend, config, prompts = tiny
    assert backend.is_window_dynamic, "new exports have a dynamic window axis"
    params = DecodeParams(tau=1.0, max_new_tokens=MAX_NEW)
    results = Engine(backend, config, EngineConfig(max_batch_size=3, prefill_chunk=chunk)).generate(prompts, params)
    assert [r.token_ids for r in results] == solo(tiny, params)
    per_forward = chunk or config.window
    assert [r.num_prefill_forwards for r in results] == [-(-(len(p) - 1) // per_forward) for p in prompts]


def test_prefill_forwards_ask_the_backend_for_no_logits(tiny):
    """A prefill forward reads no logits, so it asks the backend to skip the output head; decode steps do not."""
    backend, config, prompts = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=1))
    asked = []

    class Spy:  # the real backend, recording per forward whether the row was prefilling and what was asked
        def step(self, ids, positions, mask, past, **kwargs):
            asked.append((engine.scheduler.running[0].is_prefilling, kwargs.get("logits", True)))
            return backend.step(ids, positions, mask, past, **kwargs)

    engine.backend = Spy()
    engine.generate([prompts[0]], DecodeParams(max_new_tokens=4))
    assert asked[0] == (True, False) and all(logits == (not prefilling) for prefilling, logits in asked)


def test_first_chunks_of_near_length_share_one_prefill_forward(tiny):
    """Batched prefill: rows with nothing cached whose first chunks pad to the longest by at most
    MAX_PREFILL_PADDING of the rows run one forward; a shorter one runs alone; tokens are those of solo runs."""
    backend, config, prompts = tiny
    base = next(p for p in prompts if 20 <= len(p) <= 200)
    group = [base[:len(base) // 3], base[:-1], base]  # chunks of L/3 - 1, L - 2 and L - 1 tokens
    engine = Engine(backend, config, EngineConfig(max_batch_size=3))
    prefill_shapes = []

    class Spy:  # the real backend, recording the ids' shape of each forward that reads no logits
        def step(self, ids, positions, mask, past, **kwargs):
            if not kwargs.get("logits", True):
                prefill_shapes.append(ids.shape)
            return backend.step(ids, positions, mask, past, **kwargs)

    engine.backend = Spy()
    params = DecodeParams(tau=1.0, max_new_tokens=8)
    results = engine.generate(group, params)
    assert prefill_shapes == [(2, len(base) - 1), (1, len(base) // 3 - 1)]
    assert [r.num_prefill_forwards for r in results] == [1, 1, 1]
    assert [r.token_ids for r in results] == [Decoder(backend, config).generate(p, params).token_ids for p in group]


def test_a_long_prefill_runs_one_chunk_per_step_between_decode_steps(tiny):
    """A running request keeps getting a token every step while a long prompt prefills."""
    backend, config, prompts = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=2, prefill_chunk=16))
    short = engine.add_request(prompts[-1], DecodeParams(mode="ar", max_new_tokens=MAX_NEW))
    engine.step()
    long_prompt = max(prompts, key=len)
    engine.add_request(long_prompt, DecodeParams(mode="ar", max_new_tokens=MAX_NEW))
    num_chunks = -(-(len(long_prompt) - 1) // 16)
    assert num_chunks > 5
    for _ in range(5):  # each step: one 16-token chunk of the long prompt, one token of the short request
        assert [o.request_id for o in engine.step()] == [short]
    results = {o.request_id: o.result for _ in range(200) for o in engine.step() if o.finished}
    assert len(results) == 2 and max(r.num_prefill_forwards for r in results.values()) == num_chunks


def test_ar_steps_feed_only_real_tokens_unless_a_row_can_use_masks(tiny):
    """Continuous scheme on a dynamic-window graph: AR / tau >= 1 batches run W = 1 steps, with
    the ids of full-window steps (block scheme); a threshold row widens the step to its block size."""
    backend, config, prompts = tiny
    windows = []

    class Spy:  # the real backend, recording the window of each decode step
        def step(self, ids, positions, mask, past, **kwargs):
            windows.append(ids.shape[1])
            return backend.step(ids, positions, mask, past, **kwargs)

    def run(scheme, params, extra=()):
        engine = Engine(backend, config, EngineConfig(max_batch_size=3, scheme=scheme))
        engine.backend = Spy()
        ids = [engine.add_request(p, params) for p in prompts[:3]] + [engine.add_request(p, q) for p, q in extra]
        results = {}
        while engine.has_unfinished():
            results.update((o.request_id, o.result.token_ids) for o in engine.step() if o.finished)
        return [results[i] for i in ids]

    ar = DecodeParams(mode="ar", max_new_tokens=MAX_NEW)
    full = run("block", ar)
    assert run("continuous", DecodeParams(tau=1.0, max_new_tokens=MAX_NEW)) == full
    windows.clear()
    assert run("continuous", ar) == full
    chunk = EngineConfig().prefill_chunk
    prefill = [min(chunk, len(p) - 1 - i) for p in prompts[:3] for i in range(0, len(p) - 1, chunk)]
    assert sorted(w for w in windows if w > 1) == sorted(prefill) and 1 in windows  # prefill, then W = 1 steps
    windows.clear()
    run("continuous", ar, extra=[(prompts[3], DecodeParams(tau=0.5, block_size=2, max_new_tokens=MAX_NEW))])
    decode = [w for w in windows if w <= config.window]
    assert 2 in decode and max(decode) <= 3 < config.window  # accepted tokens (<= 2) + 1 mask
    windows.clear()
    run("continuous", ar, extra=[(prompts[3], DecodeParams(tau=0.5, max_new_tokens=MAX_NEW))])
    assert config.window in windows


@pytest.mark.parametrize("scheme", ["continuous", "block"])
def test_verify_mode_equals_greedy_ar_in_a_batch(tiny, scheme):
    backend, config, prompts = tiny
    greedy = solo(tiny, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW))
    engine = Engine(backend, config, EngineConfig(max_batch_size=4, scheme=scheme))
    results = engine.generate(prompts, DecodeParams(mode="verify", max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == greedy
    gained = sum(r.num_tokens for r in results) - sum(r.num_forwards for r in results)
    assert gained >= 0
    if config.window == 8:  # random weights: on this model some drafts match, so the keep path runs too
        assert gained > 0, "no draft was ever kept: the comparison would not exercise verification"


@pytest.mark.parametrize("scheme", ["continuous", "block"])
@pytest.mark.parametrize("draft", ["lookup", "both"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_verify_mode_with_lookup_drafts_equals_greedy_ar(tiny, scheme, draft, batch_size):
    """Prompt-lookup drafts (DESIGN.md §3 "Draft sources") keep the output greedy AR, and on
    these models' looping greedy outputs they are proposed and kept."""
    backend, config, prompts = tiny
    greedy = solo(tiny, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW))
    engine = Engine(backend, config, EngineConfig(max_batch_size=batch_size, scheme=scheme))
    results = engine.generate(prompts, DecodeParams(mode="verify", draft=draft, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == greedy
    tpf = sum(r.num_tokens for r in results) / sum(r.num_forwards for r in results)
    assert tpf > 1.2, f"lookup drafts were hardly ever kept (TPF {tpf:.3f}): the test would not exercise them"


@pytest.mark.parametrize("scheme", ["continuous", "block"])
@pytest.mark.parametrize("draft", ["lookup", "both"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_threshold_mode_with_lookup_drafts_at_tau_one_equals_greedy_ar(tiny, scheme, draft, batch_size):
    """Threshold mode takes lookup drafts too (DESIGN.md §3): kept drafts are exact, so at
    tau = 1 the output is greedy AR, in fewer forwards on these models' looping outputs."""
    backend, config, prompts = tiny
    greedy = solo(tiny, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW))
    engine = Engine(backend, config, EngineConfig(max_batch_size=batch_size, scheme=scheme))
    results = engine.generate(prompts, DecodeParams(tau=1.0, draft=draft, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == greedy
    if scheme == "continuous" or batch_size == 1:  # a block-scheme batch also counts the re-runs of waiting rows
        tpf = sum(r.num_tokens for r in results) / sum(r.num_forwards for r in results)
        assert tpf > 1.2, f"lookup drafts were hardly ever kept (TPF {tpf:.3f}): the test would not exercise them"


def test_lookup_rows_feed_only_their_drafts(tiny):
    """Continuous scheme, dynamic window: a verify row drafting by lookup alone feeds its real
    token and its drafts, no masks: a W = 1 step (as cheap as AR) when it has no proposal."""
    backend, config, prompts = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=1, prefill_chunk=1024))
    windows, fed = [], []

    class Spy:  # the real backend, recording each step's window and what the row fed in it
        def step(self, ids, positions, mask, past, **kwargs):
            seq = engine.scheduler.running[0]
            if not seq.is_prefilling:
                windows.append(ids.shape[1])
                fed.append((ids[0].tolist(), seq.uncached + seq.drafts))
            return backend.step(ids, positions, mask, past, **kwargs)

    engine.backend = Spy()
    engine.generate(prompts[:1], DecodeParams(mode="verify", draft="lookup", max_new_tokens=MAX_NEW))
    assert all(ids == expected for ids, expected in fed)
    assert 1 in windows and max(windows) > 1


def test_block_scheme_accepts_multi_token_steps_and_commits_whole_blocks(tiny):
    backend, config, prompts = tiny
    params = DecodeParams(tau=0.5, max_new_tokens=MAX_NEW)
    block = Engine(backend, config, EngineConfig(max_batch_size=4, scheme="block")).generate(prompts, params)
    continuous = Engine(backend, config, EngineConfig(max_batch_size=4)).generate(prompts, params)
    assert any(r.tpf > 1 for r in block) and any(r.tpf > 1 for r in continuous)
    for r in block + continuous:
        assert r.num_tokens == MAX_NEW or r.finish_reason == "stop"


def test_continuous_batching_refills_slots_and_abort_frees_at_once(tiny):
    backend, config, prompts = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=2))
    ids = [engine.add_request(p, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW)) for p in prompts[:4]]
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (2, 2)
    engine.abort(ids[0])
    engine.abort(ids[3])  # still waiting
    assert (engine.num_running, engine.num_waiting) == (1, 1) and engine.cache.lengths[0] == 0
    finished = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o.result) for o in engine.step() if o.finished)
    assert sorted(finished) == sorted(ids[1:3])
    assert finished[ids[2]].token_ids == solo(tiny, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW))[2]


def test_live_default_tau_applies_to_requests_without_tau(tiny):
    backend, config, prompts = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=1))
    follow = DecodeParams(tau=None, max_new_tokens=MAX_NEW)
    assert engine.generate(prompts[:1], follow)[0].token_ids == solo(tiny, DecodeParams(max_new_tokens=MAX_NEW))[0]
    engine.default_tau = 0.5
    assert engine.generate(prompts[:1], follow)[0].token_ids == \
        Decoder(backend, config).generate(prompts[0], DecodeParams(tau=0.5, max_new_tokens=MAX_NEW)).token_ids
    with pytest.raises(ValueError, match="tau must be a finite number"):
        engine.default_tau = float("nan")


def test_sampling_is_reproducible_with_a_seed(tiny):
    backend, config, prompts = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=4))

    def run(seed, tau=1.0, **kw):
        return engine.generate(prompts[:3], DecodeParams(tau=tau, temperature=1.5, seed=seed, max_new_tokens=MAX_NEW,
                                                         **kw))

    first, again, other = run(1), run(1), run(2)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]
    assert all(r.tpf == 1.0 for r in first)
    greedy = solo(tiny, DecodeParams(max_new_tokens=MAX_NEW))[:3]
    assert [r.token_ids for r in run(3, top_k=1)] == greedy  # top-k 1 leaves only the argmax


def test_a_seeded_sampled_row_draws_the_same_beside_a_wider_row(tiny):
    """A seeded request sampling at tau 1 feeds one token a step; beside a tau 0.5 row the forward is B wide, and
    the request must still read (and draw a number for) only its own prediction: its tokens equal its run alone."""
    backend, config, prompts = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=2))
    sampled = DecodeParams(tau=1.0, temperature=1.5, seed=7, max_new_tokens=MAX_NEW)
    alone = engine.generate([prompts[0]], sampled)[0].token_ids
    widths = []

    class Spy:  # the real backend, recording each decode forward's width
        def step(self, ids, positions, mask, past, **kwargs):
            if kwargs.get("logits", True):
                widths.append(ids.shape[1])
            return backend.step(ids, positions, mask, past, **kwargs)

    engine.backend = Spy()
    request = engine.add_request(prompts[0], sampled)
    engine.add_request(prompts[1], DecodeParams(tau=0.5, max_new_tokens=4 * MAX_NEW))
    results = {}
    while request not in results:
        results.update((o.request_id, o.result) for o in engine.step() if o.finished)
    assert max(widths) == config.block_size > 1
    assert results[request].token_ids == alone


def test_small_temperature_accepts_no_more_than_greedy_at_the_same_tau(tiny_bundle):
    """tau < 1 with sampling tests the untempered model's confidence. This untrained model's
    mask predictions are junk that never passes tau = 0.9 greedily (TPF 1); at temperature 0.05
    they must not pass either (scored on the tempered distribution they all looked confident:
    TPF 2.5), and with top-k 1 (the draw is the argmax) the run is the greedy one."""
    _, bundle = tiny_bundle("llama", 4)
    config, tokenizer = load_config(bundle), Tokenizer(bundle)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}])
               for text in ["What is 2 + 3?", "Write a haiku about the sea.", "def add(a, b):"]]
    engine = Engine(OnnxBackend(bundle, config, num_threads=1), config, EngineConfig(max_batch_size=3))

    def run(**kw):
        return engine.generate(prompts, DecodeParams(tau=0.9, max_new_tokens=MAX_NEW, **kw))

    greedy = run()
    assert all(r.tpf == 1.0 for r in greedy)
    assert all(r.tpf == 1.0 for r in run(temperature=0.05, seed=0))
    top1 = run(temperature=0.05, top_k=1, seed=0)
    assert [(r.token_ids, r.num_forwards) for r in top1] == [(r.token_ids, r.num_forwards) for r in greedy]


def test_steps_write_the_kv_into_the_cache_in_place(tiny):
    """Every forward over committed KV is handed views of the cache itself (a later prefill chunk: the slot's;
    decode: slots 0..n-1), whole capacity, mask over the cache's indices; a decode step's presents are those
    views (the entries written in place, so its commit copies nothing); and decoding yields the ids of each
    prompt run alone. (First prefill chunks, batched, write into a scratch past: their slots are not 0..n-1.)"""
    backend, config, prompts = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=3))
    decode, prefill = [], []

    class Spy:  # the real backend, recording what each forward is handed and returns
        def step(self, ids, positions, mask, past, **kwargs):
            views = all(np.shares_memory(k, engine.cache.keys[i]) and np.shares_memory(v, engine.cache.values[i])
                        and k.shape[2] == mask.shape[-1] == engine.cache.capacity for i, (k, v) in enumerate(past))
            logits, presents = backend.step(ids, positions, mask, past, **kwargs)
            in_place = all(pk is k and pv is v for (pk, pv), (k, v) in zip(presents, past))
            (decode if kwargs.get("logits", True) else prefill).append((views, in_place, int(positions[0, 0])))
            return logits, presents

    engine.backend = Spy()
    got = engine.generate([(p * 3)[:400] for p in prompts[:3]], DecodeParams(max_new_tokens=8))  # > one 256 chunk
    assert decode and all(views and in_place for views, in_place, _ in decode)
    later_chunks = [views for views, _, start in prefill if start > 0]
    assert later_chunks and all(later_chunks)
    alone = [Engine(backend, config, EngineConfig(max_batch_size=1)).generate([(p * 3)[:400]], DecodeParams(max_new_tokens=8))[0]
             for p in prompts[:3]]
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]


def test_engines_sharing_one_backend_step_from_several_threads(tiny):
    """Each thread gets its own I/O binding of the shared session (the server's and Ray's engines share a
    backend): four engines decoding at once give each prompt's ids alone."""
    backend, config, prompts = tiny

    def decode(prompt: list[int]) -> list[int]:
        engine = Engine(backend, config, EngineConfig(max_batch_size=1))
        return engine.generate([prompt], DecodeParams(max_new_tokens=24, tau=0.7))[0].token_ids

    alone = [decode(p) for p in prompts[:4]]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(decode, prompts[:4])) == alone


def test_request_errors_name_the_problem(tiny):
    backend, config, _ = tiny
    engine = Engine(backend, config, EngineConfig(max_batch_size=1, max_seq_len=64))
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request([], DecodeParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([config.vocab_size], DecodeParams())
    with pytest.raises(ValueError, match="exceeds the 64 positions a slot can hold"):
        engine.add_request([1] * 40, DecodeParams(max_new_tokens=30))
    with pytest.raises(ValueError, match="exceeds the bundle's block size"):
        engine.add_request([1], DecodeParams(block_size=config.block_size + 1))
    assert not engine.has_unfinished()


def test_decoder_room_is_where_generate_stops_accepting(tiny_bundle):
    """Decoder.room(n) is the most new tokens generate takes after an n-token prompt (samples/demo.py refuses with
    it before any decoding): room is accepted, room + 1 refused."""
    _, bundle = tiny_bundle("llama", 4)
    config = load_config(bundle)
    decoder = Decoder(OnnxBackend(bundle, config, num_threads=1), config)
    prompt = [1] * 20
    room = decoder.room(len(prompt))
    assert room == config.max_context - config.window - len(prompt)
    with pytest.raises(ValueError, match="positions a slot can hold"):
        decoder.generate(prompt, DecodeParams(max_new_tokens=room + 1))
    assert decoder.generate(prompt, DecodeParams(max_new_tokens=room)).num_tokens >= 1


def test_max_seq_len_past_the_models_context_is_refused_on_onnxruntime(tiny_bundle):
    """One rule for every backend: onnxruntime (no optimization profile) refuses a slot longer
    than the model's max context instead of silently capping it."""
    _, bundle = tiny_bundle("llama", 4)
    config = load_config(bundle)
    backend = OnnxBackend(bundle, config, num_threads=1)
    assert Engine(backend, config, EngineConfig(max_seq_len=config.max_context)).cache.max_len == config.max_context
    with pytest.raises(ValueError, match=f"max_seq_len {config.max_context + 1} exceeds the {config.max_context} "
                                         r"positions a slot can hold \(the model's max context\)"):
        Engine(backend, config, EngineConfig(max_seq_len=config.max_context + 1))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch_size": 0}, "max_batch_size must be >= 1, got 0"),
    ({"scheme": "static"}, "scheme 'static' is not a batch scheme; choose one of"),
    ({"max_seq_len": 1}, "max_seq_len must be >= 2, got 1"),
    ({"prefill_chunk": -1}, "prefill_chunk must be >= 0"),
])
def test_engine_config_rejects_bad_values(kwargs, message):
    """Each refusal names its setting in a field (``setting``), not only in its words: a command line maps the
    field to its option (runtime.command_line.naming_options) rather than parsing the message."""
    with pytest.raises(SettingError, match=message) as caught:
        EngineConfig(**kwargs)
    assert caught.value.setting == next(iter(kwargs)) and isinstance(caught.value, ValueError)


def test_backend_limits_name_their_setting():
    """The engine's checks against the backend (a TensorRT profile, a fused bundle, the context) carry the setting
    as EngineConfig's own checks do."""
    with pytest.raises(SettingError, match="max_batch_size 3 exceeds the backend's largest batch 2") as caught:
        check_max_batch_size(3, 2)
    assert caught.value.setting == "max_batch_size"
    with pytest.raises(SettingError, match="max_seq_len 100 exceeds the 64 positions a slot can hold") as caught:
        check_max_seq_len(100, 512, 64, 4)
    assert caught.value.setting == "max_seq_len"
    with pytest.raises(SettingError, match="max_seq_len 5 leaves no room for a request: .*; give at least 6") as caught:
        check_max_seq_len(5, 512, 64, 4)
    assert caught.value.setting == "max_seq_len" and check_max_seq_len(6, 512, 64, 4) == 6


def test_the_fewest_positions_serve_a_one_token_request_and_one_fewer_is_refused(tiny_bundle):
    """--max-seq-len 2..5 on a W = 4 bundle made an engine whose every request was refused (the server's 400: 'this
    server accepts at most -3' tokens). A slot below min_seq_len(W) (a 1-token prompt, 1 token to generate and the
    W positions of a step) is refused as the engine is made, naming the least value; that value serves a request.
    The Decoder sizes its one slot to the request, at least that, so an empty prompt is still refused as one."""
    _, bundle = tiny_bundle("llama", 4)
    config = load_config(bundle)
    backend = OnnxBackend(bundle, config, num_threads=1)
    least = min_seq_len(config.window)
    engine = Engine(backend, config, EngineConfig(max_batch_size=1, max_seq_len=least))
    assert engine.room(1) == 1
    assert engine.generate([[1]], DecodeParams(max_new_tokens=1))[0].num_tokens == 1
    with pytest.raises(SettingError, match=f"max_seq_len {least - 1} leaves no room .* give at least {least}"):
        Engine(backend, config, EngineConfig(max_batch_size=1, max_seq_len=least - 1))
    with pytest.raises(ValueError, match="the prompt is empty"):
        Decoder(backend, config).generate([], DecodeParams(max_new_tokens=1))


def test_onnx_backend_names_num_threads(tiny_bundle):
    _, bundle = tiny_bundle("llama", 4)
    with pytest.raises(SettingError, match=r"num_threads must be in 0\.\.256") as caught:
        OnnxBackend(bundle, load_config(bundle), num_threads=-1)
    assert caught.value.setting == "num_threads"


class ProfileBackend:
    """TensorRT stand-in: the real onnxruntime backend behind one optimization profile
    (:func:`runtime.trt_build.profile_shapes`, W fixed) that refuses every input shape outside
    the profile's min..max, as TensorRT's ``set_input_shape`` does."""

    def __init__(self, backend, config, options: TrtBuildOptions):
        self.backend, self.shapes = backend, profile_shapes(config, options)
        self.max_batch, self.max_past = profile_limits(self.shapes.__getitem__)
        self.is_window_dynamic = False
        self.largest_past = 0  # the longest past fed so far

    def step(self, ids, positions, mask, past):
        for name, array in step_feeds(ids, positions, mask, past).items():
            low, _, high = self.shapes[name]
            if not all(lo <= dim <= hi for lo, dim, hi in zip(low, array.shape, high)):
                raise ValueError(f"input {name} of shape {array.shape} is outside the profile {low}..{high}")
        self.largest_past = max(self.largest_past, past[0][0].shape[2])
        return self.backend.step(ids, positions, mask, past)


@pytest.mark.parametrize("scheme", ["continuous", "block"])
def test_shapes_fed_stay_inside_the_backends_optimization_profile(tiny, scheme):
    """The cache capacity (the past fed) never outgrows the largest past the backend accepts,
    even when doubling would (here past the power of two 64), and the ids stay the unbounded run's."""
    backend, config, prompts = tiny
    profiled = ProfileBackend(backend, config, TrtBuildOptions(max_batch=2, max_context=100, opt_context=50))
    assert profiled.max_past == 100 < 128  # S, the capacity, holds the window too
    short = [p for p in prompts if len(p) < 40][:2]
    params = DecodeParams(tau=0.5, stop_ids=frozenset(),  # no end token: every row runs to the bound
                          max_new_tokens=profiled.max_past - config.window - max(map(len, short)))
    results = Engine(profiled, config, EngineConfig(max_batch_size=2, scheme=scheme)).generate(short, params)
    assert profiled.largest_past == profiled.max_past > 64
    unbounded = Engine(backend, config, EngineConfig(max_batch_size=2, scheme=scheme)).generate(short, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in unbounded]
    with pytest.raises(ValueError, match=f"exceeds the {profiled.max_past} positions a slot can hold"):
        Engine(profiled, config, EngineConfig(max_batch_size=2)).add_request([1] * 40, params)
    with pytest.raises(ValueError, match="max_batch_size 3 exceeds the backend's largest batch 2"):
        Engine(profiled, config, EngineConfig(max_batch_size=3))
