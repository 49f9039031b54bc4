"""A rank worker's models: built once per (implementation, size, dtype, device, what the build reads), then reused.

Building a real-size tower (its random initialisation) is most of what its case costs, so the oracle borrows one
model per case (``acquire``) and gives it back (``release``): its gradients reset, its requires_grad flags and
train/eval modes as built, and its weights (and buffers) proven unchanged against a fingerprint taken when it was
built. A case whose encode changed them fails, and the model is dropped, so no case ever sees another case's
weights. What a build depends on is the implementation's ``model_key(case)`` (vdpcp.contract.protocol); None builds
afresh for every case.

Models stay cached while their bytes together are under ``CAPACITY`` (the newest always stays), so a run over
several subjects or dtypes keeps one big tower at a time; toy towers (kilobytes) all stay.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

CAPACITY = 2 << 30  # bytes of cached models a rank keeps beyond the newest
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Entry:
    model: torch.nn.Module
    fingerprint: torch.Tensor
    requires_grad: dict[str, bool]
    training: dict[str, bool]
    bytes: int


_cache: OrderedDict[tuple, Entry] = OrderedDict()
_borrowed: dict[int, tuple[tuple | None, Entry]] = {}  # id(model) -> (its key, or None if not cached; its entry)


def acquire(impl, target: str, case, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, str]:
    """The model for ``case`` and how it came: "built" (for this case) or "reused" (built by an earlier one)."""
    key = impl.model_key(case)
    full = None if key is None else (target, key, str(dtype), str(device))
    if full is not None and full in _cache:
        _cache.move_to_end(full)
        entry, how = _cache[full], "reused"
    else:
        entry, how = _entry(impl.build_model(case, dtype, device)), "built"
        if full is not None:
            _cache[full] = entry
            _evict()
    _borrowed[id(entry.model)] = (full, entry)
    return entry.model, how


def release(model: torch.nn.Module) -> str | None:
    """Give ``model`` back after its case: None, or why the case changed it (then it is dropped from the cache)."""
    full, entry = _borrowed.pop(id(model))
    named = dict(model.named_parameters())
    for name, p in named.items():
        p.grad = None
        p.requires_grad_(entry.requires_grad.get(name, p.requires_grad))
    for name, module in model.named_modules():
        module.training = entry.training.get(name, module.training)
    changed = _changed(model, entry.fingerprint)
    if changed and full is not None:
        del _cache[full]  # freed once the case lets go of it
    if not changed:
        return None
    return (f"weights: the case changed the model's weights ({len(changed)} of {len(entry.fingerprint)} parameters "
            f"and buffers, e.g. {', '.join(changed[:3])}); an encode must leave the tower as it found it")


def cached() -> int:
    """How many models this rank holds (for tests)."""
    return len(_cache)


def _entry(model: torch.nn.Module) -> Entry:
    return Entry(model, fingerprint(model), {n: p.requires_grad for n, p in model.named_parameters()},
                 {n: m.training for n, m in model.named_modules()},
                 sum(t.numel() * t.element_size() for t in _state(model).values()))


def fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """One integer per parameter and buffer: each element's bit pattern times an odd weight drawn for its position
    (_weights), summed modulo 2^64. A change to any one element always changes it (an odd weight times a non-zero
    difference is never 0 modulo 2^64); changes to several leave it equal only where their differences times their
    positions' weights sum to a multiple of 2^64, as a hash collides. Weights, because a plain sum of the bit patterns
    misses changes whose deltas cancel (+2, -1 and -1 units in the last place of three elements); one multiply an
    element against a table kept on the device, because every rank sharing a GPU pays the release after every case."""
    tensors = list(_state(model).values())
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    sums: list[torch.Tensor | None] = [None] * len(tensors)
    for batch in _batches(tensors):
        for i, total in zip(batch, _batch_bits([tensors[i] for i in batch])):
            sums[i] = total
    return torch.stack([s.to(sums[0].device) for s in sums]).cpu()  # one wait for the device, not one a tensor


def _batches(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` in runs that are hashed together: on one device, up to one hash step of elements in
    all; a tensor of a step or more is a run alone (hashed in chunks). A tower's many small tensors (norms, biases)
    then cost a few kernels in all, not a few each: a toy tower's release is mostly per-kernel overhead. Widths may
    mix in a run: laid end to end they widen to the widest, and a signed integer keeps its value when it widens, so
    each element's bits are what they were."""
    runs: dict[torch.device, list[int]] = {}
    out: list[list[int]] = []
    sizes = [t.numel() * (2 if t.is_complex() else 1) for t in tensors]  # elements hashed: a complex one's two parts
    for i, t in enumerate(tensors):
        step = _step(t.device)
        if sizes[i] >= step:
            out.append([i])
            continue
        run = runs.setdefault(t.device, [])
        if run and sum(sizes[j] for j in run) + sizes[i] > step:
            out.append(run)
            run = runs[t.device] = []
        run.append(i)
    return out + [run for run in runs.values() if run]


def _batch_bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """_bits of each tensor, one pass over all of them: their bits end to end, each element weighted by its position
    counted from its own tensor's start, and each tensor's sum read off the running sum (wrapping, so exact)."""
    if len(tensors) == 1:
        return [_bits(tensors[0])]
    flats = [_flat(t) for t in tensors]
    device = flats[0].device
    sizes = torch.tensor([f.numel() for f in flats], dtype=torch.int64, device=device)
    ends = sizes.cumsum(0)
    bits = torch.cat(flats).to(torch.int64)
    starts = (ends - sizes).repeat_interleave(sizes, output_size=bits.numel())  # its size given: no wait for the GPU
    where = torch.arange(bits.numel(), dtype=torch.int64, device=device) - starts
    table = _weights(max(f.numel() for f in flats), device)  # each under a step: within the first span
    running = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), _weigh(bits, table[where]).cumsum(0)])
    return list((running[ends] - running[ends - sizes]).unbind())


