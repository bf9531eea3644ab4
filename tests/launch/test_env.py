"""Environment profiles and the per-node facts behind their computed variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.launch import config, env

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "deepseek_r1"


def test_parse_route_finds_interface_source_and_local():
    assert env.parse_route("10.0.0.1 via 10.0.0.254 dev enp189s0f0 src 10.0.0.7 uid 0\n    cache\n") == (
        "enp189s0f0", "10.0.0.7", False)
    assert env.parse_route("local 10.0.0.7 dev lo table local src 10.0.0.7 uid 0") == ("lo", "10.0.0.7", True)
    assert env.parse_route("") == (None, None, False)


def test_pick_jemalloc_prefers_ldconfig_and_so_2():
    ldconfig = ("\tlibjemalloc.so.2 (libc6,AArch64) => /usr/lib/aarch64-linux-gnu/libjemalloc.so.2\n"
                "\tlibjemalloc.so (libc6,AArch64) => /usr/lib/aarch64-linux-gnu/libjemalloc.so\n")
    assert env.pick_jemalloc(ldconfig, []) == "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"
    assert env.pick_jemalloc("", ["/usr/local/lib/libjemalloc.so"]) == "/usr/local/lib/libjemalloc.so"
    assert env.pick_jemalloc("", []) is None


def test_node_env_computes_and_notes():
    profile = env.load_profile(RECIPE, "a3")
    facts = env.NodeFacts("10.0.0.1", "eth1", "10.0.0.2", False, "/opt/jemalloc/lib/libjemalloc.so.2")
    e, notes = env.node_env(profile, facts)
    assert e["LD_PRELOAD"] == "/opt/jemalloc/lib/libjemalloc.so.2" and notes == []
    assert e["HCCL_SOCKET_IFNAME"] == e["GLOO_SOCKET_IFNAME"] == e["TP_SOCKET_IFNAME"] == "eth1"
    assert e["MASTER_ADDR"] == "10.0.0.1" and not set(profile.left_out) & set(e)
    e, notes = env.node_env(profile, env.NodeFacts("10.0.0.1", None, None, False, None))
    assert "LD_PRELOAD" not in e and len(notes) == 4


def test_gather_facts_on_this_machine_sees_loopback_as_local():
    facts = env.gather_facts("127.0.0.1")
    assert facts.master_is_local


def test_unknown_profile_is_named():
    with pytest.raises(config.ConfigError, match="launch.env_profile: no profile 'b9'.*a3, cpu"):
        env.load_profile(RECIPE, "b9")
