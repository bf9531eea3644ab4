"""Preflight: layout, batch and memory arithmetic of a run, as pure functions over a Layout and the model dims.

Every check returns the numbers it used, so the printed table (check, value, rule, ok) shows why it passed or
which field to change. Tests call these functions directly; `python -m tools.launch ... --dry-run` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tools.launch.fields import KEY
from tools.launch.layout import Layout
from tools.model.dims import Dims
from tools.perf.memory import Estimate, estimate


@dataclass(frozen=True)
class Check:
    name: str
    field: str   # the config key to change when it fails
    value: str   # the numbers used
    rule: str
    ok: bool
    fix: str = ""

    def message(self) -> str:
        fix = f"; {self.fix}" if self.fix else ""
        return f"{self.field}: {self.name} fails: {self.value} breaks `{self.rule}`{fix}"


def _c(name, field, value, rule, ok, fix="") -> Check:
    return Check(name, field, str(value), rule, bool(ok), fix)


def _div(a: int, b: int) -> bool:
    return b > 0 and a % b == 0


def world_checks(lay: Layout) -> list[Check]:
    return [
        _c("world size", KEY["nodes"], f"{lay.nodes} x {lay.devices_per_node} = {lay.world}",
           "nodes x devices_per_node > 0", lay.world > 0),
        _c("verl nodes", KEY["trainer_nnodes"], f"{lay.trainer_nnodes} vs launch.nodes {lay.nodes}",
           "trainer.nnodes == launch.nodes", lay.trainer_nnodes == lay.nodes, "leave it as ${launch.nodes}"),
        _c("verl devices per node", KEY["trainer_devices"], f"{lay.trainer_devices} vs {lay.devices_per_node}",
           "trainer.n_gpus_per_node == launch.devices_per_node", lay.trainer_devices == lay.devices_per_node,
           "leave it as ${launch.devices_per_node}"),
    ]


def megatron_checks(lay: Layout, dims: Dims) -> list[Check]:
    tp, pp, ep, world = lay.train.tp, lay.train.pp, lay.train.ep, lay.world
    dp = lay.dp
    ep_group = ep * tp if lay.train.extend_ep else ep
    etp = 1 if lay.train.extend_ep else (lay.train.etp or tp)
    layers = lay.train.layer_list
    checks = [
        _c("TP x PP divides world", KEY["train.pp"], f"{world} % ({tp} x {pp})",
           "world % (TP*PP) == 0", _div(world, tp * pp)),
        _c("heads split by TP", KEY["train.tp"], f"{dims.heads} % {tp}", "heads % TP == 0",
           _div(dims.heads, tp)),
        _c("experts split by EP" + (" x TP (moe_tp_extend_ep)" if lay.train.extend_ep else ""),
           KEY["train.ep"], f"{dims.experts} % {ep_group}",
           "experts % (EP*TP) == 0" if lay.train.extend_ep else "experts % EP == 0", _div(dims.experts, ep_group)),
        _c("expert group fits a stage", KEY["train.ep"],
           f"DP*TP = {dp * tp} % (EP*ETP = {ep * tp if lay.train.extend_ep else ep * etp})",
           "EP*TP divides DP*TP" if lay.train.extend_ep else "EP*ETP divides DP*TP",
           _div(dp * tp, ep * (tp if lay.train.extend_ep else etp))),
        _c("extend-EP has no expert TP", KEY["train.etp"], f"etp={lay.train.etp}",
           "moe_tp_extend_ep => expert_tensor_parallel_size null or 1",
           not lay.train.extend_ep or lay.train.etp in (None, 1)),
    ]
    if layers is not None:
        # its length against PP is verl's rule (series_settings); the layer count is the model's, which we read here
        checks.append(_c("layer list sum", KEY["train.layer_list"], f"sum = {sum(layers)} vs {dims.layers} layers",
                         "sum(num_layer_list) == num_hidden_layers", sum(layers) == dims.layers))
    else:
        checks.append(_c("layers split by PP", KEY["train.pp"], f"{dims.layers} % {pp}",
                         "num_hidden_layers % PP == 0 (or set num_layer_list)", _div(dims.layers, pp)))
    largest_stage = max(layers) if layers else -(-dims.layers // max(1, pp))
    checks += [
        _c("recompute layers", KEY["recompute_num_layers"],
           f"{lay.recompute_num_layers} vs largest stage {largest_stage}",
           "block recompute: num_layers <= layers per stage",
           lay.recompute_method != "block" or (lay.recompute_num_layers or 0) <= largest_stage),
        _c("ref layout = actor layout", KEY["ref.tp"],
           f"ref TP{lay.ref.tp} PP{lay.ref.pp} EP{lay.ref.ep} vs actor TP{tp} PP{pp} EP{ep}",
           "ref and actor share one layout (the batch stays in place from ref to update)",
           (lay.ref.tp, lay.ref.pp, lay.ref.ep, lay.ref.layer_list) == (tp, pp, ep, layers)),
    ]
    return checks


def rollout_checks(lay: Layout, dims: Dims) -> list[Check]:
    tp, dp, inst, ep = lay.rollout_tp, lay.rollout_dp, lay.rollout_instances, lay.rollout_ep
    train_group = lay.train.ep * lay.train.tp if lay.train.extend_ep else lay.train.ep
    max_len = lay.max_model_len or dims.max_positions
    return [
        _c("rollout covers the world", KEY["rollout_dp"], f"{dp} x TP{tp} x {inst} = {dp * tp * inst}"
           f" vs {lay.world}", "rollout DP * TP * instances == world", dp * tp * inst == lay.world),
        _c("rollout heads split by TP", KEY["rollout_tp"], f"{dims.heads} % {tp}", "heads % TP == 0",
           _div(dims.heads, tp)),
        _c("rollout EP spans an instance", KEY["rollout_ep"], f"{ep} vs DP*TP = {dp * tp}",
           "rollout EP == DP * TP", ep == dp * tp) if lay.rollout_name == "vllm" else
        _c("rollout holds every expert", KEY["rollout_ep"], f"{ep} ({lay.rollout_name} rollout)",
           "rollout EP == 1 without vLLM", ep == 1),
        _c("rollout experts split by EP", KEY["rollout_ep"], f"{dims.experts} % {ep}",
           "experts % rollout EP == 0", _div(dims.experts, ep)),
        # without vLLM each rank takes whole layers (every expert), whatever the train expert group
        _c("expert reshard train -> rollout", KEY["rollout_ep"], f"{ep} % (EP*TP = {train_group})",
           "rollout EP % train expert group == 0", _div(ep, train_group)) if lay.rollout_name == "vllm" else
        _c("expert reshard train -> rollout", KEY["rollout_ep"],
           f"rollout EP {ep}, train expert group {train_group}", "without vLLM: every rank receives every expert",
           ep == 1),
        _c("sequence fits the model", KEY["response_len"],
           f"{lay.prompt_len} + {lay.response_len} = {lay.seq_len} vs {max_len}",
           "prompt + response <= max_model_len", lay.seq_len <= max_len),
        _c("prefill chunking", KEY["max_num_batched_tokens"],
           f"{lay.max_num_batched_tokens}, chunked_prefill={lay.chunked_prefill}, len {lay.seq_len}",
           "chunked prefill or max_num_batched_tokens >= prompt + response",
           lay.chunked_prefill or lay.max_num_batched_tokens >= lay.seq_len),
        _c("one batch per engine", KEY["max_num_seqs"],
           f"{lay.max_num_seqs} vs {lay.sequences} / {lay.engines} engines = {-(-lay.sequences // lay.engines)}",
           "max_num_seqs >= sequences per engine", lay.max_num_seqs * lay.engines >= lay.sequences),
        _c("memory fraction", KEY["gpu_memory_utilization"], lay.gpu_memory_utilization,
           "0 < gpu_memory_utilization <= 1", 0 < lay.gpu_memory_utilization <= 1),
    ]


def batch_checks(lay: Layout) -> list[Check]:
    """What verl cannot know: the rollout engines the recipe lays out, and the log-prob micro-batches per DP rank.
    The per-rank divisions and the on-policy skip are verl's rules (series_settings, run by config.check_series)."""
    seqs, dp = lay.sequences, max(1, lay.dp)
    per_rank = seqs // dp
    checks = [
        _c("sequences split over engines", KEY["train_batch"], f"{seqs} % {lay.engines} engines",
           "train_batch_size * n % (rollout DP * instances) == 0", _div(seqs, lay.engines)),
        _c("GRPO groups", KEY["n"], f"adv_estimator={lay.adv_estimator}, n={lay.n}", "grpo => n > 1",
           lay.adv_estimator != "grpo" or lay.n > 1),
        _c("one KL placement", KEY["use_kl_in_reward"],
           f"use_kl_loss={lay.use_kl_loss}, use_kl_in_reward={lay.use_kl_in_reward}",
           "not both KL loss and KL in reward", not (lay.use_kl_loss and lay.use_kl_in_reward)),
    ]
    for name, key, micro in (("ref log-prob micro-batch", KEY["ref_micro_batch"],
                              lay.ref_micro_batch),
                             ("rollout log-prob micro-batch", KEY["rollout_logprob_micro_batch"],
                              lay.rollout_logprob_micro_batch)):
        if micro:
            checks.append(_c(name, key, f"{per_rank} per DP rank % {micro}", "sequences per DP rank % micro == 0",
                             _div(per_rank, micro)))
    return checks


