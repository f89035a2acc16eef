"""The export bundle: file names, ONNX I/O names and the versioned JSON config (DESIGN.md §5).

This module is the one place where the I/O names of the step graph live; the exporter
(`mars_export`) and every runtime backend import them from here.

Step graph I/O (n batch rows, W window, S KV cache capacity, H KV heads, D head dim, V vocab; n, S
and, in exports since 2026-11-30, W are dynamic axes):
    inputs   input_ids                  int64 [n, W]
             position_ids               int64 [n, W]             each < S: where the entry is written
             attention_mask             bool  [n, 1, W, S]       True = query may see the key at that
                                        cache index (the window's own keys at their positions)
             past_key_values.{i}.key    dtype [n, H, S, D]       (i = layer index) the KV cache, position
             past_key_values.{i}.value  dtype [n, H, S, D]       p at index p
             num_logits                 int64 []                 optional (a default: all W rows); exports since
                                        2026-12-02: logits of the last min(num_logits, W) rows only
    outputs  logits                     float32 [n, W, V]        (float32 in fp16 exports too; [n, min(num_logits, W), V])
             present.{i}.key            dtype [n, H, S, D]       the past with entry j of row b written at
             present.{i}.value          dtype [n, H, S, D]       index position_ids[b, j]
A runtime binds each present to its past's buffer (I/O binding) and the step writes its W entries into
the cache in place (exports since 2026-12-02, twelfth session; older step graphs output only the W new entries and
:func:`check_kv_in_place` refuses them).

Fused graph (``graph: "fused"``, GitHub issue 11): onnxruntime-genai's model-builder graph of the
same weights (GroupQueryAttention), batch 1, the KV cache one buffer [1, H, S, D] per layer and
name bound as both past and present (:mod:`runtime.backends.fused`):
    inputs   input_ids                  int64 [1, W]
             attention_mask             int64 [1, P + W]         ones: causal over all P + W
             past_key_values.{i}.key    float32 [1, H, S, D]     (and .value)
             num_logits                 int64 []                 as in the step graph, but required (no default)
             num_greedy                 int64 []                 float32 bundles: the greedy head, required
             confidence_tau             float32 [1]              float32 bundles since the twenty-eighth session:
                                                                 the confidence gate, required (-1: never skips)
    outputs  logits                     float32 [1, W, V]
             present.{i}.key            float32 [1, H, S, D]     the same buffer, W entries written at P
             greedy_ids, head_skipped                            with num_greedy, confidence_tau
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

FORMAT_VERSION = 1
CONFIG_FILE = "mars_config.json"
ONNX_FILE = "model.onnx"
ENGINE_FILE = "engine.plan"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
LOGITS = "logits"
NUM_LOGITS = "num_logits"  # optional: logits of the window's last rows only (mars_export.logits_rows)
NUM_GREEDY, GREEDY_IDS = "num_greedy", "greedy_ids"  # optional: argmax ids of the last rows (mars_export.greedy_head)
GREEDY_HEAD_PREFIX = "/mars_edge/greedy_head"  # the names of the greedy head's nodes and initializers begin so
# optional: a threshold step skips the float32 head where tau tests provably fail (mars_export.confidence_gate)
CONFIDENCE_TAU, HEAD_SKIPPED = "confidence_tau", "head_skipped"
# The most rows (batch x window) a forward asks the greedy head for. Its rescoring takes the union of the rows'
# candidates against every row, so it grows with the rows: on the default model (2-core EPYC, P 128) the greedy
# step with the head / reading the logits was 0.87-0.99x at 1-8 rows in two runs, 1.03-1.07x at 16, 1.21x at 32,
# 1.32x at 64 (BENCHMARKS.md, nineteenth session). Above it the engine reads the logits.
GREEDY_HEAD_MAX_ROWS = 8
DTYPES = ("float32", "float16")
# Weight storage: the dtype itself, or weight-only int8/int4 (MatMulNBits) over float32 activations.
WEIGHT_DTYPES = ("float32", "float16", "int8", "int4")
# The step graph (ours, any batch, any backend) or the fused model-builder graph (batch 1, onnxruntime CPU).
GRAPHS = ("step", "fused")
# What a bundle is, for the messages of a path that is none.
WHAT_A_BUNDLE_IS = (f"a MARS bundle is the folder mars-export writes ({CONFIG_FILE}, the ONNX graph, the tokenizer "
                    "files); make one with 'mars-export MODEL -o DIR'")


class BundleError(ValueError):
    """A bundle is missing a file, malformed, or of another format version."""


MAX_INLINE_BYTES = 2 * 1024**3 - 1  # protobuf's limit for one file: a larger graph keeps its weights apart


def external_data_file(onnx_file: str) -> str:
    """The file holding an ONNX graph's weights when they are saved apart from it (step exports over 1.5 GiB of
    weights, torch's threshold; fused and quantized graphs over 2 GiB, protobuf's limit)."""
    return onnx_file + ".data"


def past_names(layer: int) -> tuple[str, str]:
    """Names of the key and value inputs of ``layer``."""
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    """Names of the key and value outputs of ``layer`` (the cache with the new entries written)."""
    return f"present.{layer}.key", f"present.{layer}.value"


def step_feeds(input_ids, position_ids, attention_mask, past) -> dict:
    """Name -> array for one step: the three window inputs, then each layer's past (key, value)."""
    feeds = {INPUT_IDS: input_ids, POSITION_IDS: position_ids, ATTENTION_MASK: attention_mask}
    for i, (key, value) in enumerate(past):
        key_name, value_name = past_names(i)
        feeds[key_name], feeds[value_name] = key, value
    return feeds


