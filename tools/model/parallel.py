"""A Megatron parallel layout of the model (the actor's, the ref's, a legacy checkpoint's), and what follows from it.

One layout is TP/PP/EP, the expert TP, MindSpeed's moe_tp_extend_ep and the layer list: the launcher reads one per
Megatron block of a recipe config (tools/launch/layout.py), `hf-to-mcore --format legacy` builds one from its flags
and writes it into the checkpoint's manifest, and the launcher's checkpoint check reads it back from there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tools.model.dims import Dims
from tools.model.errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert_tensor_parallel_size; None: the experts follow TP
    extend_ep: bool = False  # moe_tp_extend_ep: the experts are cut into EP x TP groups, none split over TP
    layer_list: tuple[int, ...] | None = None  # num_layer_list, layers per stage; None: an even split

    @property
    def model_parallel(self) -> int:
        """Ranks one copy of the model spans (the data-parallel size is the world over this)."""
        return self.tp * self.pp

    @property
    def expert_group(self) -> int:
        """Ranks the routed experts of a layer are divided between."""
        return self.ep * self.tp if self.extend_ep else self.ep

    @property
    def expert_tp(self) -> int:
        """Ranks each routed expert's weights are split over."""
        return 1 if self.extend_ep else (self.etp or self.tp)

    def experts_per_rank(self, dims: Dims) -> float:
        return dims.experts / self.expert_group

    def stage_sizes(self, layers: int) -> tuple[int, ...]:
        """Layers per pipeline stage: the layer list, else an even split (the first stages take a remainder, which
        Megatron refuses without a list: preflight and `checked` say so)."""
        if self.layer_list is not None:
            return self.layer_list
        return tuple(layers // self.pp + (i < layers % self.pp) for i in range(self.pp))

    def stages(self, layers: int) -> list[range]:
        """The global layer indices of each pipeline stage."""
        sizes = self.stage_sizes(layers)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [range(s, s + n) for s, n in zip(starts, sizes, strict=True)]

    # How `hf-to-mcore --format legacy` records the layout in manifest.json; converted checkpoints carry these names.
    def to_manifest(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep,
                "layers_per_stage": list(self.layer_list) if self.layer_list is not None else None,
                "tp_extend_ep": self.extend_ep}

    @classmethod
    def from_manifest(cls, layout: dict) -> ParallelLayout:
        return cls(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], extend_ep=layout["tp_extend_ep"],
                   layer_list=tuple(layout["layers_per_stage"]))


# The converters' names for the layout settings (tools/weights flags), for the messages of `checked`.
FLAGS = {"tp": "--tp", "pp": "--pp", "ep": "--ep", "layer_list": "--num-layer-list", "extend_ep": "--moe-tp-extend-ep"}


def checked(dims: Dims, layout: ParallelLayout, names: dict[str, str] = FLAGS) -> ParallelLayout:
    """The layout with its layer list filled in, if `dims` can be cut that way; else ConfigError naming the setting
    (by `names`) and the numbers. Legacy rank files need every split exact."""
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    for attr, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        if value < 1:
            raise ConfigError(f"{names[attr]} is {value}; it must be at least 1")
    if layout.etp not in (None, replace(layout, etp=None).expert_tp):
        raise ConfigError(f"expert_tensor_parallel_size is {layout.etp}: each expert is split over {names['tp']} {tp},"
                          f" or not at all with {names['extend_ep']}; leave it unset")
    layers = layout.layer_list
    if layers is None:
        if dims.layers % pp:
            raise ConfigError(f"num_hidden_layers {dims.layers} is not divisible by {names['pp']} {pp};"
                              f" pass {names['layer_list']} with one count per stage")
        layers = layout.stage_sizes(dims.layers)
    if len(layers) != pp or sum(layers) != dims.layers or min(layers) < 1:
        raise ConfigError(f"{names['layer_list']} {','.join(map(str, layers))} must have {names['pp']} {pp} positive"
                          f" entries summing to num_hidden_layers {dims.layers} (sums to {sum(layers)})")
    t = names["tp"]
    checks = [
        ("num_attention_heads", dims.heads, tp, t),
        ("vocab_size", dims.vocab, tp, t),
        ("intermediate_size", dims.intermediate, tp, t),
        ("moe_intermediate_size * n_shared_experts", dims.moe_intermediate * dims.shared_experts or tp, tp, t),
        ("n_routed_experts", dims.experts, layout.expert_group,
         f"{names['ep']} * {t} (with {names['extend_ep']})" if layout.extend_ep else names["ep"]),
        ("moe_intermediate_size", dims.moe_intermediate, layout.expert_tp, t),
    ]
    for field, value, divisor, setting in checks:
        if value % divisor:
            raise ConfigError(f"{field} {value} is not divisible by {setting} = {divisor}")
    return ParallelLayout(tp, pp, ep, layout.etp, layout.extend_ep, tuple(layers))
