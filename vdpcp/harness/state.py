"""Per-case hygiene on a rank: each case starts as if in a fresh process, except for the process group.

torch's global knobs are put back to what they were when the rank started, and libraries that keep
parallel state in globals are torn down after the case. The harness never imports such a library
itself; it only cleans up one that the case imported.
"""

import sys
from contextlib import contextmanager

CASE_SEED = 67280421310721  # torch's historical default seed; rank r starts at CASE_SEED + r
_fresh: dict | None = None


@contextmanager
def clean_case(rank: int):
    """Around one case's body on ``rank``: fresh torch state before, libraries' parallel state released after."""
    reset(rank)
    returned = False
    try:
        yield
        returned = True
    finally:
        release_libraries(destroy_groups=returned)


def remember_fresh() -> None:
    """Record torch's settings as they are now, in a process no case has run in yet."""
    global _fresh
    if _fresh is not None:
        return
    import torch

    _fresh = {
        "dtype": torch.get_default_dtype(),
        "device": torch.get_default_device(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def reset(rank: int) -> None:
    """Seed torch (every GPU too) with CASE_SEED + rank and put its global settings back to fresh.

    A fresh process of this torch draws a random seed; a fixed one per rank keeps a case reproducible
    run to run while ranks still draw different numbers, as separate processes would.

    A setting is only written when a case changed it: use_deterministic_algorithms alone imports
    torch._dynamo, over a second of a case's time.
    """
    import torch

    remember_fresh()
    torch.manual_seed(CASE_SEED + rank)
    if torch.get_default_dtype() != _fresh["dtype"]:
        torch.set_default_dtype(_fresh["dtype"])
    if torch.get_default_device() != _fresh["device"]:
        torch.set_default_device(_fresh["device"])
    if torch.are_deterministic_algorithms_enabled() != _fresh["deterministic"]:
        torch.use_deterministic_algorithms(_fresh["deterministic"])
    torch.set_grad_enabled(True)


def release_libraries(destroy_groups: bool = True) -> None:
    """Tear down MCore's model-parallel groups if the case set them up, so the next case can again.

    destroy_model_parallel only forgets MCore's groups: c10d keeps every one, and each gloo group its threads and
    sockets, which pile up in a long-lived worker over MCore's many groups a case. So after a case that
    returned, the groups MCore holds are destroyed too; after one that raised, a peer may still be inside one of
    them, and destroying it could wait on that peer: they are left to the pool (soundness check or re-fork).
    """
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not (parallel_state.is_initialized() or parallel_state.model_parallel_is_initialized()):
        return
    groups = groups_held_by(parallel_state) if destroy_groups else []
    parallel_state.destroy_model_parallel()
    destroy_together(groups)


def destroy_together(groups: list) -> None:
    """Destroy each process group, then drop the last references to them, each on a thread of its own, and wait.

    A gloo group's destructor joins its transport's event-loop thread, which sees the request to stop only when its
    poll times out: MCore's 20 groups, freed one after another, would each sleep out that timeout; freed together, the
    waits overlap. ``groups`` is emptied: the threads hold the last
    references, so a group that something else still holds is simply not freed yet.
    """
    import threading

    import torch.distributed as dist

    for _ in map(dist.destroy_process_group, groups):  # no loop variable left holding the last group
        pass
    threads = [threading.Thread(target=holder.clear, name="vdpcp-free-group") for holder in ([g] for g in groups)]
    groups.clear()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def groups_held_by(module) -> list:
    """The process groups a module's globals hold, alone or in lists, tuples and dicts; never the default group.

    A walk over a work list, not a function that calls itself: a nested function that recurses is a reference cycle
    (it holds itself in its closure), which kept every group it found, and their gloo threads, alive until the
    garbage collector's next pass, in the middle of the next case."""
    import torch.distributed as dist

    found: dict[int, object] = {}
    pending = [(value, 0) for value in vars(module).values()]
    while pending:
        value, depth = pending.pop(0)
        if isinstance(value, dist.ProcessGroup):
            if value is not dist.group.WORLD:
                found.setdefault(id(value), value)
        elif isinstance(value, (list, tuple)) and depth < 2:
            pending += [(item, depth + 1) for item in value]
        elif isinstance(value, dict) and depth < 2:
            pending += [(item, depth + 1) for item in value.values()]
    return list(found.values())