def check_kv_in_place(past_shape: list, present_shape: list, path) -> None:
    """Refuse a step graph whose KV outputs are not its KV inputs written in place.

    Args:
        past_shape, present_shape: the declared shapes of ``past_key_values.0.key`` and ``present.0.key``
            (symbols as strings, as onnxruntime reports them).
        path: the graph file, for the message.

    Raises:
        BundleError: the present's position axis is not the past's (an older step graph, whose
            presents hold only the W new entries).
    """
    if present_shape[2] != past_shape[2]:
        raise BundleError(f"{path} is an older step graph that outputs only the window's new KV entries (this runtime "
                          "writes them into the KV cache in place); re-export the bundle with mars-export")


ONNX_KV_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)"}  # the KV element type of each dtype


def check_graph_fits_config(past_shape: list, logits_shape: list, config: "BundleConfig", path,
                            fix: str = "re-export the bundle") -> None:
    """Refuse a graph whose KV cache or logits shapes disagree with ``mars_config.json`` (its layer count is
    checked by the I/O names), before any forward: a disagreeing config would otherwise fail at the first step.

    The one rule for every backend: onnxruntime passes its session's declarations, TensorRT its engine's
    (:mod:`runtime.backends.trt`, a dynamic axis as a symbol). The KV dtype each backend checks with its
    tensor types (onnxruntime: :data:`ONNX_KV_TYPES`; TensorRT: every I/O tensor's dtype).

    Args:
        past_shape: the declared shape of ``past_key_values.0.key`` [n, H, S, D] (symbols as strings, as
            onnxruntime reports them).
        logits_shape: the declared shape of ``logits`` [n, W, V].
        config: the bundle's config.
        path: the graph file, for the message.
        fix: what the message tells the user to do.

    Raises:
        BundleError: H, D or V declared as a number other than the config's.
    """
    declared = {"num_kv_heads": past_shape[1], "head_dim": past_shape[3], "vocab_size": logits_shape[-1]}
    for name, dim in declared.items():
        if isinstance(dim, int) and dim != getattr(config, name):
            raise BundleError(f"{path} has {name} {dim} but {CONFIG_FILE} says {getattr(config, name)}; {fix}")


