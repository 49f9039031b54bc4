"""Where runs are compared: the precision model, how far a sharded run may be from the unsharded one in the case's
dtype, and the comparisons that hold it.

float64 compares element by element with torch.testing.assert_close's float64 tolerances: its rounding stays far
inside them. Below float64 that does not hold. At the size people train, a row's value depends on what else is in
its batch (other GEMM shapes pick other kernels and other summation orders: "batch invariance", He et al., 2025):
with a Qwen2.5-VL-7B-sized tower in bf16 on a GPU, the same images encoded all together or in the groups CP=2
makes differ about as much as bf16 is off float64 (docs/precision.md). So every quantity
is held to what this case's own unsharded run measures of its own rounding (vdpcp.oracle.compare.rounding: ``slack``, twice its
relative distance from an exact run): each quantity passes when |sharded - unsharded| <= (rtol + slack) *
|unsharded| (2-norms), rtol being assert_close's for the dtype: per token row for outputs, per microbatch row
(image or frame) for input gradients, so one wrong image still fails; as one vector for parameter gradients (a sum
over every token of every image), the rank-alone ones with their own measured slack.
"""

from __future__ import annotations

import math

import torch

# assert_close's default (rtol, atol) for the floating dtypes, as torch documents them.
CLOSE = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
         torch.float64: (1e-7, 1e-7)}
# Its rtol for the dtypes compared as norms; float64 compares element by element.
RTOL = {dtype: rtol for dtype, (rtol, _) in CLOSE.items() if dtype != torch.float64}
ZERO_ROW = 1e-3
# Parameter gradients are summed over ranks and compared in buckets of this many elements, so a real-size tower
# never needs a second flat copy of its gradients (a float64 one would be the case's largest tensor).
BUCKET = 1 << 25


