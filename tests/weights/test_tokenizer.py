"""The local tokenizer that make-tiny writes: loads with transformers, round-trips the arithmetic task's
text, applies the chat template, and fits the model's vocabulary."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tools.weights.tiny import make_tiny
from tools.weights.tokenizer import write_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    dst = tmp_path_factory.mktemp("tiny")
    make_tiny(dst, overrides={"num_hidden_layers": 2})
    return AutoTokenizer.from_pretrained(dst)


@pytest.mark.parametrize("text", ["What is 37 + 58 * 2?", "so the answer is \\boxed{153}.", "(-4) / 2 = -2\nok"])
def test_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_chat_template(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)  # as DeepSeek-V3's config.json says
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|begin_of_sentence|><|User|>1+1?<|Assistant|>"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"},
                                         {"role": "assistant", "content": "\\boxed{2}"}])
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert max(ids) < 320  # the tiny model's vocab_size


def test_a_vocabulary_too_small_for_the_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size is 50"):
        write_tokenizer(tmp_path, vocab_size=50)