def check_step_inputs(input_ids, position_ids, attention_mask, past, num_layers: int) -> None:
    """Refuse step inputs that do not fit the step graph's I/O (above), before a backend runs them.

    Args:
        input_ids, position_ids: [n, W]; attention_mask: [n, 1, W, S]; past: per layer (key, value)
            [n, H, S, D] (any arrays with ``shape``: numpy, or a device backend's tensors).
        num_layers: the model's layers.

    Raises:
        ValueError: shapes that disagree (the message names both), a past of another layer count, or a
            position outside 0..S-1 (the step writes each new entry at its position).
    """
    n, window = input_ids.shape
    capacity = past[0][0].shape[2] if past else 0
    if len(past) != num_layers:
        raise ValueError(f"the past has {len(past)} layers but the model has {num_layers}")
    if tuple(position_ids.shape) != (n, window) or tuple(attention_mask.shape) != (n, 1, window, capacity):
        raise ValueError(f"step inputs disagree: input_ids {tuple(input_ids.shape)}, position_ids "
                         f"{tuple(position_ids.shape)}, attention_mask {tuple(attention_mask.shape)} for a past of "
                         f"{capacity} positions; expected [n, W], [n, W], [n, 1, W, S]")
    shape = tuple(past[0][0].shape)
    if shape[0] != n or any(tuple(array.shape) != shape for pair in past for array in pair):
        raise ValueError(f"every past array must be [n, H, S, D] = [{n}, H, {capacity}, D] like the first, "
                         f"{shape}; got {sorted({tuple(a.shape) for pair in past for a in pair})}")
    if position_ids.size and (position_ids.min() < 0 or position_ids.max() >= capacity):
        raise ValueError(f"positions {position_ids.min()}..{position_ids.max()} do not fit a past of {capacity} "
                         "positions: the step writes each new KV entry at its position, so give the past room "
                         "for the window (KVCache.reserve)")


def input_names(num_layers: int) -> list[str]:
    """All step-graph input names, in graph order."""
    kv = [name for i in range(num_layers) for name in past_names(i)]
    return [INPUT_IDS, POSITION_IDS, ATTENTION_MASK, *kv]


def output_names(num_layers: int) -> list[str]:
    """All step-graph output names, in graph order."""
    kv = [name for i in range(num_layers) for name in present_names(i)]
    return [LOGITS, *kv]


def has_greedy_head(config: "BundleConfig") -> bool:
    """Whether the bundle's graph has the greedy head (mars_export.greedy_head: onnxruntime's 8-bit MatMulNBits,
    which TensorRT does not parse): the export measured it (``parity.greedy_head_agreement``).

    The export's record, read where the graph is not loaded (:func:`runtime.trt_build.graph_for_tensorrt` decides
    from it whether the onnx package is needed to strip the head). A backend that has the graph loaded asks the
    graph itself (``num_greedy`` among its inputs); the two agree on every export, and a graph stripped by
    :func:`strip_greedy_head` gets a config without the key (:mod:`mars_export.quantize`)."""
    return "greedy_head_agreement" in (config.parity or {})


def why_no_confidence_gate(config: "BundleConfig", provider: str = "cpu") -> str:
    """Why a backend over this bundle on ``provider`` has no confidence gate (mars_export.confidence_gate), and what
    to do: the end of the message that refuses a step asked for ``confidence_tau``.

    The gate comes with the greedy head, which only float32 exports get (not --fp16, --int8, --int4 nor --trt;
    re-exporting such a bundle never adds it) and only onnxruntime's cpu provider runs. A float32 bundle without it
    was exported before the gate existed (float32 step graphs since the twenty-seventh session, fused since the
    twenty-eighth) and gets it by being exported again, unless its model never gets it: one whose logits pass an op
    after the output head (Gemma2's soft-capping: mars_export.confidence_gate.add_confidence_gate), or, without the
    greedy head (:func:`has_greedy_head`), one whose hidden size is no multiple of the head's int8 block (32). The
    config cannot tell these apart, so the message names both.
    """
    without = "or decode without the gate (leave confidence_tau out)"
    if config.weight_dtype != "float32":
        flag = "--fp16" if config.weight_dtype == "float16" else f"--{config.weight_dtype}"
        return (f"the gate exists only on float32 bundles and this one is {config.weight_dtype} (a {flag} export "
                f"never has it, so exporting it again does not add it): use a float32 bundle (mars-export without "
                f"{flag}), {without}")
    if provider != "cpu":
        return f"the gate runs on the cpu provider only, not {provider}: use the cpu provider, {without}"
    if config.engine_file is not None:
        return (f"a bundle exported with --trt has no gate (TensorRT parses no greedy head): export the float32 bundle "
                f"again without --trt, {without}")
    graph = " --graph fused" if config.graph == "fused" else ""
    if has_greedy_head(config):
        return (f"this float32 bundle has the greedy head but no gate: either it was exported before the gate existed "
                f"(re-export it with mars-export{graph}), or its model changes the logits after the output head "
                f"(Gemma2's final_logit_softcapping), which the gate cannot bound and exporting again does not change; "
                f"{without}")
    return (f"this float32 bundle has no greedy head, which the gate tests: either it was exported before the head "
            f"existed (re-export it with mars-export{graph}), or its model's hidden size is no multiple of 32 (the "
            f"head's int8 blocks), which exporting again does not change; {without}")