def low(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` compares as norms with measured slack (every dtype below float64)."""
    return dtype in RTOL


def row_relative(actual: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Per leading row, |actual - exact| / |exact| (2-norms, float64)."""
    a, e = _rows(actual), _rows(exact)
    return (a - e).norm(dim=1) / e.norm(dim=1).clamp_min(1e-300)


def segment_relative(actual, exact, cu_seqlens) -> torch.Tensor:
    """Per microbatch row of packed patches [1, N, D] (cu_seqlens' segments), |actual - exact| / |exact|."""
    segments = _segments(cu_seqlens, actual.device)
    diff, scale = _segment_norms(actual.detach().double() - exact.detach().double(), segments), _segment_norms(exact, segments)
    return diff / scale.clamp_min(1e-300)


def relative(actual, exact) -> float:
    """|actual - exact| / |exact| over lists of tensors (one per parameter; None is zeros), as one vector."""
    diffs, scales = [], []
    for a, e in zip(actual, exact):
        if e is None and a is None:
            continue
        e = torch.zeros_like(a) if e is None else e.detach()
        a = torch.zeros_like(e) if a is None else a.detach()
        diffs.append((a.double() - e.double()).square().sum())
        scales.append(e.double().square().sum())
    diff, scale = float(read_once(diffs, sum)), float(read_once(scales, sum))
    return math.sqrt(diff) / max(math.sqrt(scale), 1e-300)


# --- the comparisons -------------------------------------------------------------------------------------


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether assert_close would pass, answered by the one isclose it takes, for dense tensors of one floating dtype,
    device and shape: on the passing path, which nearly every comparison takes, its pairing and attribute checks
    cost more than the isclose itself (docs/performance.md). False sends anything else, and every mismatch, to
    assert_close itself, so its verdict and message stand."""
    tolerances = CLOSE.get(actual.dtype)
    same = (actual.dtype, actual.device, actual.shape) == (expected.dtype, expected.device, expected.shape)
    if tolerances is None or not same or actual.layout != torch.strided or expected.layout != torch.strided:
        return False
    rtol, atol = tolerances
    return bool(torch.isclose(actual.detach(), expected.detach(), rtol=rtol, atol=atol).all())


def compare(what: str, actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Element by element, with assert_close's tolerances for the dtype: why not, or None."""
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if close(actual, expected):
        return None
    try:
        torch.testing.assert_close(actual.detach(), expected.detach())
    except AssertionError as mismatch:
        return f"{what}: {str(mismatch).splitlines()[0]} (max abs error {max_abs(actual, expected):.3g})"
    return None


def compare_each(what: str, named) -> str | None:
    """compare() over (name, actual, expected) triples: why the first that differs does (named), or None. Runs of
    small ones that share a dtype, a device and their shapes are compared as one, laid end to end: the same elements
    against the same tolerances, in one comparison instead of a tower's dozens of small ones; only a run that fails
    is looked at one by one."""
    for run in _runs(named):
        if _uniform(run) and close(_end_to_end(a for _, a, _ in run), _end_to_end(e for _, _, e in run)):
            continue
        for name, actual, expected in run:
            why = compare(f"{what}: {name}", actual, expected)
            if why:
                return why
    return None


def max_abs_each(named) -> float:
    """The largest max_abs over (name, actual, expected) triples (0.0 for none)."""
    peaks = []
    for run in _runs(named):
        if _uniform(run):
            peaks.append(_peak(_end_to_end(a for _, a, _ in run), _end_to_end(e for _, _, e in run)))
        else:
            peaks.append(read_once([_peak(a, e) for _, a, e in run], max))
    return read_once(peaks, max) if peaks else 0.0


def peak_and_norms(named) -> tuple[float, float, float]:
    """max_abs_each, and |actual - expected|^2 and |expected|^2 as one vector in float64, over (name, actual,
    expected) triples, in one pass: a real-size tower's gradients read once in float64, not once per figure."""
    peaks, diffs, scales = [], [], []
    for run in _runs(named):
        uniform = _uniform(run)
        if not uniform:  # a pair whose shapes differ is inf, before its difference could be taken
            peaks.append(read_once([_peak(a, e) for _, a, e in run], max))
        a = torch.cat([t.detach().double().reshape(-1) for _, t, _ in run])
        e = torch.cat([t.detach().double().reshape(-1).to(a.device) for _, _, t in run])
        diff = a - e
        if uniform:
            peaks.append(diff.abs().max() if diff.numel() else 0.0)
        diffs.append(diff.square().sum())
        scales.append(e.square().sum())
    figures = read_once(peaks + diffs + scales, list)
    n = len(peaks)
    return (max(figures[:n]) if n else 0.0), float(sum(figures[n:2 * n])), float(sum(figures[2 * n:]))


def _peak(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor | float:
    """max_abs, left on the device where it is computed there (a float where the shapes alone say it)."""
    if actual.numel() == 0 or actual.shape != expected.shape:
        return 0.0 if actual.shape == expected.shape else math.inf
    return (actual.detach().double() - expected.detach().double()).abs().max()


def read_once(figures: list, fold) -> float:
    """``fold`` (max, sum) of per-parameter or per-run figures (0-d tensors, or floats), read off the device in one
    transfer (a tower's few hundred parameters would otherwise wait for the device a few hundred times), in the
    order they came, as Python folds floats (so a NaN is kept or dropped as it would be one at a time)."""
    on_device = [f for f in figures if isinstance(f, torch.Tensor)]
    read = iter(torch.stack([f.to(on_device[0].device) for f in on_device]).tolist() if on_device else [])
    values = [next(read) if isinstance(f, torch.Tensor) else f for f in figures]
    return fold(values)


# Elements laid end to end at most (a larger tensor is a run alone): a few MB more in float64, never a tower's copy.
END_TO_END = 1 << 20


def _runs(named):
    run, size = [], 0
    for item in named:
        if run and size + item[1].numel() > END_TO_END:
            yield run
            run, size = [], 0
        run.append(item)
        size += item[1].numel()
    if run:
        yield run


def _uniform(run) -> bool:
    dtype, device = run[0][1].dtype, run[0][1].device
    return all(a.shape == e.shape and a.dtype == e.dtype == dtype and a.device == e.device == device
               for _, a, e in run)


def _end_to_end(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def compare_rows(what: str, actual, expected, slack: torch.Tensor | None, unit: str = "row",
                 cu_seqlens=None, names=None) -> str | None:
    """Per row (or per microbatch row of packed patches, with ``cu_seqlens``): |actual - expected| <= (rtol + slack)
    * |expected| (+ a floor of ZERO_ROW x rtol x the largest row), 2-norms, ``slack`` per row (None: rtol alone). ``names``:
    what each row is called in the message (default: its index)."""
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    dtype = actual.dtype
    rtol = RTOL[dtype]
    if cu_seqlens is None:
        a, e = _rows(actual), _rows(expected)
        err, scale = (a - e).norm(dim=1), e.norm(dim=1)
    else:
        segments = _segments(cu_seqlens, actual.device)
        err = _segment_norms(actual.detach().double() - expected.detach().double(), segments)
        scale = _segment_norms(expected, segments)
    if err.numel() == 0:
        return None
    slack = torch.zeros_like(scale) if slack is None else slack.to(scale.device, torch.float64)
    # A floor for rows whose expected value is (almost) nothing: a ZERO_ROW share of the largest row's rtol.
    allowed = (rtol + slack) * scale + ZERO_ROW * rtol * scale.max()
    bad = (err > allowed).nonzero().flatten().tolist()
    if not bad:
        return None
    ratio = err / scale.clamp_min(1e-300)
    worst = max(bad, key=lambda i: float(err[i] / allowed[i]))
    name = worst if names is None else names[worst]
    return (f"{what}: {len(bad)} of {err.numel()} {unit}s off; {unit} {name}: relative 2-norm error "
            f"{float(ratio[worst]):.3g} exceeds {dtype}'s rtol {rtol:g}"
            + (f" + twice the unsharded run's own rounding of that {unit} ({float(slack[worst]) / 2:.2g})"
               if float(slack[worst]) else ""))


def compare_vector(what: str, diff_sq: float, scale_sq: float, dtype: torch.dtype, slack: float) -> str | None:
    """A vector (squared 2-norms of the difference and of the expected) within (rtol + slack) of the expected."""
    rtol = RTOL[dtype]
    diff, scale = math.sqrt(diff_sq), math.sqrt(scale_sq)
    if diff <= (rtol + slack) * scale:
        return None
    return (f"{what}: relative 2-norm error {diff / max(scale, 1e-300):.3g} exceeds {dtype}'s rtol {rtol:g}"
            + (f" + twice the unsharded run's own rounding ({slack / 2:.2g})" if slack else ""))


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.numel() == 0 or actual.shape != expected.shape:
        return 0.0 if actual.shape == expected.shape else math.inf
    return (actual.detach().double() - expected.detach().double()).abs().max().item()


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().double()
    return t.reshape(t.shape[0], math.prod(t.shape[1:])) if t.dim() > 1 else t.reshape(-1, 1)


def _segments(cu_seqlens, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the segment index of every patch, the patches of every segment) of packed patches."""
    cu = torch.as_tensor(cu_seqlens, device=device).long()
    counts = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(len(counts), device=device), counts), counts


def _segment_norms(t: torch.Tensor, segments) -> torch.Tensor:
    index, counts = segments
    squares = t.detach().double().reshape(-1, t.shape[-1]).square().sum(dim=1)
    return torch.zeros(len(counts), dtype=torch.float64, device=squares.device).index_add_(0, index, squares).sqrt()
