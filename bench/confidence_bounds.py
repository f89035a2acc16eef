"""How many threshold-mode steps could take their tau decisions from the greedy head's screening, exactly.

    python bench/confidence_bounds.py [MODEL] [--taus 0.9 0.7 0.5] [--num-prompts 10] [--max-new-tokens 96]
                                      [--block 4] [--mask-token TOKEN] [--out bench/results] [--name confidence_bounds]
                                      [--force]

Dimension letters: K hidden size, V vocabulary, W window, M predictions of a step.

A float32 step graph reads the int8 screening copy of the output head when every row of a step only needs
its argmax (tau >= 1: ``mars_export.greedy_head``), and the whole float32 head when a confidence is tested
(tau < 1): 113 MB of SmolLM2-135M's 540 MB per step. This script measures, without building it, how often the
probability metric's test ``p > tau`` (``runtime.decode.acceptance``) could be decided from what the greedy
head already computes, with bounds that hold for the logits path's own numbers:

- the screening logits ``a_v`` and their error bounds ``e_v`` (the greedy head's, ``|a_v - x·W_v| <= e_v``);
- the candidates ``C`` (``a_v + e_v`` reaching ``max_u (a_u - e_u)``), whose logits the greedy head rescores
  in float32; a float32 dot product over K terms is within ``gamma_K · Σ|x_k||W_kv| <= gamma_K |x|_1 max|W_v|``
  of the exact one (``gamma_K = K u / (1 - K u)``, u = 2^-24), so the rescored and the full head's logit of v
  lie within ``s_v = 2 gamma_K |x|_1 max|W_v|`` of each other;
- so every full-head logit lies in ``[lower_v, upper_v]``: a candidate's in ``r_c ± s_c``, another's in
  ``a_v ± (e_v + s_v / 2)``, whose upper end lies below ``max_u (a_u - e_u) + max_v s_v / 2``. The largest
  logit ``max f`` is thus at least ``L`` and at most ``U``:

      L = max_v lower_v
      U = max(max_c (r_c + s_c), max_u (a_u - e_u) + max_v s_v / 2)

  (not the rescored top ``r* ± s*``: under cancellation another candidate's logit may lie up to its own ``s_c``
  above its rescored one, e.g. 1e7 - 1e7 + 0.5, which a float32 rescoring in another order gives as 0 with
  ``s_c`` 76; ``tests/test_confidence_bounds.py``), and each term of ``Z = Σ_v exp(f_v - max f)`` lies in
  ``[exp(lower_v - U), exp(upper_v - L)]``, so ``p = 1 / Z`` lies in ``[p_lb, p_ub]``:

      p_ub = min(1, (1 + slack(V)) / Σ_v exp(lower_v - U - margin(U)))     mars_export.confidence_gate's bound
      p_lb = (1 - slack(V)) / Σ_v exp(upper_v - L + margin(L))            the same, widened the other way

  with the gate's ``margin(y) = 1e-6 |y| + 1e-4`` for the float32 rounding of the runtime's exponents
  ``f_v - max f`` and ``slack(V) = 2 V u + 1e-5`` (:func:`mars_export.confidence_gate.slack`) for its float32
  exponentials, its sum over V and its division (``1 - slack <= 1 / (1 + slack)``). Here ``r_c`` is ``x·W_c`` in
  float64, within ``s_c / 2`` of the full head's logit (a float32 rescoring is within ``s_c``), and ``s_v`` takes
  the float64 ``|x|_1`` (the gate allows for its float32 rounding).

A read row is decided when ``p_ub <= tau`` (rejected) or ``p_lb > tau`` (accepted); a step needs the full
head when one of the rows the acceptance rule reads is undecided. The mask token is excluded, as on both
paths. Every row also checks ``p_lb <= p <= p_ub`` against the exact float64 probability (``violations``
must be 0).

The steps are those of the PyTorch reference decoder (``mars_export.reference.ReferenceDecoder``, batch 1,
masks only: the paper's threshold decoding) on chat-formatted GSM8K and HumanEval prompts from the shared
data folder, alternating; the rows read are the ones :func:`runtime.decode.acceptance.count_accepted`
reads. The screening logits come from onnxruntime's ``MatMulNBits`` with the greedy head's constants.

Writes {name}.json (command, model, rows), {name}.csv (one row per tau) and {name}.png (per tau, the share
of steps that would still read the float32 head) to --out (refusing to replace an earlier run's without
--force), and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
from results_files import add_results_options, check_results, write_results  # noqa: E402
from support import shared_data_file, shared_data_missing  # noqa: E402

from mars_export.confidence_gate import MARGIN_ABSOLUTE, MARGIN_RELATIVE, UNIT, slack  # noqa: E402
from mars_export.default_model import check_model_spec  # noqa: E402
from runtime.command_line import ArgumentParser, UsageError, make_taus_value, run_main  # noqa: E402


def screening_session(weight: np.ndarray):
    """An onnxruntime session of the greedy head's screening MatMulNBits over ``weight`` float32 [K, V], and the
    bound coefficients (per_l1, per_block_max) float32 [V] each."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from mars_export.greedy_head import BLOCK, bound_coefficients, quantize_columns

    k, v = weight.shape
    packed, scales, dequantized = quantize_columns(weight)
    node = helper.make_node("MatMulNBits", ["x", "weight_q", "scales"], ["approx"], domain="com.microsoft",
                            K=k, N=v, bits=8, block_size=BLOCK, accuracy_level=4)
    graph = helper.make_graph([node], "screening", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("approx", TensorProto.FLOAT, [None, v])],
                              [numpy_helper.from_array(packed, "weight_q"), numpy_helper.from_array(scales, "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session, bound_coefficients(weight, dequantized)


def probability_bounds(x: np.ndarray, weight: np.ndarray, session, coefficients, mask_token_id: int):
    """Per row of ``x`` float32 [M, K]: (ids, p, p_lb, p_ub) [M] each: the argmax of the full head's logits and
    its exact probability (float64, mask token excluded), and the bounds from the screening (module docstring)."""
    from mars_export.greedy_head import ABSOLUTE_SLACK, BLOCK

    per_l1, per_block_max = coefficients
    k = x.shape[1]
    exact = x.astype(np.float64) @ weight.astype(np.float64)  # [M, V]
    exact[:, mask_token_id] = -np.inf
    approx = session.run(None, {"x": x})[0].astype(np.float64)
    magnitude = np.abs(x).astype(np.float64)
    l1 = magnitude.sum(axis=1, keepdims=True)  # [M, 1]
    error = l1 * per_l1 + magnitude.reshape(len(x), -1, BLOCK).max(axis=2).sum(axis=1, keepdims=True) * per_block_max
    error = error + ABSOLUTE_SLACK  # e_v [M, V]
    rescoring = 2 * (k * UNIT / (1 - k * UNIT)) * l1 * np.abs(weight).max(axis=0)  # s_v [M, V]
    approx[:, mask_token_id], error[:, mask_token_id] = -np.inf, 0.0
    p = 1.0 / np.exp(exact - exact.max(axis=1, keepdims=True)).sum(axis=1)  # [M]
    return (exact.argmax(axis=1), p, *screening_bounds(approx, error, exact, rescoring))


def screening_bounds(approx: np.ndarray, error: np.ndarray, rescored: np.ndarray, rounding: np.ndarray):
    """(p_lb, p_ub) [M] each of every row's top-1 probability from its screening (module docstring).

    Args:
        approx: float64 [M, V], the screening logits ``a_v`` (the mask token's -inf).
        error: float64 [M, V], their error bounds ``e_v`` (the mask token's 0).
        rescored: float64 [M, V], the rescored logits ``r_v``; only the candidates' are read.
        rounding: float64 [M, V], the float32 rounding bounds ``s_v``.
    """
    best_lower = (approx - error).max(axis=1, keepdims=True)  # [M, 1]
    is_candidate = approx + error >= best_lower  # [M, V]
    # a non-candidate's full-head logit lies within e_v of x·W_v (the screening's bound) plus s_v / 2 (float32)
    lower = np.where(is_candidate, rescored - rounding, approx - error - rounding / 2)  # [M, V]
    upper = np.where(is_candidate, rescored + rounding, approx + error + rounding / 2)  # [M, V]
    largest = np.maximum(np.where(is_candidate, upper, -np.inf).max(axis=1, keepdims=True),
                         best_lower + rounding.max(axis=1, keepdims=True) / 2)  # [M, 1]: max f <= this
    smallest = lower.max(axis=1, keepdims=True)  # [M, 1]: max f >= this
    widening = slack(approx.shape[1])
    with np.errstate(over="ignore", divide="ignore"):
        z_lb = np.exp(lower - (largest + margin(largest))).sum(axis=1)  # [M]
        z_ub = np.exp(upper - (smallest - margin(smallest))).sum(axis=1)  # [M]
        return (1 - widening) / z_ub, np.minimum(1, (1 + widening) / z_lb)


def margin(logit: np.ndarray) -> np.ndarray:
    """The exponent margin of :mod:`mars_export.confidence_gate`, ``1e-6 |logit| + 1e-4``: float32 rounding of the
    runtime's ``f_v - max f``."""
    return MARGIN_RELATIVE * np.abs(logit) + MARGIN_ABSOLUTE


class RecordedConfidences:
    """The exact confidences [M] as :func:`runtime.decode.acceptance.count_accepted` reads them, noting each row read."""

    def __init__(self, values: np.ndarray):
        self.values, self.read = values, []

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, row: int) -> np.float32:
        self.read.append(row)
        return np.float32(self.values[row])


def run(args: argparse.Namespace) -> list[dict]:
    """One row per tau: the reference decoder's steps and how many of them the bounds decide."""
    from mars_export.bundle_writer import prepare_config
    from mars_export.greedy_head import BLOCK
    from mars_export.model_source import load_model
    from mars_export.reference import ReferenceDecoder
    from runtime.decode.acceptance import count_accepted
    from runtime.decode.params import DecodeParams
    from runtime.evaluation.tasks import load_gsm8k, load_humaneval

    loaded = load_model(args.model, args.mask_token)
    model, tokenizer, mask_id = loaded.model.eval(), loaded.tokenizer, loaded.mask_token_id
    weight = np.ascontiguousarray(model.get_output_embeddings().weight.detach().float().numpy().T)  # [K, V]
    if weight.shape[0] % BLOCK:
        raise UsageError(f"hidden size {weight.shape[0]} is not a multiple of {BLOCK}: the greedy head (and so this "
                         "measurement) needs one; give another model")
    session, coefficients = screening_session(weight)
    half = (args.num_prompts + 1) // 2
    items = [x for pair in zip(load_gsm8k(shared_data_file("gsm8k/test.jsonl"), half),
                               load_humaneval(shared_data_file("humaneval/HumanEval.jsonl.gz"), half)) for x in pair]
    prompts = [tokenizer(tokenizer.apply_chat_template(item.messages(), add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"] for item in items[:args.num_prompts]]
    forwards: list[tuple[list[int], np.ndarray]] = []  # (window ids [W], head input [W, K]) per forward
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, output: forwards.append((None, inputs[0][0].detach().float().numpy())))
    pre = model.register_forward_pre_hook(
        lambda module, a, kw: forwards.append(((a[0] if a else kw["input_ids"])[0].tolist(), None)), with_kwargs=True)
    stop_ids = prepare_config(loaded, args.block, args.block).eos_token_ids
    decoder = ReferenceDecoder(model, args.block, args.block, mask_id, stop_ids)
    rows = []
    try:
        for tau in args.taus:
            counts = dict(steps=0, steps_reading_head=0, rows_read=0, rejected=0, accepted=0, undecided=0,
                          violations=0, tokens=0)
            for prompt in prompts:
                forwards.clear()
                result = decoder.generate(prompt, DecodeParams(tau=tau, max_new_tokens=args.max_new_tokens))
                counts["tokens"] += result.num_tokens
                pairs = [(forwards[i][0], forwards[i + 1][1]) for i in range(0, len(forwards), 2)]
                generated = 0
                for window_ids, hidden in pairs[1 if len(prompt) > 1 else 0:]:  # the prefill forward has no decision
                    num_real = sum(t != mask_id for t in window_ids)
                    x = np.ascontiguousarray(hidden[num_real - 1:])  # [M, K]: the AR prediction, then the masks'
                    ids, p, p_lb, p_ub = probability_bounds(x, weight, session, coefficients, mask_id)
                    recorded = RecordedConfidences(p)
                    budget = min(args.block, args.max_new_tokens - generated)
                    generated += count_accepted(ids, recorded, tau, budget, frozenset(stop_ids))
                    counts["steps"] += 1
                    undecided = False
                    for row in recorded.read:
                        counts["rows_read"] += 1
                        counts["violations"] += not p_lb[row] <= p[row] <= p_ub[row]
                        if p_ub[row] <= tau:
                            counts["rejected"] += 1
                        elif p_lb[row] > tau:
                            counts["accepted"] += 1
                        else:
                            counts["undecided"] += 1
                            undecided = True
                    counts["steps_reading_head"] += undecided
            rows.append({"tau": tau, **counts, "tpf": counts["tokens"] / max(counts["steps"], 1),
                         "share_reading_head": counts["steps_reading_head"] / max(counts["steps"], 1)})
            print(f"tau {tau}: {rows[-1]}", flush=True)
    finally:
        hook.remove()
        pre.remove()
    return rows


def main() -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="default-mars", help="model spec of mars-export (default default-mars)")
    p.add_argument("--taus", type=make_taus_value("--taus"), nargs="+", default=[0.9, 0.7, 0.5])
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--block", type=int, default=4, help="block size B = window W of the reference decoder")
    p.add_argument("--mask-token", default=None, help="as mars-export's --mask-token")
    add_results_options(p, "confidence_bounds")
    args = p.parse_args()
    if shared_data_missing():
        p.error(shared_data_missing())
    if any(tau >= 1 for tau in args.taus) or args.block < 2:  # make_taus_value refused the rest
        p.error("each --taus value must be below 1 (at 1 no confidence is tested) and --block at least 2")
    check_results(args)
    try:
        check_model_spec(args.model)
    except ValueError as e:  # no such file, or a folder that is no checkpoint
        p.error(str(e))
    rows = run(args)
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "model": args.model,
            "command": "python bench/confidence_bounds.py " + " ".join(sys.argv[1:])}
    write_results(args.out, args.name, {"meta": meta, "rows": rows}, rows, lambda path: plot(rows, path))
    print("\n| tau | steps | TPF | rows read | rejected by p_ub | accepted by p_lb | undecided | steps reading the head |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tau']} | {r['steps']} | {r['tpf']:.2f} | {r['rows_read']} | {r['rejected']} | {r['accepted']} | "
              f"{r['undecided']} | {r['steps_reading_head']} ({r['share_reading_head']:.1%}) |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(r["tau"]) for r in rows], [100 * r["share_reading_head"] for r in rows])
    ax.set(xlabel="tau", ylabel="% of steps", title="steps that still read the float32 head")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(run_main(main))
