"""The warm start (tools/weights/warm_start.py): a real fine-tuning of make-tiny's model on synthetic-arith rows,
written in the source checkpoint's own layout, refused with a message that names the bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from tools.data.cli import main as data_main
from tools.weights import warm_start
from tools.weights.cli import main as weights_main
from tools.weights.io import INDEX, CheckpointError
from tools.weights.tiny import make_tiny

SUMS = ["--ops", "+", "--max-operand", "9", "--max-terms", "2", "--unique", "--instruction", "Answer in \\boxed{}."]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warm")
    make_tiny(tmp / "tiny")
    assert data_main(["synthetic-arith", "--dst", str(tmp / "data"), "--n", "100", "--test-ratio", "0.1", *SUMS]) == 0
    return tmp


@pytest.fixture(scope="module")
def warmed(inputs):
    settings = warm_start.Settings(steps=40, batch_size=16, lr=3e-3, warmup_steps=5)
    said = []
    report = warm_start.warm_start(inputs / "tiny", inputs / "data/train.parquet", inputs / "warm", settings,
                                   held_out=inputs / "data/test.parquet", say=said.append, progress=False)
    return inputs / "warm", report, said


def _tensors(ckpt):
    index = json.loads((ckpt / INDEX).read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(ckpt / shard), "pt") as f:
            out.update({name: (shard, f.get_tensor(name)) for name in f.keys()})
    return out


def test_the_response_is_the_boxed_answer_and_only_it_is_trained_on(inputs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(inputs / "tiny")
    (ex,) = warm_start.read_examples(inputs / "data/train.parquet")[:1]
    ids, mask, labels = warm_start.encode(tok, [ex])
    trained = [t for t in labels[0].tolist() if t != warm_start.IGNORE]
    assert tok.decode(trained) == f"\\boxed{{{ex.answer}}}{tok.eos_token}"
    prompt = tok.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=True)
    assert ids[0, :len(prompt)].tolist() == prompt and mask.sum() == len(prompt) + len(trained)


def smoothed_floor(eps: float, vocab: int) -> float:
    """The least label-smoothed cross entropy: the entropy of the smoothed one-hot target."""
    top, rest = 1 - eps + eps / vocab, eps / vocab
    return -top * math.log(top) - (vocab - 1) * rest * math.log(rest)


def test_fine_tuning_lowers_the_loss_and_learns_the_answer_format(warmed):
    ckpt, report, said = warmed
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    floor = smoothed_floor(report["settings"]["label_smoothing"], vocab)
    loss = [x - floor for x in report["loss"]]  # what is left to learn
    assert len(loss) == 40 and min(loss) > 0 and sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 / 4, loss
    # the random model never answers in the format; the fine-tuned one does, on problems it never saw
    assert report["held_out_accuracy_before"] == 0.0
    assert any("held-out accuracy: 0.000 before" in s for s in said)


def test_the_output_has_the_sources_layout_with_trained_weights(inputs, warmed):
    ckpt, report, _ = warmed
    before, after = _tensors(inputs / "tiny"), _tensors(ckpt)
    assert before.keys() == after.keys()
    for name, (shard, tensor) in before.items():
        assert after[name][0] == shard and after[name][1].dtype == tensor.dtype and after[name][1].shape == tensor.shape
    changed = [n for n in before if not torch.equal(before[n][1], after[n][1])]
    assert "lm_head.weight" in changed and "model.layers.1.mlp.experts.0.down_proj.weight" in changed
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (ckpt / name).read_bytes() == (inputs / "tiny" / name).read_bytes()
    saved = json.loads((ckpt / warm_start.REPORT).read_text())
    assert saved["settings"]["steps"] == 40 and saved["train_rows"] == 90 and saved["loss"] == report["loss"]


def test_the_loss_is_the_label_smoothed_cross_entropy_of_the_response(inputs):
    """A step's loss is (1 - eps) x transformers' own cross entropy + eps x the mean over the vocabulary of -log p,
    over the response tokens: the definition of label smoothing."""
    model, tok = warm_start.load_model(inputs / "tiny", torch.float32)
    row = warm_start.read_examples(inputs / "data/train.parquet")[:1]  # every draw of the step is this row
    ids, mask, labels = warm_start.encode(tok, row)
    with torch.no_grad():
        ce = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
    spread = -logp[labels[:, 1:] != warm_start.IGNORE].mean(-1).mean().item()
    assert spread > ce  # a random model: the labels a little likelier than the average token
    for eps in (0.0, 0.1):
        settings = warm_start.Settings(steps=1, batch_size=2, lr=1e-12, label_smoothing=eps)
        (loss,) = warm_start.train(model, tok, row, settings, progress=False)  # measured before its update
        assert loss == pytest.approx((1 - eps) * ce + eps * spread, rel=1e-5), eps


def test_the_trained_model_boxes_its_answers_and_its_accuracy_is_reproducible(inputs, warmed):
    ckpt, report, _ = warmed
    model, tok = warm_start.load_model(ckpt, torch.bfloat16)
    test = warm_start.read_examples(inputs / "data/test.parquet")
    assert warm_start.accuracy(model, tok, test) == report["held_out_accuracy"]  # greedy: reproducible
    # the format is learnt: every greedy answer is a box, right or wrong
    enc = tok([tok.apply_chat_template(test[0].messages, add_generation_prompt=True, tokenize=False)],
              return_tensors="pt", add_special_tokens=False, return_token_type_ids=False)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).startswith("\\boxed{")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("steps", 0, "--steps is 0"), ("batch_size", -1, "--batch-size is -1"), ("lr", 0.0, "--lr is 0.0"),
    ("warmup_steps", -2, "--warmup-steps is -2"), ("label_smoothing", 1.0, "--label-smoothing is 1.0")])
def test_bad_settings_are_named(inputs, tmp_path, field, value, message):
    with pytest.raises(CheckpointError, match=message):
        warm_start.warm_start(inputs / "tiny", inputs / "data/train.parquet", tmp_path / "w",
                              warm_start.Settings(**{field: value}))
    assert not (tmp_path / "w").exists()


def test_bad_inputs_are_named_and_nothing_is_written(inputs, tmp_path, capsys):
    args = ["warm-start", "--src", str(tmp_path), "--train", str(inputs / "data/train.parquet"),
            "--dst", str(tmp_path / "w")]
    assert weights_main(args) == 2
    assert f"{tmp_path}: no {INDEX}" in capsys.readouterr().err
    (tmp_path / "rows.parquet").write_text("not parquet")
    args = ["warm-start", "--src", str(inputs / "tiny"), "--train", str(tmp_path / "rows.parquet"),
            "--dst", str(tmp_path / "w")]
    assert weights_main(args) == 2
    assert "not a tools.data parquet file" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_the_command_line_refuses_an_existing_destination(inputs, warmed, capsys):
    ckpt, _, _ = warmed
    args = ["warm-start", "--src", str(inputs / "tiny"), "--train", str(inputs / "data/train.parquet"),
            "--dst", str(ckpt), "--steps", "1"]
    assert weights_main(args) == 2
    assert "exists" in capsys.readouterr().err


def test_help_explains_every_setting(capsys):
    with pytest.raises(SystemExit) as exit_:
        weights_main(["warm-start", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "--dry-run" in out and "(written to DST.partial, then renamed)" in out
    for flag, words in (("--steps", "12-56% of held-out sums"), ("--batch-size", "drawn with replacement"),
                        ("--lr", "peak AdamW"), ("--warmup-steps", "cosine decay"), ("--seed", "seed of the draws"),
                        ("--label-smoothing", "spread over the whole vocabulary")):
        assert flag in out and words in out, flag


def test_dry_run_checks_and_writes_nothing(inputs, tmp_path, capsys):
    args = ["warm-start", "--src", str(inputs / "tiny"), "--train", str(inputs / "data/train.parquet"),
            "--dst", str(tmp_path / "w"), "--dry-run"]
    assert weights_main(args) == 0
    assert "on 90 rows" in capsys.readouterr().out and not (tmp_path / "w").exists()
    assert weights_main([*args, "--lr", "-1"]) == 2
    assert "--lr is -1.0" in capsys.readouterr().err