def memory_checks(est: Estimate) -> list[Check]:
    dev = est.device_gb
    outside = est.rollout_outside_vllm
    util_gb = est.vllm["budget (gpu_memory_utilization x device)"]
    kv_budget, kv_need = est.vllm["kv cache budget"], est.vllm["kv cache needed"]
    return [
        _c("update peak per die", KEY["train.pp"],
           f"{est.update_total:.1f} GB (stage {est.update_stage}) vs {dev:.0f} GB", "update peak <= device memory",
           est.update_total <= dev, "more PP/TP, recompute, swap_optimizer, or ref param_offload"),
        _c("room beside vLLM", KEY["gpu_memory_utilization"],
           f"{outside:.1f} GB resident + {util_gb:.1f} GB vLLM vs {dev:.0f} GB",
           "resident + gpu_memory_utilization x device <= device", outside + util_gb <= dev,
           "offload Megatron params/grads or lower gpu_memory_utilization"),
        _c("KV cache for one batch", KEY["gpu_memory_utilization"],
           f"needs {kv_need:.1f} GB, budget {kv_budget:.1f} GB", "kv needed <= kv budget", kv_need <= kv_budget,
           "raise gpu_memory_utilization or rollout EP, or lower max_num_seqs"),
    ]


def checkpoint_checks(lay: Layout) -> list[Check]:
    """Where a multi-node device run saves, and that its checkpoints do not fill the disk: a rank writes its shards
    under trainer.default_local_dir, so 16 nodes need one directory they all mount, and each A3 checkpoint is
    terabytes (checkpoint_cost). A CPU run is one node saving under its run dir."""
    ck = lay.checkpoints
    if lay.accelerator == "cpu":
        return []
    keep = "null" if ck.keep is None else ck.keep
    return [
        _c("checkpoints on a shared dir", KEY["checkpoints.dir"], f"save_freq={ck.save_freq}, dir={ck.dir or 'null'}",
           "saving (save_freq > 0) on a device profile => recipe.checkpoints.dir set", not ck.saves or ck.dir,
           "set recipe.checkpoints.dir=<a directory every node mounts> (or trainer.save_freq=-1)"),
        _c("checkpoints kept are bounded", KEY["checkpoints.keep"], f"save_freq={ck.save_freq}, keep={keep}",
           "saving on a device profile => max_actor_ckpt_to_keep >= 1", not ck.saves or ck.bounded,
           "set trainer.max_actor_ckpt_to_keep=2 (the newest and the one before)"),
    ]


