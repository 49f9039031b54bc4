"""Warm workers never outlive their caller: not at shutdown, not when it is killed or interrupted."""

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.harness.processes import alive, described
from vdpcp.harness import pool as pool_module
from vdpcp.harness import process as process_module
from vdpcp.harness import run_ranks, shutdown
from vdpcp.harness.pool import WorkerPool

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0


def worker_and_parent(ctx):
    return os.getpid(), os.getppid()


def pool_directory(ctx):
    return os.path.dirname(os.readlink("/proc/self/fd/1"))  # where the rank's output goes


def nap(ctx):
    Path(pool_directory(ctx), f"napping-{ctx.rank}").touch()  # tells the caller this rank is inside the case
    time.sleep(60)


def interrupt_once_napping(directory: str, world_size: int) -> None:
    """Ctrl-C this process once every rank is inside nap: mid-case, never before the case or after it."""
    _wait_for([Path(directory, f"napping-{rank}") for rank in range(world_size)])
    os.kill(os.getpid(), signal.SIGINT)


def write_files(ctx):
    """Files into the pool's folder as fast as a rank can make them (as its log and the rendezvous store write there),
    until the rank is killed."""
    folder = Path(pool_directory(ctx))
    for n in range(10**9):
        (folder / f"written-{ctx.rank}-{n}").touch()


def kill_once_written(directory: str, world_size: int) -> None:
    """SIGKILL this process once every rank has written a thousand files: mid-case, its ranks still writing."""
    _wait_for([Path(directory, f"written-{rank}-1000") for rank in range(world_size)])
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(marks: list[Path]) -> None:
    while not all(mark.exists() for mark in marks):
        time.sleep(0.05)


