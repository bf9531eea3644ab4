"""Math answer reward: the last \\boxed{} of a response against the ground truth.

Two rules:

* strict (default): only the content of the LAST `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 42`)
  counts. It is compared with the ground truth by mathematical equivalence (math-verify), so
  `\\frac{1}{2}`, `0.5` and `1/2` agree, units and `\\text{}` are ignored, `50\\%` equals `50` (but
  not `0.5`). Numbers written in the reasoning never score; a missing, empty or unbalanced last
  box scores 0, even when an earlier box was right (the model's final word is what it answered).
* lax: the reference recipe's rule, kept only to reproduce its curves: the response is correct
  when the ground-truth string occurs anywhere in it. Its weakness is known: ground truth "2"
  matches "the year 2024".

Each comparison runs in a long-lived worker process (tools/reward/_verifier.py) with a hard
deadline, so a pathological answer (`10^{10^{10}}`, thousands of nested braces) costs at most
`timeout_s` and scores 0; it can never hang a training step. math-verify's own timeouts use
SIGALRM, which works only in a main thread; the worker gives it one whatever thread calls us.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

MODES = ("strict", "lax")

# `\boxed` / `\fbox` as whole control words (not `\boxedfoo`).
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# `1\,234` / `1\!234`: thin-space digit grouping, which math-verify reads as a product.
_DIGIT_GROUP_SPACE = re.compile(r"(?<=\d)\\[,!](?=\d{3}(?!\d))")
_WORKER_SCRIPT = Path(__file__).with_name("_verifier.py")
_STARTUP_TIMEOUT_S = 120.0


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed 42` in `text`, else None.

    Braces are matched with nesting (escaped `\\{` and `\\}` do not count). Only the last box
    command is considered: if its braces do not close, the result is None rather than an earlier
    box. Linear in len(text), so adversarial inputs cannot blow up here.
    """
    commands = deque(_BOX_COMMAND.finditer(text), maxlen=1)
    if not commands:
        return None
    last = commands[0]
    start = last.end()
    while start < len(text) and text[start].isspace():
        start += 1
    if start == len(text):
        return None
    if text[start] == "{":
        return _braced(text, start)
    if start == last.end() or text[start] in "}$":
        return None  # `\boxed}` or `\boxed$`: no argument; `\boxed42` needs the space
    end = start
    while end < len(text) and not text[end].isspace() and text[end] != "$":
        end += 1
    return text[start:end]


def _braced(text: str, open_at: int) -> str | None:
    """The text inside the brace group opening at `open_at`, or None when it never closes."""
    depth, i = 0, open_at
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # skip the escaped character: `\{`, `\}`, `\\`
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
        i += 1
    return None


def normalize(answer: str) -> str:
    """Trim what math-verify trips on but a reader ignores: outer spaces and `$`, a final full stop,
    thin spaces between digit groups."""
    answer = _DIGIT_GROUP_SPACE.sub("", answer.strip())
    if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer.strip("$").strip()
    return answer.removesuffix(".").rstrip()


def compute_score(solution_str: str, ground_truth: str | int, *, mode: str = "strict",
                  timeout_s: float = 5.0) -> float:
    """1.0 when the response's final answer equals `ground_truth`, else 0.0 (see the module doc)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    truth = _ground_truth_text(ground_truth)
    if mode == "lax":
        return 1.0 if truth in solution_str else 0.0
    answer = last_boxed(solution_str)
    if answer is None or not normalize(answer):
        return 0.0
    # A ground truth stored as `\boxed{...}` (some datasets do) is compared by its content.
    boxed_truth = last_boxed(truth)
    truth = normalize(boxed_truth if boxed_truth is not None else truth)
    return 1.0 if _equivalent(truth, normalize(answer), timeout_s) else 0.0


def _ground_truth_text(ground_truth: str | int) -> str:
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        # An empty truth would score every response 1 (lax) or 0 (strict): a data bug to surface.
        raise ValueError(f"ground_truth must be a non-empty string, got {ground_truth!r}")
    return ground_truth


def _equivalent(truth: str, answer: str, timeout_s: float) -> bool:
    # `$...$` is the wrapping math-verify reads best: it also understands `50\%` there, not in \boxed{}.
    # Parsing the answer and verifying each get half the budget, so math-verify usually gives up
    # before the hard deadline kills the worker (restarting it costs about a second).
    request = {"gold": f"${truth}$", "answer": f"${answer}$", "timeout": max(1, int(timeout_s / 2))}
    return _VERIFIER.ask(request, timeout_s)


class _Verifier:
    """One worker process per calling process, restarted after a timeout or a crash."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = 0

    def ask(self, request: dict, timeout_s: float) -> bool:
        with self._lock:
            proc = self._ensure_started()
            try:
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
                reply = _read_line(proc, timeout_s)
            except (BrokenPipeError, OSError):
                reply = None
            if reply is None:  # too slow or died: a fresh worker for the next call
                self._stop()
                return False
            return reply == "1"

    def _ensure_started(self) -> subprocess.Popen:
        # After a fork the child must not share the parent's pipes: it starts its own worker.
        if self._proc is not None and self._owner_pid == os.getpid() and self._proc.poll() is None:
            return self._proc
        self._proc, self._owner_pid = None, os.getpid()
        proc = subprocess.Popen([sys.executable, str(_WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        if _read_line(proc, _STARTUP_TIMEOUT_S) != "ready":
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the math-verify worker ({_WORKER_SCRIPT}) did not start; is math-verify "
                               f"installed for {sys.executable}? Its error is printed above.")
        self._proc = proc
        return proc

    def _stop(self) -> None:
        if self._proc is not None and self._owner_pid == os.getpid():
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """One reply line from the worker within `timeout_s`, or None (timeout or end of file)."""
    fd, buffer = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while not buffer.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, 64)
        if not chunk:
            return None
        buffer += chunk
    return buffer.decode().strip()


_VERIFIER = _Verifier()
atexit.register(_VERIFIER.close)