def _changed(model: torch.nn.Module, before: torch.Tensor) -> list[str]:
    names = list(_state(model))
    after = fingerprint(model)
    if after.shape != before.shape:
        return names or ["(its parameter list)"]
    return [name for name, same in zip(names, (after == before).tolist()) if not same]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as the signed integers of their bit patterns, in one row."""
    t = t.detach()
    if t.is_complex():  # its real and imaginary parts, each as bits (a cast to real would drop the imaginary)
        t = torch.view_as_real(t)
    return t.contiguous().view(_INTS[t.element_size()]).reshape(-1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Sum over ``t``'s elements of bits x weight(position), modulo 2^64, a chunk at a time (the int64 temporaries
    stay small). Position i's weight is _odd(i mod _SPAN), times _odd(_SPAN_SALT + i // _SPAN) past the first span:
    one span's table serves every span, each later one scaled by an odd factor of its own, so a change moved by a
    whole span (two rows a span apart swapped) still changes the sum. The chunks' sums are scaled and added in one
    step at the end: a few kernels a chunk, none waiting for the device."""
    flat, step = _flat(t), _step(t.device)
    parts, spans, start = [], [], 0
    while start < flat.numel():
        span, at = divmod(start, _SPAN)
        stop = min(flat.numel(), start + step, (span + 1) * _SPAN)  # a chunk never crosses into the next span
        parts.append(_weigh(flat[start:stop].to(torch.int64), _weights(at + stop - start, t.device)[at:]).sum())
        spans.append(span)
        start = stop
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    # Nearly every tensor lies within the first span, whose factor is 1: no factor table, no host-to-device copy.
    if spans[-1] == 0:
        return torch.stack(parts).sum()
    factors = _span_factors(spans[-1] + 1, t.device)[torch.tensor(spans, device=t.device)]
    return (torch.stack(parts) * factors).sum()


def _span_factors(n: int, device: torch.device) -> torch.Tensor:
    """Each span's factor for spans 0 .. n-1 on ``device``: the first span's 1, each later one's an odd draw of its own."""
    return _kept(_factor_tables, n, device, _span_factor, least=64)


def _span_factor(span: torch.Tensor) -> torch.Tensor:
    return torch.where(span == 0, 1, _odd(_SPAN_SALT + span))


def _weigh(bits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each element's bits times its position's weight (wrapping: int64 products are exact modulo 2^64)."""
    return bits * weights


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """The weights of positions 0 .. n-1 (n at most _SPAN) on ``device``."""
    return _kept(_tables, n, device, _odd, least=1 << 10, most=_SPAN)


def _kept(tables: dict, n: int, device: torch.device, draw, least: int, most: int | None = None) -> torch.Tensor:
    """Entries 0 .. n-1 of the table ``draw`` gives for indices 0, 1, ... on ``device``, drawn once and kept in
    ``tables``: where n is past its end it is drawn again at least twice as long (at least ``least``, at most
    ``most`` entries), so a run of ever longer tensors redraws it a few times, not once a tensor."""
    table = tables.get(device)
    if table is None or table.numel() < n:
        size = max(n, 2 * (0 if table is None else table.numel()), least)
        table = tables[device] = draw(torch.arange(size if most is None else min(size, most), dtype=torch.int64,
                                                   device=device))
    return table[:n]


def _step(device: torch.device) -> int:
    """Elements hashed at a time on ``device``: never past a span, so a run of small tensors is all in the first."""
    return min(_HASH_CHUNK.get(device.type, _HASH_CHUNK["cuda"]), _SPAN)


# Elements a step. On a CPU, chunks that stay in cache (a larger chunk falls out of it and is ten times slower);
# on a GPU fewer, larger steps, each a few kernel launches.
_HASH_CHUNK = {"cpu": 1 << 16, "cuda": 1 << 22}
# Positions with a weight of their own: a GPU keeps their whole table, a CPU only what its tensors reach.
_SPAN = 1 << 22
_SPAN_SALT = 1 << 40  # the spans' factors are drawn apart from the positions' weights
_tables: dict[torch.device, torch.Tensor] = {}
_factor_tables: dict[torch.device, torch.Tensor] = {}
# splitmix64's constants as signed int64 (torch's integers are signed; its products wrap as unsigned ones would)
_GOLDEN, _MIX1, _MIX2 = -0x61C8864680B583EB, -0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15


def _odd(i: torch.Tensor) -> torch.Tensor:
    """A weight for each index: splitmix64 of index x the golden ratio, its lowest bit set."""
    return _mix(i * _GOLDEN) | 1


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, elementwise: each input bit flips about half the output bits."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """A logical right shift (torch's >> is arithmetic on signed integers)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _evict() -> None:
    """Drop the least recently used models while those beyond the newest hold more than CAPACITY bytes."""
    dropped_cuda = False
    while len(_cache) > 1 and sum(e.bytes for e in list(_cache.values())[:-1]) > CAPACITY:
        _, entry = _cache.popitem(last=False)
        dropped_cuda |= any(p.is_cuda for p in entry.model.parameters())
        del entry
    if dropped_cuda:
        torch.cuda.empty_cache()  # ranks sharing the GPU can use it again
