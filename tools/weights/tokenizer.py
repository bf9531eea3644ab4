"""A small local tokenizer for tiny models: built with the `tokenizers` library, no hub download.

Character-level over what the synthetic arithmetic task and its prompts need (digits, operators,
letters, punctuation, LaTeX's `\\boxed{}`), plus the special tokens of a chat template, so that
`transformers.AutoTokenizer.from_pretrained(dir)` and `apply_chat_template` work as with a real
model. Ids stay below the tiny model's vocab_size.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL = ["<|begin_of_sentence|>", "<|end_of_sentence|>", "<|pad|>", "<|unk|>", "<|User|>", "<|Assistant|>"]
BOS, EOS, PAD, UNK = SPECIAL[:4]
# Single characters: enough for "What is 37 + 58 * 2? ... \boxed{153}" and ordinary English.
CHARACTERS = sorted(set(string.digits + string.ascii_letters + string.punctuation + " \n"))
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|User|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|Assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|>{% endif %}"
)


def vocabulary() -> dict[str, int]:
    """Token -> id: the special tokens first (ids 0 and 1 are BOS and EOS, as in DeepSeek-V3's config)."""
    return {token: i for i, token in enumerate([*SPECIAL, *CHARACTERS])}


def build() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK))
    # every character is its own token; the special tokens are matched whole before that
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL)
    return tokenizer


def write_tokenizer(dst: Path, vocab_size: int | None = None) -> int:
    """Write tokenizer.json and tokenizer_config.json into `dst`; returns the number of tokens."""
    size = len(vocabulary())
    if vocab_size is not None and size > vocab_size:
        raise ValueError(f"the tokenizer has {size} tokens but the model's vocab_size is {vocab_size};"
                         f" make the model with --set vocab_size={size} or more")
    dst.mkdir(parents=True, exist_ok=True)
    build().save(str(dst / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return size
