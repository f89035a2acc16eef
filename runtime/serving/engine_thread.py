"""The engine thread: the only code that touches the :class:`~runtime.decode.engine.Engine`.

The engine is not thread-safe, so one thread owns it. Request handlers talk to that
thread through a thread-safe command queue (submit, abort, set the base tau), and the
thread answers through each request's ``deliver`` callback (the server passes one that
hands the item to the request's asyncio queue with ``loop.call_soon_threadsafe``).
onnxruntime releases the GIL while it runs, so the event loop keeps serving meanwhile.

One turn of the loop: run the queued commands, let the load policy set the default tau
from the queue depth (and update the load gauges), ``engine.step()``, deliver each output.
Each request counts its tokens and forwards in the metrics as it reads them
(:class:`~runtime.serving.request_stream.RequestStream`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from runtime.decode.engine import CannotGrowCache
from runtime.decode.params import DecodeParams
from runtime.serving.load_policy import LoadPolicy
from runtime.serving.kv_memory import cannot_grow_error
from runtime.serving.metrics import ServerMetrics

log = logging.getLogger(__name__)
ADMITTED = "admitted"  # first item delivered once the engine accepted a request
_IDLE_WAIT_S = 0.2
_APPLY_TIMEOUT_S = 60.0  # longer than any one engine step


@dataclass
class Submission:
    """One request for the engine thread.

    Attributes:
        request_id: unique id, chosen by the caller (so it can abort before admission).
        prompt_ids: the prompt's token ids.
        params: decoding parameters.
        deliver: called on the engine thread with :data:`ADMITTED`, then each
            :class:`~runtime.decode.engine.StepOutput`; or once with a ``ValueError`` (rejected)
            or a ``RuntimeError`` (the engine failed; :class:`~runtime.serving.kv_memory.KVCacheOutOfMemory`:
            the KV cache could not grow for this request).
    """

    request_id: str
    prompt_ids: list[int]
    params: DecodeParams
    deliver: Callable[[object], None]


class EngineThread:
    """Owns the engine and its thread.

    Args:
        engine: the :class:`~runtime.decode.engine.Engine`.
        policy: the load policy.
        metrics: the server's metrics.
        base_tau: the starting base tau (validated against the policy's bounds).
    """

    def __init__(self, engine, policy: LoadPolicy, metrics: ServerMetrics, base_tau: float):
        self.engine = engine
        self.policy = policy
        self.metrics = metrics
        self.base_tau = policy.check_base(base_tau)
        self.queue_depth = 0
        self.num_running = 0
        self._commands: queue.Queue = queue.Queue()
        self._deliver: dict[str, Callable[[object], None]] = {}
        self._thread = threading.Thread(target=self._run, name="mars-engine", daemon=True)

    def start(self) -> None:
        self._apply_policy()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after the current step; unfinished requests get an error."""
        self._commands.put(None)
        self._thread.join()

    @property
    def default_tau(self) -> float:
        """The engine's live default tau (stored there only; a float read is safe from any thread)."""
        return self.engine.default_tau

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- called from any thread ------------------------------------------------------

    def submit(self, submission: Submission) -> None:
        self._commands.put(lambda: self._add(submission))

    def abort(self, request_id: str) -> None:
        """Free the request's slot at the next turn (within one engine step)."""
        self._commands.put(lambda: self._abort(request_id))

    def set_base_tau(self, tau: float) -> float:
        """Set the base tau live (the load policy lowers the default from it); returns once
        the engine thread applied it (it takes commands between steps), so a reader of
        :attr:`default_tau` right after sees the new value.

        Raises:
            ValueError: outside the policy's [tau_min, tau_max].
        """
        tau = self.policy.check_base(tau)
        applied = threading.Event()

        def apply():
            self.base_tau = tau
            self._apply_policy()
            applied.set()

        self._commands.put(apply)
        applied.wait(timeout=_APPLY_TIMEOUT_S)
        return tau

    # -- the engine thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            for command in self._take_commands(block=not self.engine.has_unfinished()):
                if command is None:
                    self._fail_all("the server is shutting down")
                    return
                command()
            self._apply_policy()
            if self.engine.has_unfinished():
                self._step()
            else:
                self.metrics.record_output(0, 0)  # lets the windowed gauges fall to 0 when idle

    def _take_commands(self, block: bool) -> list:
        commands = []
        try:
            commands.append(self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _add(self, submission: Submission) -> None:
        try:
            self.engine.add_request(submission.prompt_ids, submission.params, submission.request_id)
        except ValueError as e:
            submission.deliver(e)
            return
        except Exception as e:  # an engine bug must fail this request, not the engine thread
            log.exception("engine.add_request failed")
            submission.deliver(RuntimeError(f"the engine failed: {type(e).__name__}: {e}"))
            return
        self._deliver[submission.request_id] = submission.deliver
        submission.deliver(ADMITTED)

    def _abort(self, request_id: str) -> None:
        if self._deliver.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    def _apply_policy(self) -> None:
        self.queue_depth, self.num_running = self.engine.num_waiting, self.engine.num_running
        tau = self.policy.default_tau(self.base_tau, self.queue_depth)
        self.engine.default_tau = tau
        self.metrics.record_load(self.queue_depth, self.num_running, tau, self.base_tau)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except CannotGrowCache as e:  # the engine finished those requests; the others go on at the next turn
            error = cannot_grow_error(e, self.engine.config.window)
            log.warning("%d request(s) failed: %s", len(e.request_ids), error)
            for request_id in e.request_ids:
                deliver = self._deliver.pop(request_id, None)
                if deliver is not None:
                    deliver(error)
            return
        except Exception as e:  # the server must outlive an engine failure; requests in flight get a 500
            log.exception("engine step failed")
            self._fail_all(f"the engine failed: {type(e).__name__}: {e}")
            return
        for out in outputs:
            deliver = self._deliver.get(out.request_id)
            if deliver is None:  # aborted while the step ran
                continue
            deliver(out)
            if out.finished:
                del self._deliver[out.request_id]

    def _fail_all(self, message: str) -> None:
        for request_id, deliver in list(self._deliver.items()):
            deliver(RuntimeError(message))
            self._abort(request_id)