def check_confidence_tau(confidence_tau, greedy_ids: bool, why_no_gate: str | None) -> None:
    """Raise ValueError where a step is asked for ``confidence_tau`` (the confidence gate's input) that it cannot take:
    without ``greedy_ids`` (the gate tests the greedy head's rows), or on a graph without the gate, ``why_no_gate``
    (:func:`why_no_confidence_gate`; None where the graph has the gate) saying why it has none and what to do."""
    if confidence_tau is None:
        return
    if not greedy_ids:
        raise ValueError("confidence_tau needs greedy_ids=True: the confidence gate tests the greedy head's rows")
    if why_no_gate is not None:
        raise ValueError(f"this bundle has no confidence gate (confidence_tau input): {why_no_gate}")


def strip_greedy_head(model) -> None:
    """Remove the greedy head (mars_export.greedy_head) and its confidence gate (mars_export.confidence_gate) from
    ``model`` (an onnx ModelProto), in place: their nodes and initializers (named from :data:`GREEDY_HEAD_PREFIX`),
    the ``num_greedy`` and ``confidence_tau`` inputs and the ``greedy_ids`` and ``head_skipped`` outputs; a gate
    node on the model's own path (named ``.../bypass``) is replaced by its first input. The graph is then the
    step graph as ``mars-export --trt`` writes it (for TensorRT, :func:`runtime.trt_build.graph_for_tensorrt`;
    for weight-only quantizing, :mod:`mars_export.quantize`)."""
    graph, prefix = model.graph, GREEDY_HEAD_PREFIX + "/"
    removed_inputs, removed_outputs = {NUM_GREEDY, CONFIDENCE_TAU}, {GREEDY_IDS, HEAD_SKIPPED}
    renamed = {}  # a bypassed node's output -> its first input
    for node in graph.node:
        if node.name.startswith(prefix) and node.name.endswith("/bypass"):
            renamed[node.output[0]] = node.input[0]
    outputs_named = {value.name for value in graph.output}
    nodes = [node for node in graph.node if not node.name.startswith(prefix)]
    for bypassed, source in renamed.items():
        if bypassed in outputs_named:  # the producer of the source writes the graph output again
            old, new = source, bypassed
        else:
            old, new = bypassed, source
        for node in nodes:
            node.input[:] = [new if name == old else name for name in node.input]
            node.output[:] = [new if name == old else name for name in node.output]
    initializers = [t for t in graph.initializer if not t.name.startswith(prefix) and t.name not in removed_inputs]
    inputs = [value for value in graph.input if value.name not in removed_inputs]
    outputs = [value for value in graph.output if value.name not in removed_outputs]
    produced = {name for node in nodes for name in node.output}
    value_info = [value for value in graph.value_info if value.name in produced]
    for field, kept in ((graph.node, nodes), (graph.initializer, initializers), (graph.input, inputs),
                        (graph.output, outputs), (graph.value_info, value_info)):
        del field[:]
        field.extend(kept)
    if not any(node.domain == "com.microsoft" for node in graph.node):
        opsets = [opset for opset in model.opset_import if opset.domain != "com.microsoft"]
        del model.opset_import[:]
        model.opset_import.extend(opsets)