def run(lay: Layout, dims: Dims, device_gb: float) -> tuple[list[Check], Estimate]:
    """Every arithmetic check of a run, in table order, and the memory estimate they used."""
    est = estimate(lay, dims, device_gb)
    checks = world_checks(lay) + megatron_checks(lay, dims) + rollout_checks(lay, dims) + batch_checks(lay)
    return checks + memory_checks(est) + checkpoint_checks(lay), est


def derived(lay: Layout, dims: Dims) -> list[tuple[str, str]]:
    """The sizes a run implies, for the plan."""
    dp = max(1, lay.dp)
    per_rank = lay.sequences // dp
    engines = lay.engines
    return [
        ("world", f"{lay.nodes} nodes x {lay.devices_per_node} = {lay.world} devices ({lay.cards} cards)"),
        ("train layout", f"TP{lay.train.tp} PP{lay.train.pp} EP{lay.train.ep}"
         + (" (moe_tp_extend_ep)" if lay.train.extend_ep else "")
         + f", layers per stage {list(lay.train.layer_list) if lay.train.layer_list else dims.layers // lay.train.pp}"),
        ("train DP per stage", f"{lay.world} / (TP{lay.train.tp} x PP{lay.train.pp}) = {dp}"),
        ("experts per rank (train)", f"{lay.train.experts_per_rank(dims):g}"),
        ("sequences per step", f"{lay.train_batch} prompts x {lay.n} = {lay.sequences}"),
        ("sequences per train DP rank", f"{per_rank}"),
        ("micro-batches per step (update)", f"{per_rank // lay.micro_batch} per DP rank"
         f" ({lay.train_batch // lay.mini_batch} mini-batch x {lay.ppo_epochs} epoch)"),
        ("micro-batches per step (ref)", f"{per_rank // lay.ref_micro_batch if lay.ref_micro_batch else '-'}"),
        ("rollout engines", f"{lay.rollout_instances} instance(s) x DP{lay.rollout_dp} = {engines} (TP{lay.rollout_tp},"
         f" EP{lay.rollout_ep} per instance)"),
        ("sequences per engine (max_num_seqs)", f"{-(-lay.sequences // engines)} (max_num_seqs {lay.max_num_seqs})"),
        ("experts per rank (rollout)", f"{dims.experts / lay.rollout_ep:g}"),
        ("tokens per sequence", f"{lay.prompt_len} + {lay.response_len} = {lay.seq_len}"),
    ]


def render(checks: list[Check]) -> str:
    rows = [("check", "value", "rule", "ok")] + [(c.name, c.value, c.rule, "ok" if c.ok else "FAIL") for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
                     for r in rows)


def render_memory(est: Estimate) -> str:
    lines = [f"memory per die (estimate, GB; device {est.device_gb:.0f} GB):",
             f"  update, worst stage {est.update_stage}:"]
    lines += [f"    {k:<34} {v:7.2f}" for k, v in est.update.items()]
    lines.append(f"    {'total':<34} {est.update_total:7.2f}")
    lines.append("  rollout, left beside vLLM:")
    lines += [f"    {k:<34} {v:7.2f}" for k, v in est.rollout_resident.items()]
    lines.append("  rollout, vLLM:")
    lines += [f"    {k:<40} {v:7.2f}" for k, v in est.vllm.items()]
    return "\n".join(lines)
