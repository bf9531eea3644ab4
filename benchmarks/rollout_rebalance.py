"""The rollout rebalance, live, off and on side by side (verl series: rollout/rebalance/loop.py).

Two gloo processes each build vLLM 0.11.0's V1 CPU engine on a small random Llama (tools/weights/tiny_llama.py)
and run one skewed rollout under greedy decoding: rank 0 gets the long answers (LONG_PROMPTS x LONG tokens),
rank 1 a few short ones, MAX_SEQS sequences per engine at a time. Off: the engines step in lockstep and
nothing moves; on: every CHECK_EVERY steps the loads are shared and sequences move with their KV blocks.
Figures per rank: engine steps (the makespan in steps), steps with work, busy seconds, tokens sampled;
per run: sequences moved, KV bytes shipped, failed moves, wall seconds. The loop reports the makespan's
yardsticks (loop.load_bound): the busiest engine's samples decoded there unmoved, and the lower bound, the
longest answer or all tokens over every engine's slots. The last line is the makespan ratio (on / off, in steps
and in seconds). Samples are compared: the tokens must be equal.

  /path/to/stack/bin/python benchmarks/rollout_rebalance.py [--long 64] [--long-prompts 8] [--check-every 4]
                                                            [--repeats 3]

The model (hidden 512, 8 layers by default) makes a decode step (~20 ms here) cost more than a load check
(a few ms of gloo collectives), as on A3 (a ~90 ms step, a check every 64). With the test's 2-layer model
(--hidden 64 --layers 2, a ~3 ms step) the checks cost more than the steps they save: 1.14x in seconds.

Measured with the defaults (2026-12-06, vLLM 0.11.0 CPU, two processes on a 2-core machine): off 97 steps,
on 53 (busiest engine unmoved 96, lower bound 49): 0.55 in steps and 0.62 in seconds (medians 1.29 / 2.08 s,
checks 0.05 s); 6 sequences moved, 786432 KV bytes shipped, tokens equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gloo import run_processes  # noqa: E402
from tests.vllm_cpu import engine_rank, tiny_engine  # noqa: E402
from tools.weights.tiny_llama import make_tiny_llama  # noqa: E402

WORLD = 2


def _worker(rank, port, path, args, results):
    with engine_rank(rank, port, WORLD):
        from verl.workers.rollout.rebalance import loop
        from verl.workers.rollout.rebalance.settings import RebalanceSettings
        from vllm import SamplingParams

        llm = tiny_engine(path, max_len=128, max_seqs=args.max_seqs)
        count, length = (args.long_prompts, args.long) if rank == 0 else (args.short_prompts, args.short)
        prompts = [[3 + rank, 10 + p, 20 + 2 * p, 40 + rank + p] for p in range(count)]
        params = SamplingParams(temperature=0.0, max_tokens=length, logprobs=0, ignore_eos=True)
        out = {}
        # a warm-up rollout first (the engine's first steps are slower), then off and on in turns: seconds are medians
        for name, enable in [("warm-up", False)] + [("off", False), ("on", True)] * args.repeats:
            settings = RebalanceSettings(enable=enable, check_every=args.check_every, trigger="imbalance",
                                         min_imbalance=2, kv_transfer="ship")
            samples, figures = loop.generate(llm, prompts, params, settings)
            seconds = out.get(name, {}).get("seconds", []) + [figures.makespan_s]
            out[name] = {"tokens": [s.token_ids for s in samples], "seconds": seconds,
                         "figures": {**{k: v for k, v in vars(figures).items() if k != "checks"},
                                     "checks_s": sum(c.seconds for c in figures.checks)}}
        results[rank] = out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long", type=int, default=48, help="tokens of each long answer (rank 0)")
    p.add_argument("--short", type=int, default=4, help="tokens of each short answer (rank 1)")
    p.add_argument("--long-prompts", type=int, default=8, help="prompts on rank 0")
    p.add_argument("--short-prompts", type=int, default=2, help="prompts on rank 1")
    p.add_argument("--max-seqs", type=int, default=4, help="vLLM max_num_seqs per engine")
    p.add_argument("--check-every", type=int, default=4, help="engine steps between load checks")
    p.add_argument("--repeats", type=int, default=3, help="rollouts off and on, in turns (seconds: their median)")
    p.add_argument("--hidden", type=int, default=512, help="the model's hidden size (a multiple of 32)")
    p.add_argument("--layers", type=int, default=8, help="the model's layers")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_llama(tmp, hidden=args.hidden, layers=args.layers)
        results = run_processes(_worker, WORLD, tmp, args)
    equal = all(results[r]["off"]["tokens"] == results[r]["on"]["tokens"] for r in range(WORLD))
    print(f"{'run':4} {'rank':>4} {'steps':>6} {'busy steps':>10} {'busy s':>7} {'tokens':>6} {'wall s':>7} "
          f"{'checks s':>8} {'moved':>5} {'KV bytes':>9} {'failed':>6}")
    for run in ("off", "on"):
        for r in range(WORLD):
            f = results[r][run]["figures"]
            print(f"{run:4} {r:>4} {f['steps']:>6} {f['busy_steps']:>10} {f['busy_s']:>7.2f} {f['tokens']:>6} "
                  f"{f['makespan_s']:>7.2f} {f['checks_s']:>8.2f} {f['moved']:>5} {f['kv_bytes_sent']:>9} "
                  f"{f['failed']:>6}")
    off, on = results[0]["off"]["figures"], results[0]["on"]["figures"]
    wall = {run: statistics.median(results[0][run]["seconds"]) for run in ("off", "on")}
    print(f"busiest engine unmoved: {on['largest_load_steps']} steps; lower bound: {on['lower_bound_steps']} steps; "
          f"tokens equal off/on: {equal}")
    print(f"makespan on/off: {on['steps'] / off['steps']:.2f} in steps ({on['steps']} / {off['steps']}), "
          f"{wall['on'] / wall['off']:.2f} in seconds (median of {args.repeats}: "
          f"{wall['on']:.2f} / {wall['off']:.2f}); "
          f"moved {on['moved']} sequences, {sum(results[r]['on']['figures']['kv_bytes_sent'] for r in range(WORLD))}"
          " KV bytes")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
