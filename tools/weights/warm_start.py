"""`warm-start`: supervised fine-tuning of a small HF checkpoint on a task's answer format: the RL starting point.

A random model never writes a correct `\\boxed{}`, so every GRPO group scores the same, the advantage is 0 and
nothing but the KL term trains. A short SFT on the train split (prompt -> `\\boxed{answer}`) gives a model that
answers in the right format and is right part of the time: groups then differ, and GRPO has a signal.

It trains transformers' own model class for the checkpoint (the code verl's FSDP actor and HF rollout run) with
AdamW on the response tokens only, single process. verl 0.4.0's `fsdp_sft_trainer` is not used: it hard-codes
`attn_implementation="flash_attention_2"` and all-reduces its loss only on CUDA or NPU, so it cannot run on a CPU.
The result is written with the source checkpoint's own layout (shards, index, dtypes, config.json, tokenizer), so
everything that reads make-tiny's output (hf-to-mcore, FSDP, the weight sync) reads it unchanged, plus
`warm_start.json`: the settings, the loss curve and the held-out accuracy before and after.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch

from tools.weights.files import first_line, read_json
from tools.weights.hf import load_config
from tools.weights.io import INDEX, CheckpointError, ShardedReader, reader_spans
from tools.weights.tiny import write_checkpoint

REPORT = "warm_start.json"
IGNORE = -100  # labels the loss skips: prompt and padding


@dataclass(frozen=True)
class Settings:
    """What the warm start does; every field is a `python -m tools.weights warm-start` flag."""

    steps: int = field(default=400, metadata={"help": "optimizer steps (400: 12-56% of held-out sums, by seed)"})
    batch_size: int = field(default=32, metadata={"help": "examples per step, drawn with replacement"})
    lr: float = field(default=2e-3, metadata={"help": "peak AdamW learning rate"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warm-up steps before the cosine decay"})
    label_smoothing: float = field(default=0.1, metadata={
        "help": "mass spread over the whole vocabulary at every response token (0.1: the model is sure of nothing, so"
                " sampled answers are often malformed while greedy ones are right: GRPO's room to learn)"})
    seed: int = field(default=0, metadata={"help": "seed of the draws and of torch"})

    def check(self) -> None:
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise CheckpointError(f"warm-start --{name.replace('_', '-')} is {getattr(self, name)}; give 1 or more")
        if not self.lr > 0:
            raise CheckpointError(f"warm-start --lr is {self.lr}; give a positive learning rate such as 2e-3")
        if self.warmup_steps < 0:
            raise CheckpointError(f"warm-start --warmup-steps is {self.warmup_steps}; give 0 or more")
        if not 0 <= self.label_smoothing < 1:
            raise CheckpointError(f"warm-start --label-smoothing is {self.label_smoothing}; give a value in [0, 1)"
                                  " such as 0.1 (0: plain cross entropy)")


@dataclass(frozen=True)
class Example:
    messages: list[dict]
    data_source: str
    answer: str

    @property
    def response(self) -> str:
        return f"\\boxed{{{self.answer}}}"


def read_examples(parquet: Path) -> list[Example]:
    """The rows of a tools.data parquet file (verl's RLHF schema) as prompt messages and ground truths."""
    if not parquet.is_file():
        raise CheckpointError(f"{parquet}: {'is a directory, not a file' if parquet.is_dir() else 'not found'}")
    try:
        rows = pq.read_table(parquet, columns=["prompt", "data_source", "reward_model"]).to_pylist()
    except (OSError, KeyError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise CheckpointError(f"{parquet}: not a tools.data parquet file ({first_line(exc)})") from None
    if not rows:
        raise CheckpointError(f"{parquet} has no rows")
    return [Example(r["prompt"], r["data_source"], r["reward_model"]["ground_truth"]) for r in rows]


def encode(tokenizer, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and labels, right-padded; labels cover the response and its EOS only."""
    seqs, labels = [], []
    for ex in examples:
        prompt = tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=True)
        response = tokenizer.encode(ex.response, add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append(prompt + response)
        labels.append([IGNORE] * len(prompt) + response)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    lab = torch.full((len(seqs), width), IGNORE)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, la) in enumerate(zip(seqs, labels, strict=True)):
        ids[i, :len(s)], lab[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), torch.tensor(la), 1
    return ids, mask, lab


def load_model(src: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=dtype, attn_implementation="eager")
    except (OSError, ValueError, KeyError, TypeError) as exc:  # what transformers raises for files it cannot use
        raise CheckpointError(f"{src}: transformers cannot load it ({first_line(exc)})") from None
    return model, tokenizer


@torch.no_grad()
def accuracy(model, tokenizer, examples: list[Example], sample: bool = False, max_new_tokens: int = 16,
             batch_size: int = 64) -> float:
    """The fraction of `examples` that the strict boxed reward scores 1: greedy decoding, or with `sample` one sample
    at temperature 1 (what a GRPO rollout draws)."""
    from tools.reward.verl_entry import compute_score

    model.eval()
    tokenizer.padding_side = "left"
    correct = 0
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False)
                   for ex in batch]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False,
                        return_token_type_ids=False)
        sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0} if sample else {"do_sample": False}
        out = model.generate(**enc, max_new_tokens=max_new_tokens, **sampling,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(compute_score(ex.data_source, text, ex.answer) for ex, text in zip(batch, texts, strict=True))
    return correct / len(examples)


def train(model, tokenizer, examples: list[Example], settings: Settings, progress: bool = True) -> list[float]:
    """AdamW on the response tokens' label-smoothed cross entropy, linear warm-up then cosine decay; returns the loss
    of every step."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(settings.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)

    def scale(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        done = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * done))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, scale)
    model.train()
    losses = []
    bar = tqdm(range(settings.steps), desc="warm start", unit="step", disable=not progress, mininterval=5)
    for _ in bar:
        pick = torch.randint(len(examples), (settings.batch_size,), generator=gen).tolist()
        ids, mask, labels = encode(tokenizer, [examples[i] for i in pick])
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # position t predicts token t + 1
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten(),
                                                 ignore_index=IGNORE, label_smoothing=settings.label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)  # drawn at mininterval, not every step
    return losses


TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check_inputs(src: Path, train_file: Path, dst: Path, settings: Settings,
                 held_out: Path | None = None) -> list[Example]:
    """CheckpointError naming what is wrong before any work (every input file read: config, index, shard
    headers, tokenizer files, the parquet files); returns the train rows."""
    settings.check()
    if not (src / INDEX).is_file():
        raise CheckpointError(f"{src}: no {INDEX}; give a sharded HF checkpoint such as make-tiny's")
    if dst.exists():
        raise CheckpointError(f"{dst} exists; remove it or give another --dst (a warm start is never written over)")
    load_config(src)
    reader_spans(ShardedReader(src))
    for name in TOKENIZER_JSON:
        if (src / name).exists():
            read_json(src / name, name)
    if held_out:
        read_examples(held_out)
    return read_examples(train_file)


def warm_start(src: Path, train_file: Path, dst: Path, settings: Settings = Settings(), held_out: Path | None = None,
               say=print, progress: bool = True) -> dict:
    """Fine-tune the checkpoint at `src` on `train_file` and write it to `dst` in `src`'s layout, whole or not at all
    (built in `<dst>.partial`, renamed when complete); returns the report."""
    examples = check_inputs(src, train_file, dst, settings, held_out)
    torch.manual_seed(settings.seed)
    test = read_examples(held_out) if held_out else []
    report = {"settings": asdict(settings), "source": str(src), "train_file": str(train_file),
              "train_rows": len(examples)}
    if test:  # in bf16, as the RL run computes, and as the result is measured below
        report["held_out_accuracy_before"] = accuracy(*load_model(src, torch.bfloat16), test)
    model, tokenizer = load_model(src, torch.float32)
    say(f"warm start: {settings.steps} steps of {settings.batch_size} on {len(examples)} rows of {train_file}")
    report["loss"] = train(model, tokenizer, examples, settings, progress)
    partial = dst.with_name(dst.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted run left
    write_like(src, partial, model.state_dict())
    if test:  # the written (bf16) weights, as the RL run will load them
        trained, tokenizer = load_model(partial, torch.bfloat16)
        report["held_out_accuracy"] = accuracy(trained, tokenizer, test)
        say(f"held-out accuracy: {report['held_out_accuracy_before']:.3f} before, "
            f"{report['held_out_accuracy']:.3f} after the warm start ({len(test)} rows, greedy)")
    (partial / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    partial.rename(dst)
    return report


def write_like(src: Path, dst: Path, state: dict[str, torch.Tensor]) -> None:
    """`state` written with `src`'s shards, tensor names and dtypes, config.json and tokenizer files."""
    reader = ShardedReader(src)
    spans = reader_spans(reader)  # each tensor's dtype, from the shard headers alone
    missing = sorted(set(spans) - set(state))
    if missing:
        raise CheckpointError(f"the trained model lacks {len(missing)} tensors of {src}, e.g. {missing[:3]}")
    stored = {name: state[name].detach().to(spans[name].dtype).contiguous() for name in reader.names()}
    write_checkpoint(dst, load_config(src), stored, {}, len(reader.shards()), split_scales=False)
    for extra in src.iterdir():
        if extra.is_file() and extra.name.startswith(("tokenizer", "special_tokens")):
            shutil.copyfile(extra, dst / extra.name)
