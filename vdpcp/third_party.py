"""Notices that third-party libraries print when imported and that say nothing about a case, silenced one by one.

megatron-core warns that Transformer Engine, Apex and absl are not installed (vdpcp needs none of them) and that
an import inside its inference package will move (a deprecation of its own code, not of vdpcp's calls), and
torch, which megatron has import its C++-extension builder, logs on a machine without CUDA that it found no
CUDA runtime. torch's forward-mode AD, at a process's first dual tensor, imports decompositions that torch 2.14
scripts with its own deprecated torch.jit.script, and warns so. Every rank printed them, and the harness echoes
what ranks print as `[rank r]` lines into test output and check reports. Other warnings from these libraries
still show.
"""

import contextlib
import io
import logging
import sys
import warnings

MEGATRON_NOTICES = ((r"Transformer Engine and Apex are not installed", UserWarning),
                    (r"absl\.logging is not installed", UserWarning),
                    (r"The following imports from `dynamic_context\.py` will be removed", DeprecationWarning))
MEGATRON = r"megatron\."
NO_CUDA_RUNTIME = "No CUDA runtime is found"


def silence_import_notices() -> None:
    for message, category in MEGATRON_NOTICES:
        warnings.filterwarnings("ignore", message=message, category=category, module=MEGATRON)
    logging.getLogger("torch.utils.cpp_extension").addFilter(_not_no_cuda_runtime)


def pytest_filterwarnings() -> list[str]:
    """The same warning filters as pytest's filterwarnings lines: pytest drops filters set while it loads
    its plugins, and sets its own around each test."""
    return [f"ignore:{message}:{category.__name__}:{MEGATRON}" for message, category in MEGATRON_NOTICES]


def _not_no_cuda_runtime(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(NO_CUDA_RUNTIME)


def import_cpp_extension_quietly() -> None:
    """Import torch.utils.cpp_extension (megatron imports it) with its no-CUDA-runtime notice dropped, for a
    process that forks ranks (the rank zygote): torch 2.6 prints that notice to stderr instead of logging it,
    which no filter reaches, and every rank would echo it. Any other output of the import still shows."""
    if "torch.utils.cpp_extension" in sys.modules:
        return
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            import torch.utils.cpp_extension  # noqa: F401
    finally:
        sys.stderr.write("".join(line for line in printed.getvalue().splitlines(keepends=True)
                                 if not line.startswith(NO_CUDA_RUNTIME)))


# torch 2.14's warning, at a process's first dual tensor, that its own use of torch.jit.script is deprecated
JIT_DEPRECATED = r"`torch\.jit\.script` is deprecated"


def ignore_jit_deprecation() -> None:
    """Inside a warnings.catch_warnings() block: drop JIT_DEPRECATED (vdpcp.oracle.observe.reads warms forward-mode AD under it)."""
    warnings.filterwarnings("ignore", message=JIT_DEPRECATED, category=FutureWarning)
