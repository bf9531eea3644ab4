"""The recipe end to end on this machine's CPUs: tiny model, synthetic task, warm start, a few GRPO steps.

  python -m tools.smoke                             # 3 steps of the A3 path at small scale (what `nox -s smoke` runs)
  python -m tools.smoke --steps 20                  # GRPO learns: reward and held-out accuracy rise (curves.png)
  python -m tools.smoke --seed 1                    # another task draw, held-out split and warm start
  python -m tools.smoke --cold                      # GRPO from the random model: the loop turns, nothing is learnt
  python -m tools.smoke --profile fsdp              # the FSDP + HF-rollout profile instead
  python -m tools.smoke --random-init               # Megatron's own random init: no checkpoint is loaded
  python -m tools.smoke --rollout hf                # verl's HF engine in the Megatron worker instead of vLLM
  python -m tools.smoke --dry-run                   # prepare nothing, print the launcher's plan

Profiles (--profile):
  megatron  recipes/deepseek_r1/configs/cpu-tiny.yaml (default): a3-128-true-weight.yaml with only sizes, device
            and rollout engine changed: Megatron actor and ref (TP2 x PP2 on 4 gloo ranks, uneven stages, the
            torch_dist checkpoint loaded), TensorCache, directed weight sync into vLLM's CPU engine (two
            instances of DP2 x TP1 with expert parallel; the cpu install profile builds it from our fork).
  fsdp      recipes/deepseek_r1/configs/cpu-tiny-fsdp.yaml: actor and ref on FSDP (2 ranks), verl's HF rollout;
            FSDP loads the HF checkpoint itself.

Inputs are made once and reused (under --work, default .cache/smoke): a random-init DeepSeek-V3-architecture
model with a local tokenizer (`python -m tools.weights make-tiny`); the task, every sum of two numbers in 0..20
once, 15% held out, in the deepscaler parquet schema (`python -m tools.data synthetic-arith --unique`); the warm
start, supervised fine-tuning of the model on the train split's \\boxed{} answers (`python -m tools.weights
warm-start`), after which it solves part of the held-out sums, so GRPO's groups differ and there is something to
learn; and, for the megatron profile, the warm-started model converted to Megatron's torch_dist format (`python -m
tools.weights hf-to-mcore`), passed as recipe.weights.mcore_checkpoint. Each is written to a `.partial` folder and
renamed when complete, so an interrupted preparation is redone, never half-used. Then `python -m tools.launch` runs
the profile's config with a local Ray cluster it starts and stops, and prints the per-step summary (reward mean,
held-out accuracy before the first step and every 5 steps) and saves logs/<run>/curves.png. Extra key=value
arguments are launcher overrides (e.g. data.train_batch_size=4); they come last, so they win.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "recipes/deepseek_r1/configs"
PROFILES = {"megatron": CONFIGS / "cpu-tiny.yaml", "fsdp": CONFIGS / "cpu-tiny-fsdp.yaml"}
CONFIG = PROFILES["megatron"]
# --rollout: the keys that differ from cpu-tiny.yaml's vLLM rollout (the HF engine holds every expert on every rank)
ROLLOUTS = {
    "vllm": [],
    "hf": ["actor_rollout_ref.rollout.name=hf", "recipe.rollout.data_parallel_size=1", "recipe.rollout.instances=4",
           "recipe.rollout.expert_parallel_size=1", "actor_rollout_ref.rollout.top_k=0",
           "actor_rollout_ref.rollout.val_kwargs.top_k=0"],
}


def _digest(*parts) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()[:8]


# The task: sums of two numbers in 0..20, no problem twice, 15% of them held out for validation (66 problems the warm
# start and GRPO never train on). The short instruction keeps the character-level prompts short (at most 39 tokens).
ARITH_ARGS = ("--n", "441", "--ops", "+", "--max-operand", "20", "--max-terms", "2", "--unique",
              "--test-ratio", "0.15", "--instruction", "Answer in \\boxed{}.")
# The warm start: tools.weights.warm_start.Settings' defaults (the answer format and part of the sums, label-smoothed:
# 12-56% of the held-out ones greedily by seed, 6-10% as the rollout samples them), with these overrides.
WARM_START: dict = {}


def warm_start_settings(seed: int):
    from tools.weights.warm_start import Settings

    return Settings(**{**WARM_START, "seed": seed})


# The code that makes the inputs: a change to it makes them anew, so a --work folder kept across checkouts (the
# tests keep theirs under ~/.cache) never serves inputs an older tool made.
INPUT_CODE = (ROOT / "tools/weights", ROOT / "tools/data")


def input_code_digest() -> str:
    import hashlib

    h = hashlib.sha256()
    for path in sorted(f for d in INPUT_CODE for f in d.rglob("*.py")):
        h.update(f"{path.relative_to(ROOT)}\0".encode() + path.read_bytes())
    return h.hexdigest()


def folders(seed: int) -> dict[str, str]:
    """Folder names under --work. Each carries a digest of what makes it (settings and code), so a changed tiny model,
    task, warm start or converter (and everything made from it) is made anew instead of a stale one being reused."""
    from dataclasses import asdict

    from tools.weights.tiny import TINY_CONFIG

    code = input_code_digest()
    model = f"tiny-{_digest(TINY_CONFIG, code)}"
    data = f"arith-{_digest(ARITH_ARGS, seed, code)}"
    warm = f"warm-{_digest(TINY_CONFIG, ARITH_ARGS, asdict(warm_start_settings(seed)), code)}"
    return {"model": model, "data": data, "warm": warm, "mcore": f"{warm}-mcore", "cold-mcore": f"{model}-mcore"}


def destinations(work: Path, seed: int, warm: bool) -> tuple[Path, Path, Path]:
    """Where the run's model (warm-started or not), data and conversion lie under `work`, made or not."""
    names = folders(seed)
    model, mcore = ("warm", "mcore") if warm else ("model", "cold-mcore")
    return work / names[model], work / names["data"], work / names[mcore]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.smoke", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="launcher (OmegaConf) overrides")
    p.add_argument("--profile", choices=tuple(PROFILES), default="megatron",
                   help="megatron: cpu-tiny.yaml, the A3 path at small scale (default); fsdp: cpu-tiny-fsdp.yaml")
    p.add_argument("--random-init", action="store_true",
                   help="megatron profile: no checkpoint, Megatron's random init (recipe.weights.load=false)")
    p.add_argument("--rollout", choices=tuple(ROLLOUTS), default="vllm",
                   help="megatron profile: vllm (default, vLLM's CPU engine) or hf (verl's HF engine in the worker,"
                        " one per rank; same weight sync and lifecycle)")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps (trainer.total_training_steps; default 3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the task's problems and held-out pick and of the warm start (default 0); each seed"
                        " gets inputs of its own under --work")
    p.add_argument("--cold", action="store_true",
                   help="no warm start: GRPO from the random model (its reward stays 0: the loop turns, nothing"
                        " is learnt)")
    p.add_argument("--work", type=Path, default=ROOT / ".cache/smoke", help="where the model and data are made")
    p.add_argument("--logs", type=Path, default=ROOT / "logs", help="where run folders go (default logs/)")
    p.add_argument("--run-id", help="run name (default <config name>-<UTC time>, e.g. cpu-tiny-20250101-120000)")
    p.add_argument("--dry-run", action="store_true", help="make nothing, run nothing: the launcher's plan")
    return p


