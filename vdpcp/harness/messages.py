"""The messages between the caller's process and its warm workers, pickled over one socket each.

caller -> worker: a Task to run, or None to exit. worker -> caller: READY once torch is imported, then
one pickled Outcome per Task, before it SETTING_UP and SET_UP around each stretch the case body marks as its
set-up (worker.setting_up).
"""

from dataclasses import dataclass

READY = b"ready"
SETTING_UP, SET_UP = b"setting up", b"set up"


@dataclass(frozen=True)
class GroupSpec:
    """The process group a case runs in. A worker re-creates its group whenever this changes."""

    generation: int  # bumped by the pool whenever the group must be rebuilt
    world_size: int
    backend: str
    store_path: str  # a FileStore per generation: no ports, so parallel pools never collide


@dataclass(frozen=True)
class Task:
    rank: int
    group: GroupSpec
    call: bytes  # pickle of (fn, args, kwargs), unpickled on the rank so a failure is the rank's
    sys_path: list[str]  # the caller's, so workers import what the caller can (test modules too)
    cwd: str
    environ: dict[str, str]
