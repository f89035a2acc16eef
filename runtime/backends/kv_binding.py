"""An onnxruntime I/O binding whose KV inputs and outputs are the same buffers: the KV cache written in place.

Both graphs a bundle may hold (:mod:`runtime.bundle`) output each layer's KV with its inputs'
shapes: the step graph scatters the window's entries into the past, the fused graph's
GroupQueryAttention writes them after the committed ones. Bound to the past's own buffer, each
present is that buffer, so a step writes W entries per layer into the cache and copies nothing
(onnxruntime's CPU scatter skips its copy when its output is its input). A step that feeds an input
with a default (``num_logits``, ``num_greedy``, ``confidence_tau``: a binding cannot bind one) runs through
onnxruntime's ``run_with_ortvaluevector`` with the same buffers as preallocated outputs
(:meth:`KVBinding.run_step_without_head`, :meth:`KVBinding.run_gated_step`).
"""

from __future__ import annotations

import threading

import numpy as np

from runtime.bundle import (ATTENTION_MASK, CONFIDENCE_TAU, GREEDY_IDS, HEAD_SKIPPED, INPUT_IDS, LOGITS, NUM_GREEDY,
                            NUM_LOGITS, POSITION_IDS, past_names, present_names)


class KVBinding:
    """The I/O binding of one session, its past inputs and present outputs bound to the same arrays.

    The KV is bound again only when the arrays change (another address or shape: the cache grew,
    or another batch); a step then binds its window inputs and outputs only. Each thread gets its
    own binding (a binding is state; the session runs bindings of several threads at once, as
    engines sharing one backend do).

    Args:
        session: an onnxruntime InferenceSession (CPU) with ``past_key_values.{i}.*`` inputs and
            ``present.{i}.*`` outputs of equal shapes; ort: the onnxruntime module.
    """

    def __init__(self, session, ort):
        self.session, self.ort = session, ort
        self.cpu = ort.OrtDevice.make("cpu", 0)._get_c_device()  # where run_step_without_head's outputs lie
        self._local = threading.local()

    @property
    def binding(self):
        """This thread's I/O binding."""
        if not hasattr(self._local, "binding"):
            self._local.binding = self.session.io_binding()
            self._local.bound = []  # the arrays bound as past and present, layer by layer, key then value
        return self._local.binding

    def bind_kv(self, past: list[tuple[np.ndarray, np.ndarray]]):
        """Bind ``past`` (per layer (key, value), C-contiguous, writeable) as both past and present; returns the
        binding.

        Raises:
            ValueError: an array is not C-contiguous (onnxruntime would bind a copy, and the step would
                write its entries there instead of into the cache) or not writeable.
        """
        buffers = [buffer for pair in past for buffer in pair]
        if not all(buffer.flags.c_contiguous and buffer.flags.writeable for buffer in buffers):
            raise ValueError("the KV cache handed to the step must be C-contiguous, writeable arrays (the step writes "
                             "into them in place); slice whole slots (leading axis) or copy with np.array")
        binding, bound = self.binding, self._local.bound
        if len(buffers) == len(bound) and all(a is b for a, b in zip(buffers, bound)):
            return binding  # the very arrays bound last: the engine's cache hands the same views
        if len(buffers) == len(bound) and all(_same_memory(a, b) for a, b in zip(buffers, bound)):
            self._local.bound = buffers
            return binding
        self._local.bound = []  # until every layer is bound: a failure below must not leave a half binding "current"
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        values = []
        for layer, pair in enumerate(past):
            for name_in, name_out, buffer in zip(past_names(layer), present_names(layer), pair):
                value = self.ort.OrtValue.ortvalue_from_numpy(buffer)  # the buffer's own memory, no copy
                binding.bind_ortvalue_input(name_in, value)
                binding.bind_ortvalue_output(name_out, value)
                values.append(value)
        self._local.values = values  # past_names order, layer by layer: run_step_without_head feeds them
        self._local.bound = buffers  # held, so no other array can take their memory while bound
        return binding

    def run_step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                 past: list[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
        """One step-graph forward (:mod:`runtime.bundle` I/O), its KV written into ``past`` in place.

        Args:
            input_ids, position_ids: int64 [n, W]; attention_mask: bool [n, 1, W, S]; past: the KV cache,
                per layer (key, value) [n, H, S, D] (as :meth:`bind_kv`); vocab_size: V.

        Returns:
            logits float32 [n, W, V].

        Raises:
            ValueError: ``past`` is not C-contiguous and writeable (:meth:`bind_kv`).
        """
        binding = self.bind_kv(past)
        for name, array in _window_feeds(input_ids, position_ids, attention_mask).items():
            binding.bind_cpu_input(name, array)
        return self.run((*input_ids.shape, vocab_size))

    def run(self, logits_shape: tuple[int, int, int]) -> np.ndarray:
        """Run the session over the bound inputs; returns the logits float32 ``logits_shape``, written in place."""
        out = np.empty(logits_shape, np.float32)
        self.binding.bind_output(LOGITS, "cpu", 0, np.float32, out.shape, out.ctypes.data)
        self.session.run_with_iobinding(self.binding)  # no get_outputs: it would wrap every present too
        return out

    def run_step_without_head(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                              past: list[tuple[np.ndarray, np.ndarray]], vocab_size: int,
                              greedy_ids: bool) -> np.ndarray:
        """As :meth:`run_step`, the float32 output head skipped: ``num_logits`` 0 (a prefill forward, or a greedy
        step), and with ``greedy_ids`` ``num_greedy`` W (the greedy head's ids of every row,
        mars_export.greedy_head). For step graphs that take ``num_logits`` (and ``num_greedy``): inputs with a
        default, which an I/O binding cannot bind, so the run goes through onnxruntime's
        ``run_with_ortvaluevector``, which takes feeds by name and writes into preallocated outputs: ``past``
        is both the past and the present, written in place, as with the binding.

        Returns:
            with ``greedy_ids`` each row's argmax token int64 [n, W] (the mask token excluded), else the empty
            logits float32 [n, 0, V].

        Raises:
            ValueError: ``past`` is not C-contiguous and writeable (:meth:`bind_kv`).
        """
        n, window = input_ids.shape
        counts, outputs = {NUM_LOGITS: np.array(0, np.int64)}, {LOGITS: np.empty((n, 0, vocab_size), np.float32)}
        if greedy_ids:
            counts[NUM_GREEDY] = np.array(window, np.int64)
            outputs[GREEDY_IDS] = np.empty((n, window), np.int64)
        self._run_vector(input_ids, position_ids, attention_mask, past, counts, outputs)
        return outputs[GREEDY_IDS if greedy_ids else LOGITS]

    def run_gated_step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                       past: list[tuple[np.ndarray, np.ndarray]], vocab_size: int,
                       confidence_tau: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """As :meth:`run_step` on a step graph with the confidence gate (mars_export.confidence_gate): the greedy
        head's ids of every row, and the logits unless the gate skipped the float32 head, through
        ``run_with_ortvaluevector`` as :meth:`run_step_without_head`.

        Args:
            confidence_tau: float32 [n], per row the tau of its probability test (module docstring of
                mars_export.confidence_gate: -1 for a row that reads its logits whatever they say, >= 1 for
                one that tests no confidence).

        Returns:
            each row's argmax token int64 [n, W] (the mask token excluded), and the logits float32 [n, W, V], or
            None where the head was skipped: then every row's output at its first mask token has a
            probability at most its ``confidence_tau``.

        Raises:
            ValueError: ``past`` is not C-contiguous and writeable (:meth:`bind_kv`).
        """
        n, window = input_ids.shape
        counts = {NUM_LOGITS: np.array(window, np.int64), NUM_GREEDY: np.array(window, np.int64),
                  CONFIDENCE_TAU: np.ascontiguousarray(confidence_tau, np.float32)}
        outputs = {LOGITS: np.empty((n, window, vocab_size), np.float32), GREEDY_IDS: np.empty((n, window), np.int64),
                   HEAD_SKIPPED: np.empty((), np.bool_)}
        self._run_vector(input_ids, position_ids, attention_mask, past, counts, outputs)
        return outputs[GREEDY_IDS], None if outputs[HEAD_SKIPPED] else outputs[LOGITS]

    def _run_vector(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                    past: list[tuple[np.ndarray, np.ndarray]], counts: dict[str, np.ndarray],
                    outputs: dict[str, np.ndarray]) -> None:
        """One run through ``run_with_ortvaluevector``: the window inputs and ``counts`` (inputs with a default) fed
        by name, ``outputs`` preallocated and written in place, ``past`` both the past and the present."""
        self.bind_kv(past)  # checks the buffers and keeps their OrtValues (self._local.values)
        feeds = {**_window_feeds(input_ids, position_ids, attention_mask), **counts}  # held until the run
        feed_values, fetch_values = self._vector(feeds.values()), self._vector(outputs.values())
        for value in self._local.values:
            feed_values.push_back(value._ortvalue)
            fetch_values.push_back(value._ortvalue)
        layers = range(len(past))
        kv_in = [name for layer in layers for name in past_names(layer)]
        kv_out = [name for layer in layers for name in present_names(layer)]
        self.session.run_with_ortvaluevector(self.ort.RunOptions(), [*feeds, *kv_in], feed_values, [*outputs, *kv_out],
                                             fetch_values, [self.cpu] * (len(outputs) + len(kv_out)))

    def _vector(self, arrays):
        """An OrtValueVector of ``arrays`` (CPU numpy, held by the caller until the run ends)."""
        vector = self.ort.capi.onnxruntime_pybind11_state.OrtValueVector()
        for array in arrays:
            vector.push_back(self.ort.OrtValue.ortvalue_from_numpy(array)._ortvalue)
        return vector

    def run_with_ids(self, logits_shape: tuple[int, int, int], ids_shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`run`, also binding the ``greedy_ids`` output (mars_export.greedy_head); returns the logits float32
        ``logits_shape`` and the ids int64 ``ids_shape``."""
        ids = np.empty(ids_shape, np.int64)
        self.binding.bind_output(GREEDY_IDS, "cpu", 0, np.int64, ids.shape, ids.ctypes.data)
        return self.run(logits_shape), ids

    def run_gated(self, logits_shape: tuple[int, int, int], ids_shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, bool]:
        """As :meth:`run_with_ids`, also binding the confidence gate's ``head_skipped`` output
        (mars_export.confidence_gate); returns the logits (zeros where the head was skipped), the ids and
        ``head_skipped``."""
        skipped = np.empty((), np.bool_)
        self.binding.bind_output(HEAD_SKIPPED, "cpu", 0, np.bool_, skipped.shape, skipped.ctypes.data)
        out, ids = self.run_with_ids(logits_shape, ids_shape)
        return out, ids, bool(skipped)


def _window_feeds(input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
    """The step's window inputs by name, as onnxruntime takes them: int64 ids and positions, a bool mask."""
    return {INPUT_IDS: np.ascontiguousarray(input_ids, np.int64),
            POSITION_IDS: np.ascontiguousarray(position_ids, np.int64),
            ATTENTION_MASK: np.ascontiguousarray(attention_mask, np.bool_)}


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` and ``b`` are the same memory: address, shape and dtype."""
    return a.ctypes.data == b.ctypes.data and a.shape == b.shape and a.dtype == b.dtype