def fused_io_names(num_layers: int) -> tuple[set[str], set[str]]:
    """The fused graph's input and output names (its order is the model builder's; ``num_logits``, the greedy
    head's and the confidence gate's not counted: older fused graphs and quantized ones lack them)."""
    inputs = {INPUT_IDS, ATTENTION_MASK} | {name for i in range(num_layers) for name in past_names(i)}
    return inputs, set(output_names(num_layers))


@dataclass(frozen=True)
class BundleConfig:
    """Everything a runtime needs to know about a bundle besides the graph and tokenizer.

    Attributes:
        block_size: B, the most tokens one decode step may accept (MARS §3).
        window: W, tokens fed per decode step (W >= B); graphs exported since 2026-11-30
            also take other lengths (prefill, AR steps).
        mask_token / mask_token_id: the MARS mask token (DESIGN.md §1).
        eos_token_ids: ids that end generation (a model may list several).
        pad_token_id: id fed at window positions whose output is ignored.
        bos_token_id: beginning-of-sequence id, or None.
        num_layers, num_kv_heads, head_dim, vocab_size: model shape.
        max_context: largest position + 1 the model supports (tokens).
        dtype: weight/activation/KV dtype, "float32" or "float16"; logits are float32.
        source_model: where the weights came from.
        onnx_file: step graph file name inside the bundle.
        engine_file: TensorRT engine built from it (``engine.plan``), or None; optional
            in the JSON (bundles without an engine omit it), so format version 1 holds.
        weight_dtype: how the graph stores its weights, one of WEIGHT_DTYPES; None (the
            default) means ``dtype``. ``int8``/``int4`` (weight-only, float32 activations)
            need ``dtype`` float32. Written to the JSON only when it differs from ``dtype``.
        parity: results of the export-time parity check against PyTorch.
        format_version: bundle format; a runtime refuses other versions.
        graph: one of GRAPHS: ``step`` (the default, omitted from the JSON) or ``fused``
            (batch 1, onnxruntime CPU; float32 activations and KV).
    """

    block_size: int
    window: int
    mask_token: str
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    bos_token_id: int | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    dtype: str
    source_model: str
    onnx_file: str = ONNX_FILE
    engine_file: str | None = None
    weight_dtype: str | None = None
    parity: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    graph: str = "step"

    def __post_init__(self):
        self._check_types()
        if self.format_version != FORMAT_VERSION:
            raise BundleError(f"bundle format version {self.format_version} is not supported by this runtime "
                              f"(it reads version {FORMAT_VERSION}); re-export the bundle with this version's mars-export")
        if not 1 <= self.block_size <= self.window:
            raise BundleError(f"block_size must be in 1..window ({self.window}), got {self.block_size}")
        if self.dtype not in DTYPES:
            raise BundleError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "weight_dtype", self.weight_dtype or self.dtype)
        quantized = self.weight_dtype not in DTYPES
        if self.weight_dtype not in WEIGHT_DTYPES or (quantized and self.dtype != "float32") \
                or (not quantized and self.weight_dtype != self.dtype):
            raise BundleError(f"weight_dtype {self.weight_dtype!r} does not fit dtype {self.dtype!r}: use the dtype "
                              "itself, or int8/int4 with dtype float32")
        if self.graph not in GRAPHS or (self.graph == "fused" and self.dtype != "float32"):
            raise BundleError(f"graph {self.graph!r} with dtype {self.dtype!r}: the graph is one of {GRAPHS}, "
                              "and a fused graph runs float32 activations; re-export the bundle")
        if not self.eos_token_ids:
            raise BundleError("eos_token_ids is empty: generation could never stop at an end token")
        for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_context"):
            if getattr(self, name) < 1:
                raise BundleError(f"{name} must be positive, got {getattr(self, name)}")
        ids = {"mask_token_id": self.mask_token_id, "pad_token_id": self.pad_token_id,
               **{f"eos_token_ids[{i}]": t for i, t in enumerate(self.eos_token_ids)}}
        for name, token_id in ids.items():
            if not 0 <= token_id < self.vocab_size:
                raise BundleError(f"{name} {token_id} is outside the vocabulary (0..{self.vocab_size - 1}); "
                                  "re-export the bundle")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    def _check_types(self) -> None:
        """Refuse a field of the wrong JSON type (a float, a boolean or a string where an integer belongs)."""
        def is_int(value) -> bool:
            return type(value) is int

        def is_str(value) -> bool:
            return type(value) is str

        kinds = {"an integer": (is_int, ("block_size", "window", "mask_token_id", "pad_token_id", "num_layers",
                                         "num_kv_heads", "head_dim", "vocab_size", "max_context", "format_version")),
                 "a string": (is_str, ("mask_token", "dtype", "source_model", "onnx_file", "graph")),
                 "an integer or null": (lambda v: v is None or is_int(v), ("bos_token_id",)),
                 "a string or null": (lambda v: v is None or is_str(v), ("engine_file", "weight_dtype")),
                 "an object": (lambda v: isinstance(v, dict), ("parity",)),
                 "a list of integers": (lambda v: isinstance(v, (list, tuple)) and all(map(is_int, v)),
                                                  ("eos_token_ids",))}
        for kind, (fits, names) in kinds.items():
            for name in names:
                if not fits(getattr(self, name)):
                    raise BundleError(f"{name} must be {kind}, got {getattr(self, name)!r}; re-export the bundle")

    def to_json(self) -> str:
        """Serialize with stable key order, for writing ``mars_config.json``."""
        raw = asdict(self)
        if raw["engine_file"] is None:  # bundles without an engine read as before
            del raw["engine_file"]
        if raw["weight_dtype"] == self.dtype:  # unquantized bundles read as before
            del raw["weight_dtype"]
        if raw["graph"] == "step":  # step-graph bundles read as before (older runtimes too)
            del raw["graph"]
        return json.dumps(raw, indent=2, sort_keys=True) + "\n"