def _some(names, shown: int = 8) -> str:
    names = sorted(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def wait_until_gone(pids, within: float = GONE_WITHIN_S) -> list[int]:
    deadline = time.monotonic() + within
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


@pytest.fixture
def own_shared_pool(monkeypatch):
    """run_ranks's shared pool for this test alone, preloading nothing: what the test shuts down is its own, so the
    session's pool (and its preloads, seconds to import again) outlives it."""
    from vdpcp.harness import config
    from vdpcp.harness import run as run_module

    monkeypatch.setattr(run_module, "_pool", None)
    with config.configured(preload=()):
        yield
        shutdown()


def test_shutdown_kills_every_worker_and_the_zygote(own_shared_pool):
    pairs = run_ranks(worker_and_parent, 4)
    zygote = {parent for _, parent in pairs}
    assert len(zygote) == 1 and zygote != {os.getpid()}
    shutdown()
    assert wait_until_gone([pid for pid, _ in pairs] + list(zygote), within=0) == []
    assert len(run_ranks(worker_and_parent, 2)) == 2  # and the next case starts a new pool


def test_a_pytest_session_run_inside_a_test_leaves_the_callers_workers_warm(pytester):
    before = run_ranks(worker_and_parent, 2)  # the caller's workers and zygote, by pid
    pytester.makepyfile(test_inner="""
        from tests.harness.test_lifecycle import worker_and_parent

        def test_it(run_ranks):
            assert len(run_ranks(worker_and_parent, 2)) == 2
    """)
    pytester.runpytest().assert_outcomes(passed=1)  # in-process: its session ends inside this test
    assert run_ranks(worker_and_parent, 2) == before


# Each scenario runs in its own caller process: it prints its workers' and zygote's pids and its
# pool's directory, then the caller goes away in its own way.
CALLER = textwrap.dedent("""
    import os, signal, sys, threading
    from vdpcp.harness import run_ranks
    from tests.harness.test_lifecycle import (interrupt_once_napping, kill_once_written, nap, pool_directory,
                                              worker_and_parent, write_files)

    def start():
        pairs = run_ranks(worker_and_parent, 2, backend="gloo")
        print(*{pid for pair in pairs for pid in pair})
        directory = run_ranks(pool_directory, 1, backend="gloo")[0]
        print(directory, flush=True)
        return directory

    how = sys.argv[1]
    if how == "sigkill_from_thread":  # PDEATHSIG would follow the thread: the zygote must notice anyway
        spawner = threading.Thread(target=start)
        spawner.start()
        spawner.join()
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "interrupt":  # Ctrl-C in the middle of a case
        # Started as a background job of a script, this process inherits SIGINT ignored, and Python then
        # leaves it ignored: the Ctrl-C would be lost before the harness could see it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        directory = start()
        threading.Thread(target=interrupt_once_napping, args=(directory, 2), daemon=True).start()
        run_ranks(nap, 2, backend="gloo")
    if how == "sigkill_mid_case":  # its ranks writing into the pool's folder: the zygote must stop them before it
        # removes it, or a file made after rmtree listed the folder keeps it
        directory = start()
        threading.Thread(target=kill_once_written, args=(directory, 2), daemon=True).start()
        run_ranks(write_files, 2, backend="gloo")
""")


@pytest.mark.parametrize("how", ["sigkill_mid_case", "sigkill_from_thread", "interrupt"])
def test_workers_die_with_their_caller(how):
    caller = subprocess.run([sys.executable, "-c", CALLER, how], cwd=REPO, capture_output=True, text=True, timeout=120)
    printed = caller.stdout.splitlines()
    assert len(printed) == 2, caller.stderr
    pids, directory = [int(pid) for pid in printed[0].split()], Path(printed[1])
    assert len(pids) == 3 and directory.name.startswith("vdpcp-pool-")  # two workers and the zygote
    if how == "interrupt":
        assert "KeyboardInterrupt" in caller.stderr, f"the caller exited with {caller.returncode}, stderr {caller.stderr!r}"
    left = wait_until_gone(pids)
    assert left == [], f"still there: {described(left)}; the caller's stderr: {caller.stderr[-2000:]}"
    log = directory / "zygote.log"
    said = log.read_text()[-2000:] if log.exists() else ""
    assert not directory.exists(), f"left behind: {_some(p.name for p in directory.iterdir())}; the zygote said:\n{said}"


def test_an_interrupt_between_forks_leaves_no_worker_unowned(monkeypatch):
    forked, fork = [], pool_module.WorkerProcess

    def fork_then_interrupt(rank, zygote, directory):
        if forked:
            raise KeyboardInterrupt
        forked.append(fork(rank, zygote, directory))
        return forked[-1]

    pool = WorkerPool()
    monkeypatch.setattr(pool_module, "WorkerProcess", fork_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        pool.run(pickle.dumps((worker_and_parent, (), {})), 2, "gloo", timeout=60)
    assert wait_until_gone([forked[0].pid], within=0) == []
    assert forked[0].conn.closed  # the pool reaped it, rather than leaving it to die with the zygote


def has_module(ctx, name):
    return name in sys.modules


def test_preloaded_modules_are_in_every_rank_before_the_case_imports_them():
    """Both arms on fresh pools: warm workers keep what earlier cases imported, which would hide a missing preload."""
    rarely_imported = "xml.dom.minidom"
    call = pickle.dumps((has_module, (rarely_imported,), {}))
    found = {}
    for preload in ((), (rarely_imported,)):
        pool = WorkerPool()
        try:
            found[preload] = [o.value for o in pool.run(call, 2, "gloo", timeout=60, preload=preload)]
        finally:
            pool.shutdown()
    assert found == {(): [False, False], (rarely_imported,): [True, True]}


@pytest.mark.parametrize("gone", ["with_ready_unread", "before_ready"])
def test_a_caller_gone_with_a_reply_unread_or_unsent_still_has_its_folder_removed(tmp_path, gone):
    """A caller that dies with a zygote message unread in its socket makes the zygote's next read fail with
    ECONNRESET, not end-of-file (Linux, connection-oriented Unix sockets), and one gone before the zygote's next
    message makes that send fail (EPIPE); the zygote must still remove the pool's folder."""
    directory = tmp_path / "vdpcp-pool-test"
    directory.mkdir()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Started as the pool starts it (on a GPU machine the CUDA driver's thread is tolerated: without that the zygote
    # refused to start there and this test failed for another reason), but by hand, so its ready stays unread.
    argv, env = process_module.zygote_command(theirs.fileno(), directory, (), ())
    with open(tmp_path / "zygote.log", "wb") as log, theirs:
        zygote = subprocess.Popen(argv, cwd=REPO, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, env=env)
    try:
        if gone == "with_ready_unread":
            assert select.select([ours], [], [], 60)[0], "the zygote sent no ready within 60 s"
        ours.close()
        code = zygote.wait(timeout=30)
    finally:
        zygote.kill()
    said = (tmp_path / "zygote.log").read_text()
    assert not directory.exists() and code == 0, f"exit code {code}, folder left: {directory.exists()}; it said:\n{said}"
