"""Per-case hygiene on a rank: each case starts as if in a fresh process, except for the process group.

torch's global knobs are put back to what they were when the rank started, and libraries that keep
parallel state in globals are torn down after the case. The harness never imports such a library
itself; it only cleans up one that the case imported.
"""

import sys

_fresh: dict | None = None


def remember_fresh() -> None:
    """Record torch's settings as they are now, in a process no case has run in yet."""
    global _fresh
    if _fresh is not None:
        return
    import torch

    _fresh = {
        "seed": torch.initial_seed(),
        "dtype": torch.get_default_dtype(),
        "device": torch.get_default_device(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def reset() -> None:
    """Put torch's RNG and global settings back to their fresh values (seeding covers every GPU).

    A setting is only written when a case changed it: use_deterministic_algorithms alone imports
    torch._dynamo, over a second of a case's time.
    """
    import torch

    remember_fresh()
    torch.manual_seed(_fresh["seed"])
    if torch.get_default_dtype() != _fresh["dtype"]:
        torch.set_default_dtype(_fresh["dtype"])
    if torch.get_default_device() != _fresh["device"]:
        torch.set_default_device(_fresh["device"])
    if torch.are_deterministic_algorithms_enabled() != _fresh["deterministic"]:
        torch.use_deterministic_algorithms(_fresh["deterministic"])
    torch.set_grad_enabled(True)


def release_libraries() -> None:
    """Tear down MCore's model-parallel groups if the case set them up, so the next case can again."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and (
        parallel_state.is_initialized() or parallel_state.model_parallel_is_initialized()
    ):
        parallel_state.destroy_model_parallel()