def load_config(bundle_dir: str | Path) -> BundleConfig:
    """Read and validate ``mars_config.json`` of a bundle directory.

    Raises:
        BundleError: the directory or config is missing, not JSON, lacks or has unknown
            fields, or has another format version.
    """
    path = Path(bundle_dir) / CONFIG_FILE
    if not path.is_file():
        raise BundleError(f"{bundle_dir} is not a MARS bundle: {_why_not_a_bundle(Path(bundle_dir))}; "
                          f"{WHAT_A_BUNDLE_IS}")
    try:
        raw = json.loads(path.read_bytes().decode())
    except OSError as e:  # no permission, an I/O error
        raise BundleError(f"cannot read {path} ({e.strerror or e}); check its permissions and disk") from e
    except UnicodeDecodeError as e:
        raise BundleError(f"{path} is not UTF-8 text ({e}); re-export the bundle") from e
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: arrays or objects nested too deeply
        raise BundleError(f"{path} is not valid JSON ({e}); re-export the bundle") from e
    if not isinstance(raw, dict):
        raise BundleError(f"{path} must hold a JSON object; re-export the bundle")
    version = raw.get("format_version")
    if version != FORMAT_VERSION or type(version) is not int:
        raise BundleError(f"{path}: bundle format version {version!r} is not supported by this runtime "
                          f"(it reads version {FORMAT_VERSION}); re-export the bundle with this version's mars-export")
    known = {f.name for f in fields(BundleConfig)}
    required = {f.name for f in fields(BundleConfig) if f.default is MISSING and f.default_factory is MISSING}
    missing, unknown = sorted(required - raw.keys()), sorted(raw.keys() - known)
    if missing or unknown:
        problems = [f"{kind} fields {names}" for kind, names in (("missing", missing), ("unknown", unknown)) if names]
        raise BundleError(f"{path} has {' and '.join(problems)}; re-export the bundle")
    try:
        return BundleConfig(**raw)
    except BundleError as e:  # a field of the wrong JSON type or value
        raise BundleError(f"{path}: {e}") from e


def _why_not_a_bundle(path: Path) -> str:
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is a file"
    return f"it holds no {CONFIG_FILE}"
