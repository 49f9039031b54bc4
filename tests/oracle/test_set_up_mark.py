"""A rank's set-up, as the harness's grace sees it (vdpcp.harness.setting_up): the oracle marks the stretch in which a
rank first uses its device (its memory figures and clock: on CUDA the context is created there) and builds or
borrows its model, and nothing after it. On the H200 at -n 16 that stretch was where two ranks lagged their peers."""

from contextlib import contextmanager

from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.harness import run_ranks
from vdpcp.matrix import runner
from vdpcp.matrix.case import Case
from vdpcp.oracle import arms

CASE = Case(MicrobatchSpec(images=((8, 8),) * 3, name="three"), 2)


def marked(ctx, case):
    """The case on this rank, with what happened inside and outside the set-up mark recorded in order."""
    events = []
    saved = arms.setting_up, arms.Memory, arms.Clock, arms.model_cache.acquire

    @contextmanager
    def mark():
        events.append("setting up")
        yield
        events.append("set up")

    def record(name, real):
        return lambda *args: events.append(name) or real(*args)

    arms.setting_up, arms.Memory, arms.Clock = mark, record("memory", saved[1]), record("clock", saved[2])
    arms.model_cache.acquire = record("model", saved[3])
    try:
        verdict = runner.rank_body(ctx, case)
    finally:  # a warm worker runs the next case with the real ones
        arms.setting_up, arms.Memory, arms.Clock, arms.model_cache.acquire = saved
    return events, not verdict.failures


def test_the_oracle_marks_its_first_device_use_and_its_model_as_set_up_and_nothing_else():
    for events, passed in run_ranks(marked, 2, CASE):
        assert passed
        assert events[0] == "setting up" and events[-1] == "set up", events
        assert sorted(events[1:-1]) == ["clock", "memory", "model"], events
