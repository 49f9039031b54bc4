"""run_ranks: the one call a test makes to run a body on several ranks."""

import atexit
import os
import pickle
import threading

from vdpcp.harness import config, launcher
from vdpcp.harness.outcome import settle
from vdpcp.harness.pool import FAULT_GRACE_S, WorkerPool

_pool: WorkerPool | None = None
_pool_owner = 0  # the pid that made _pool: a forked child must not drive its parent's workers
_lock = threading.Lock()


def run_ranks(fn, world_size: int, *args, backend: str | None = None, timeout: float | None = None,
              fault_grace: float | None = None, **kwargs) -> list:
    """Run ``fn(ctx, *args, **kwargs)`` on ranks 0..world_size-1; their return values, indexed by rank.

    ``fn`` must be a module-level function (it is pickled by reference; test modules are fine), and
    args, kwargs and return values must pickle. ``backend``: "auto" (NCCL when there is a GPU per
    rank, else gloo), "nccl" or "gloo"; None takes the configured default. ``timeout``: seconds before
    a case counts as hung; None takes the configured default (120 s). ``fault_grace``: seconds the
    other ranks get to finish once one rank failed (default 3 s; as long as that rank had run, if
    longer); a case expected to fail with one rank raising and the rest stuck in a collective sets it
    short.

    Raises RankFailure if a rank raises, dies or hangs; skips or xfails if a rank does; raises
    BackendUnavailable if NCCL is forced without a GPU per rank. Under torchrun, see launcher.py.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size is {world_size!r}; expected a positive int")
    if "VDPCP_HARNESS_WORKER" in os.environ:
        raise RuntimeError("run_ranks was called inside a rank; a case body cannot start another case")
    timeout = config.default_timeout() if timeout is None else timeout
    what = f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', repr(fn))}"
    if launcher.active():
        return launcher.run_here(fn, world_size, args, kwargs, backend, timeout, what)
    chosen = config.resolve_backend(backend, world_size)
    call = _pickled_call(fn, args, kwargs, what)
    with _lock:
        grace = FAULT_GRACE_S if fault_grace is None else fault_grace
        outcomes = _shared_pool().run(call, world_size, chosen, timeout, config.default_preload(), grace,
                                      tolerate_threads=config.default_tolerated_threads())
    return settle(outcomes, f"{what} ({chosen}, world size {world_size})")


def deferred_imports() -> list[str]:
    """One line for each preload this process's ranks import after the fork, since forking past it is unsafe."""
    with _lock:
        pool = _pool if _pool is not None and _pool_owner == os.getpid() else None
        return [deferred.line for deferred in pool.deferred.values()] if pool else []


def shutdown() -> None:
    """Kill this process's warm workers (the pytest plugin calls it at session end; atexit does too)."""
    with _lock:
        if _pool is not None and _pool_owner == os.getpid():
            _pool.shutdown()


def _shared_pool() -> WorkerPool:
    global _pool, _pool_owner
    if _pool is None or _pool_owner != os.getpid():
        if _pool is None:
            atexit.register(shutdown)
        _pool, _pool_owner = WorkerPool(), os.getpid()
    return _pool


def _pickled_call(fn, args: tuple, kwargs: dict, what: str) -> bytes:
    if getattr(fn, "__module__", None) == "__main__":
        raise TypeError(f"{what} is defined in __main__, which rank workers cannot import; move it into a module")
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as err:
        raise TypeError(f"cannot send {what} and its arguments to the ranks: fn must be a module-level "
                        f"function and its arguments must pickle ({err})") from err
