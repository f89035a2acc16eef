"""mars-edge's torch-free runtime: run an exported MARS bundle on onnxruntime or TensorRT.

Layout (one concern per folder; the top-level modules are the file format and the commands):
    bundle.py        the bundle's files, step-graph I/O names and config (shared with mars_export)
    decode/          the decoding core: params, acceptance, sampling, lookup drafts, sequence,
                     scheduler, KV cache, batch arrays, the engine, the one-prompt decoder
    backends/        what runs the step graph: onnxruntime, TensorRT, opening a path as a backend
    text/            tokenizer and chat template, incremental detokenizer with stop strings
    serving/         the HTTP server's parts (protocol, engine thread, request stream, load policy)
    evaluation/      ``mars-eval``: TPF and quality of bundles on GSM8K / HumanEval
    generate.py, serve.py, memory.py, trt_build.py
                     ``python -m runtime.<name>`` command-line entry points
    command_line.py  the argument parser of every command and script (a bad command line is one ``error:`` line)

Dimension letters, the same in every module of the runtime and of the reference decoder:
    n  batch rows of one forward (cache slots 0..n-1)       N  cache slots (``max_batch_size``)
    B  block size: most tokens one decode step accepts     W  window: tokens fed per decode step
    w  this step's window, <= W (a shrunk AR/verify step)   r  uncached real tokens a row feeds first
    k  drafts a row feeds after them                         M  predictions one step offers a row (w - r + 1)
    T  prompt tokens of one prefill forward                  P  committed positions of a slot (its length)
    S  cache capacity (positions per slot)                   C  context length in tokens (memory sizing)
    V  vocabulary    L  layers    H  KV heads    D  head dim    d  hidden size    I  MLP width
"""