def complete(dst: Path, make) -> Path:
    """Run make(partial_dir) unless dst exists; rename the finished folder to dst."""
    if dst.is_dir():
        return dst
    partial = dst.with_name(dst.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    make(partial)
    partial.rename(dst)
    return dst


def prepare(work: Path, convert: bool = True, seed: int = 0, warm: bool = True,
            say=print) -> tuple[Path, Path, Path | None]:
    """The model (the tiny random one, warm-started on the task unless `warm` is off), the task's data and (with
    `convert`) the model's torch_dist conversion under `work`, each made once."""
    from tools.data.cli import main as data_main
    from tools.weights.tiny import make_tiny

    names = folders(seed)
    start, _, converted = destinations(work, seed, warm)

    def model(dst: Path) -> None:
        say(f"making the tiny model in {dst.with_suffix('')}")
        make_tiny(dst)

    def data(dst: Path) -> None:
        say(f"making the arithmetic data in {dst.with_suffix('')}")
        if data_main(["synthetic-arith", "--dst", str(dst), "--seed", str(seed), *ARITH_ARGS]) != 0:
            raise SystemExit("synthetic-arith failed (its message is above)")

    tiny, task = complete(work / names["model"], model), complete(work / names["data"], data)

    if not start.is_dir():  # the warm start writes its folder whole or not at all itself
        from tools.weights import warm_start

        say(f"warm-starting the tiny model on {task.name}'s train split in {start}")
        warm_start.warm_start(tiny, task / "train.parquet", start, warm_start_settings(seed),
                              held_out=task / "test.parquet", say=say)

    def mcore(dst: Path) -> None:
        from tools.weights.dist import hf_to_torch_dist

        say(f"converting {start.name} to torch_dist in {dst.with_suffix('')}")
        hf_to_torch_dist(start, dst, say=say)

    if not convert:
        return start, task, None
    return start, task, complete(converted, mcore)


def needs_checkpoint(args: argparse.Namespace) -> bool:
    """The megatron profile loads the torch_dist conversion unless --random-init; FSDP reads model.path itself."""
    return args.profile == "megatron" and not args.random_init


def launcher_args(args: argparse.Namespace, model: Path, data: Path, mcore: Path | None) -> list[str]:
    """The `python -m tools.launch` arguments: the profile's config, the inputs, then the user's overrides."""
    if needs_checkpoint(args) and mcore is None:
        raise ValueError("the megatron profile loads a checkpoint: pass its folder (or use --random-init)")
    out = [str(PROFILES[args.profile]), f"actor_rollout_ref.model.path={model}",
           f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
           f"trainer.total_training_steps={args.steps}"]
    if args.profile == "megatron":
        out += ([f"recipe.weights.mcore_checkpoint={mcore}"] if needs_checkpoint(args) else
                ["recipe.weights.load=false", "recipe.weights.mcore_checkpoint=null"])
        out += ROLLOUTS[args.rollout]
    out += [*args.overrides, "--master-addr", "127.0.0.1", "--logs", str(args.logs)]
    if args.run_id:
        out += ["--run-id", args.run_id]
    if args.dry_run:
        out.append("--dry-run")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)
    if args.steps < 1:
        print(f"error: --steps is {args.steps}; give 1 or more", file=sys.stderr)
        return 2
    if args.rollout != "vllm" and args.profile != "megatron":
        print("error: --rollout applies to --profile megatron (the FSDP profile rolls out with verl's HF engine)",
              file=sys.stderr)
        return 2
    if args.random_init and args.profile != "megatron":
        print("error: --random-init applies to --profile megatron (FSDP always loads model.path's weights)",
              file=sys.stderr)
        return 2
    from tools.launch.cli import main as launch

    warm = not (args.cold or args.random_init)  # Megatron's random init loads no weights: nothing to warm-start
    if args.dry_run:
        model, data, mcore = destinations(args.work, args.seed, warm)
    else:
        model, data, mcore = prepare(args.work, convert=needs_checkpoint(args), seed=args.seed, warm=warm)
    return launch(launcher_args(args, model, data, mcore if needs_checkpoint(args) else None))


if __name__ == "__main__":
    sys.exit(main())
