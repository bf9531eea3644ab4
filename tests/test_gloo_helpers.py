"""The collective tests' process runner fails a hung rank with its stack rather than waiting forever."""

from __future__ import annotations

import time

import pytest

from tests.gloo import run_processes


def _one_rank_hangs(rank, port, results):
    if rank == 1:
        time.sleep(600)  # a rank stuck in a collective whose peer is gone
    results[rank] = rank


def test_a_hung_rank_is_named_and_its_stack_printed(capfd):
    started = time.monotonic()
    # the deadline leaves rank 0 time to start: a spawned rank imports torch, 3 s on an idle 2-core machine, and over
    # 30 s in a fresh-clone CI run, with the Ray tests beside it
    with pytest.raises(TimeoutError, match=r"ranks \[1\] still ran"):
        run_processes(_one_rank_hangs, 2, deadline_s=90)
    assert time.monotonic() - started < 150
    assert "_one_rank_hangs" in capfd.readouterr().err


def test_ranks_that_finish_report_their_results():
    assert run_processes(_done, 2) == {0: 0, 1: 1}


def _done(rank, port, results):
    results[rank] = rank


def test_free_ports_gives_a_block_that_can_all_be_bound_and_skips_one_with_a_taken_port(monkeypatch):
    import socket

    from tests import gloo

    base = gloo.free_ports(32)
    assert all(gloo._bindable(base + i) for i in range(32))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 5))
        taken.listen()
        other = gloo.free_ports(32)
        candidates = iter([base, other])  # the block with the taken port is offered first
        monkeypatch.setattr(gloo, "free_port", lambda: next(candidates))
        assert gloo.free_ports(32) == other
