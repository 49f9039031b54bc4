"""After a case in which ranks raised but none died or hung: can its workers run the next case as they are?

Re-forking costs a worker every import its cases make (seconds where the zygote cannot preload them), so a
case that merely raised keeps its workers when its process groups are provably where a passing case leaves
them. Two small steps run on every rank of the case, each as a case of its own under a short timeout, and the
caller judges what the ranks returned:

1. ``census``: every process group agrees, across its members, on its members and on how many collectives
   (and point-to-point ops) it has issued: c10d's per-group sequence number counts both, so a rank that left
   an op pending, or skipped one its peers made, is caught without touching that group. A rank that
   initialised CUDA synchronises its device first: a sticky CUDA error raises there, and a kernel that never
   ends (an NCCL collective whose peers never came) hangs there, into the timeout.
2. ``echo``: the caller rebuilds the world group (destroying every group of the case, which waits for any op
   still in flight in them: a stuck one hangs there, into the timeout) and the new one carries an all_gather
   of a fresh nonce, whose result is checked.

Anything the check cannot establish (a private c10d name missing, a backend without sequence numbers, a
step raising or hanging) counts as unsound: the cost of a wrong "unsound" is one re-fork, the cost
of a wrong "sound" is a poisoned next case. Not seen: a group some object outside c10d still holds (destroying
it then leaves it alive, stuck op and all, but no later case reaches it through c10d). Everything else a kept
worker carries is what it carries after a passing case: state.py resets torch's global knobs and releases
MCore's groups either way; a body that changes other process-wide state and restores it only on success
leaves it changed.
"""

from vdpcp.harness.outcome import OK, Outcome


def census(ctx) -> dict[str, tuple[list[int], int]]:
    """On each rank: every process group it belongs to, by name, with its members and sequence number."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return {c10d._world.pg_names[pg]: (list(dist.get_process_group_ranks(pg)), pg._get_sequence_number_for_group())
            for pg in list(c10d._world.pg_map)}


def echo(ctx, nonce: int) -> list[list[int]]:
    """On each rank: every rank's (rank, nonce), all_gathered over the world group: on the rank's GPU under NCCL,
    on the CPU under gloo, whose groups carry either alike. A gloo rank on a shared GPU (VDPCP_DEVICE=cuda) whose
    case raised before touching CUDA would otherwise create its CUDA context here, which can take longer than the
    check is allowed where many processes do so at once, and sound workers would be re-forked; census has already
    synchronised any device a case used."""
    import torch
    import torch.distributed as dist

    device = ctx.device if ctx.backend == "nccl" else "cpu"
    mine = torch.tensor([ctx.rank, nonce], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, mine, group=ctx.group)
    return [t.tolist() for t in everyone]


def census_verdict(outcomes: list[Outcome]) -> str | None:
    """None when every group's members agree on its members and its count of ops; else why not, in one line."""
    failed = _failed(outcomes)
    if failed:
        return failed
    seen: dict[str, dict[int, tuple[list[int], int]]] = {}
    for o in outcomes:
        for name, (ranks, seq) in o.value.items():
            seen.setdefault(name, {})[o.rank] = (ranks, seq)
    for name, by_rank in sorted(seen.items()):
        members = next(iter(by_rank.values()))[0]
        if any(ranks != members for ranks, _ in by_rank.values()) or sorted(by_rank) != sorted(members):
            return (f"process group {name!r} differs between ranks: "
                    + ", ".join(f"rank {r} sees members {ranks}" for r, (ranks, _) in sorted(by_rank.items())))
        counts = {rank: seq for rank, (_, seq) in by_rank.items()}
        if len(set(counts.values())) > 1:
            return (f"ranks {members} left process group {name!r} after different numbers of collectives "
                    f"({', '.join(f'rank {r}: {n}' for r, n in sorted(counts.items()))}): one is pending or missing")
    return None


def echo_verdict(outcomes: list[Outcome], nonce: int) -> str | None:
    """None when every rank gathered every rank's (rank, nonce); else why not, in one line."""
    failed = _failed(outcomes)
    if failed:
        return failed
    expected = [[rank, nonce] for rank in range(len(outcomes))]
    wrong = next((o for o in outcomes if o.value != expected), None)
    return None if wrong is None else f"rank {wrong.rank}'s check all_gather returned {wrong.value}, expected {expected}"


def _failed(outcomes: list[Outcome]) -> str | None:
    return "; ".join(f"rank {o.rank}'s check {o.summary}" for o in outcomes if o.kind != OK) or None
