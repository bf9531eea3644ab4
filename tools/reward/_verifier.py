"""Worker process for math_score: answers "are these two LaTeX answers equal?" over a pipe.

Run as a script by `math_score` (never imported). Protocol, one JSON object a line on stdin:
{"gold": str, "answer": str, "timeout": int}; one line on stdout: "1" or "0". It first writes
"ready" once math-verify is imported. math-verify's own signal-based timeouts work here because
each request runs in this process's main thread; the parent kills us if even those fail.
"""

import functools
import json
import logging
import os
import sys


def main() -> None:
    # Keep the protocol channel private: anything else printed (by sympy, warnings) goes to stderr.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    # math-verify logs every failed parse with the whole input; pathological answers would flood logs.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    from math_verify import parse, verify

    @functools.lru_cache(maxsize=4096)
    def parse_gold(gold: str, timeout: int):
        return parse(gold, parsing_timeout=timeout)

    # The first parse of a fraction or an interval loads sympy's modules for it (0.1 s idle; on CI's loaded machine
    # a first answer once scored 0 that way): done here, before "ready", so that no answer's deadline pays for it.
    verify(parse("$\\frac{1}{2}$"), parse("$0.5$"))
    verify(parse("$(1, 2]$"), parse("$(1,2]$"))
    channel.write("ready\n")
    for line in sys.stdin:
        request = json.loads(line)
        timeout = request["timeout"]
        try:
            gold = parse_gold(request["gold"], timeout)
            answer = parse(request["answer"], parsing_timeout=timeout)
            equal = bool(gold and answer and verify(gold, answer, timeout_seconds=timeout))
        except Exception:  # a sympy corner case is a wrong answer, not a dead worker
            equal = False
        channel.write("1\n" if equal else "0\n")


if __name__ == "__main__":
    main()
