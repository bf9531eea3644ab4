"""DeepSeek-V3's architecture numbers, read from a HF `config.json` (or a file of the same keys) into `Dims`.

Every field names the config.json key it comes from, and `dims_from_config` is the one place that says which keys
are required and what a missing or bad one means. The parameter counts are the model's, per part, for the memory
estimate; the tensors behind them are listed by tools/weights/hf.py (a test keeps the two in agreement).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from tools.model.errors import ConfigError

MODEL_TYPE = "deepseek_v3"


def _key(name: str, minimum: int = 1):
    """A field read from config.json's `name`, an integer >= `minimum`, required."""
    return field(metadata={"key": name, "minimum": minimum})


@dataclass(frozen=True)
class Dims:
    vocab: int = _key("vocab_size")
    hidden: int = _key("hidden_size")
    layers: int = _key("num_hidden_layers")
    dense_layers: int = _key("first_k_dense_replace", minimum=0)  # the first layers have a dense MLP
    intermediate: int = _key("intermediate_size")  # dense MLP
    moe_intermediate: int = _key("moe_intermediate_size")  # per routed expert
    experts: int = _key("n_routed_experts")
    shared_experts: int = _key("n_shared_experts", minimum=0)
    experts_per_token: int = _key("num_experts_per_tok")  # top-k routing
    heads: int = _key("num_attention_heads")
    q_lora_rank: int = _key("q_lora_rank")
    kv_lora_rank: int = _key("kv_lora_rank")
    qk_nope: int = _key("qk_nope_head_dim")
    qk_rope: int = _key("qk_rope_head_dim")
    v_head: int = _key("v_head_dim")
    max_positions: int = _key("max_position_embeddings")
    tie_embeddings: bool = field(default=False, metadata={"key": "tie_word_embeddings"})

    @property
    def qk_head(self) -> int:
        return self.qk_nope + self.qk_rope

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_layers

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    # ---- parameter counts (elements), per part
    @property
    def attention_params(self) -> int:
        """MLA: low-rank q and kv projections with their norms, the output projection, the two layer norms."""
        h = self.hidden
        q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.heads * self.qk_head
        kv = h * (self.kv_lora_rank + self.qk_rope) + self.kv_lora_rank \
            + self.kv_lora_rank * self.heads * (self.qk_nope + self.v_head)
        return q + kv + self.heads * self.v_head * h + 2 * h

    @property
    def expert_params(self) -> int:
        """One routed expert (gate, up, down); a shared expert has as many."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def router_params(self) -> int:
        return self.experts * self.hidden + self.experts  # gate weight and e_score_correction_bias

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def total_params(self) -> int:
        output = 0 if self.tie_embeddings else self.embedding_params
        return (self.layers * self.attention_params + self.dense_layers * self.dense_mlp_params
                + self.moe_layers * ((self.experts + self.shared_experts) * self.expert_params + self.router_params)
                + self.embedding_params + output + self.hidden)


def dims_from_config(config: Mapping, where: str = "config.json") -> Dims:
    """The dims of a DeepSeek-V3 config; a missing or bad key raises ConfigError naming it and `where`."""
    if config.get("model_type") not in (None, MODEL_TYPE):
        raise ConfigError(f"{where}: model_type is {config.get('model_type')!r}, expected {MODEL_TYPE!r}")
    values = {}
    for f in fields(Dims):
        key = f.metadata["key"]
        if "minimum" not in f.metadata:
            values[f.name] = bool(config.get(key, f.default))
            continue
        value, minimum = config.get(key), f.metadata["minimum"]
        if value is None:
            raise ConfigError(f"{where}: `{key}` is missing; a DeepSeek-V3 config.json sets it (an integer"
                              f" >= {minimum})")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{where}: `{key}` is {value!r}; a DeepSeek-V3 config needs an integer >= {minimum}"
                              " there")
        values[f.name] = value
    dims = Dims(**values)
    if dims.dense_layers > dims.layers:
        raise ConfigError(f"{where}: first_k_dense_replace {dims.dense_layers} > num_hidden_layers {dims.layers}")
    return dims
