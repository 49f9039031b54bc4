"""A pool whose zygote is gone says so in one line, never with a traceback, and the next case starts a new one.

SIGTERM is what `timeout` and CI runners send a whole process group, the zygote included: it removes its folder,
its log with it, on the way out.
"""

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.harness.processes import alive
from tests.harness.test_lifecycle import own_shared_pool, pool_directory  # noqa: F401 - a fixture
from vdpcp.harness import RankFailure, run_ranks, shutdown
from vdpcp.harness.process import Zygote, ZygoteGone
from vdpcp.matrix.runner import CaseResult

GENEROUS_TIMEOUT = 60.0  # the zygote's death must be noticed long before it


def zygote_of(ctx):
    return os.getppid()  # workers are forked by the zygote


def stop_the_zygote(ctx, zygote: int):
    if ctx.rank == 0:
        os.kill(zygote, signal.SIGTERM)
    time.sleep(GENEROUS_TIMEOUT)  # the workers die with their zygote


def test_a_zygote_gone_under_a_case_fails_it_in_one_line_and_the_next_case_starts_a_new_one(own_shared_pool):  # noqa: F811
    zygote = run_ranks(zygote_of, 2)[0]
    with pytest.raises(RankFailure) as failure:
        run_ranks(stop_the_zygote, 2, zygote, timeout=GENEROUS_TIMEOUT)
    said = str(failure.value)
    assert said.startswith("the rank zygote is gone (") and len(said.splitlines()) == 1, said
    assert CaseResult(None, error=said).verdict == "error"  # as the runner reports the case
    fresh, folder = run_ranks(zygote_of, 2)[0], Path(run_ranks(pool_directory, 1)[0])
    assert fresh != zygote and not alive(zygote)
    os.kill(fresh, signal.SIGTERM)  # gone between cases, folder and all: shutting the pool down must not trip on it
    deadline = time.monotonic() + GENEROUS_TIMEOUT
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not folder.exists(), f"the zygote sent SIGTERM left its folder {folder}"
    shutdown()


def test_a_zygote_gone_with_a_fork_request_unread_is_gone_not_a_crash(monkeypatch):
    """Its socket then reads as reset, not closed."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.send(b"a fork request it never read")
    theirs.close()
    zygote = object.__new__(Zygote)
    zygote._sock = ours
    monkeypatch.setattr(Zygote, "_obituary", lambda self: "the rank zygote exited")
    with pytest.raises(ZygoteGone, match="the rank zygote exited"):
        zygote._receive(GENEROUS_TIMEOUT)
    ours.close()
