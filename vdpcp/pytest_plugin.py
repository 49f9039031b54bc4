"""vdpcp's pytest plugin (a pytest11 entry point: any project that installs vdpcp has it): harness options,
the ``run_ranks`` fixture, the matrix for ``vdpcp_case``, ``--replay``, and the pools' shutdown.

``--vdpcp-impl IMPL`` (repeatable; ini ``vdpcp_impl``; default the built-ins reference and mcore) names the
implementations whose matrix parametrizes every test that takes a ``vdpcp_case`` argument (see
vdpcp.testing); ``--vdpcp-cp N`` (repeatable) limits its CP sizes.

Options: ``--backend {auto,nccl,gloo}`` (default: $VDPCP_BACKEND, else auto) and
``--vdpcp-timeout SECONDS`` per case (default: $VDPCP_TIMEOUT, else 120); ``--vdpcp-max-spec-bytes BYTES``, the
memory a case may need before it is refused unrun (vdpcp.matrix.budget; default: $VDPCP_MAX_SPEC_BYTES, else 8G). The ini setting
``vdpcp_preload`` (default: $VDPCP_PRELOAD, comma-separated) names modules the rank zygote imports once
so that every rank starts with them. A test body runs on every rank; the test names it and a world size::

    def all_ranks_agree(ctx, value): ...          # module level, takes the RankContext first

    def test_agree(run_ranks):                    # or: from vdpcp.harness import run_ranks
        assert run_ranks(all_ranks_agree, 4, 1.5) == [True] * 4

Tests that use the fixture are marked ``distributed`` (``-m "not distributed"`` leaves them out).
Forcing ``--backend nccl`` where there is no GPU per rank skips the case instead of failing it.
megatron-core's notices that optional packages are missing are filtered out (see vdpcp.third_party).
"""

import pytest

from vdpcp import harness, third_party
from vdpcp.cli import RANKS, SECONDS, number
from vdpcp.harness.config import BACKENDS, configured
from vdpcp.matrix import budget


def pytest_addoption(parser):
    group = parser.getgroup("vdpcp", "vdpcp rank harness")
    group.addoption("--backend", choices=BACKENDS, default=None,
                    help="process-group backend for distributed cases (default: $VDPCP_BACKEND or auto: "
                         "nccl with a GPU per rank, else gloo)")
    group.addoption("--vdpcp-timeout", type=SECONDS, default=None, metavar="SECONDS",
                    help="seconds before a distributed case counts as hung (default: $VDPCP_TIMEOUT or 120)")
    parser.addini("vdpcp_preload", type="args", default=[],
                  help="modules imported once in the rank zygote, so every rank starts with them")
    group.addoption("--vdpcp-max-spec-bytes", default=None, metavar="BYTES",
                    help="refuse a case whose estimated memory on this machine is over BYTES, e.g. 16G "
                         "(default: $VDPCP_MAX_SPEC_BYTES or 8G; on GPUs nine tenths of the GPU)")
    group.addoption("--vdpcp-max-case-tflop", type=number(float, 0, above=True), default=None, metavar="TFLOP",
                    help="on the CPU, refuse a case of more work than this (default: $VDPCP_MAX_CASE_TFLOP or 2)")
    group.addoption("--vdpcp-tower", default="toy", metavar="SIZE",
                    help="tower size of the vdpcp_case matrix: toy (default) or real (the published sizes, for GPUs)")
    group.addoption("--vdpcp-impl", action="append", default=[], metavar="IMPL",
                    help="implementation whose matrix runs as the vdpcp_case tests (repeatable): a registered name "
                         "(vdpcp.implementations entry points) or module:object (default: reference and mcore)")
    group.addoption("--vdpcp-cp", action="append", type=RANKS, default=[], metavar="N",
                    help="CP sizes of the vdpcp_case matrix (repeatable; default 1 2 4 8)")
    parser.addini("vdpcp_impl", type="args", default=[], help="default for --vdpcp-impl")


_SESSION_SETTINGS = pytest.StashKey[list]()


def pytest_configure(config):
    for line in third_party.pytest_filterwarnings():
        config.addinivalue_line("filterwarnings", line)
    limit = config.getoption("vdpcp_max_spec_bytes")
    try:  # a bad figure is one usage error naming it, before anything is set
        budget.parse_bytes(limit, "--vdpcp-max-spec-bytes") if limit is not None else budget.limit()
    except budget.BudgetError as err:
        raise pytest.UsageError(str(err)) from None
    # The session's settings hold until pytest_unconfigure, which puts back what was there before (an
    # in-process pytest run, as pytester makes, must not leave its --backend or its spec limit to its caller).
    settings = [configured(backend=config.getoption("backend"), timeout=config.getoption("vdpcp_timeout"),
                           preload=config.getini("vdpcp_preload") or None),
                budget.limited(limit, "--vdpcp-max-spec-bytes"),
                budget.limited_flops(config.getoption("vdpcp_max_case_tflop"), "--vdpcp-max-case-tflop")]
    for scope in settings:
        scope.__enter__()
    config.stash[_SESSION_SETTINGS] = settings


def pytest_unconfigure(config):
    for settings in reversed(config.stash.get(_SESSION_SETTINGS, [])):
        settings.__exit__(None, None, None)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if "run_ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.distributed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except harness.BackendUnavailable as err:
        pytest.skip(str(err))


def pytest_generate_tests(metafunc):
    if "vdpcp_case" not in metafunc.fixturenames:
        return
    from vdpcp import testing
    from vdpcp.cli import UsageError, checked_impls, checked_tower
    from vdpcp.impls import defaults
    from vdpcp.matrix.scenarios import CP_SIZES

    config = metafunc.config
    try:
        impls = checked_impls(config.getoption("vdpcp_impl") or config.getini("vdpcp_impl") or defaults()[0])
        tower = checked_tower(config.getoption("vdpcp_tower"), impls)
    except UsageError as err:
        raise pytest.UsageError(str(err)) from None
    cps = tuple(config.getoption("vdpcp_cp") or CP_SIZES)
    metafunc.parametrize("vdpcp_case", [p for impl in impls for p in testing.params(impl, cps, tower=tower)])


# Sessions open in this process. pytester's in-process runs open a session inside a test of another one, sharing
# its pool: the warm workers go at the outermost session's end, not at each inner one's (each inner shutdown would cost
# the outer session a zygote restart with every preload).
_open_sessions = 0


def pytest_sessionstart(session):
    global _open_sessions
    _open_sessions += 1


def pytest_sessionfinish(session):
    global _open_sessions
    _open_sessions = max(_open_sessions - 1, 0)
    if _open_sessions == 0:
        harness.shutdown()


@pytest.fixture
def run_ranks():
    """vdpcp.harness.run_ranks, for tests that would rather not import it."""
    return harness.run_ranks


# --replay: `pytest --replay SPEC.json [--replay-cp N ...]` runs saved cases as the session's only tests, each
# judged as `vdpcp replay` judges it (a known limit that fails the known way is an xfail), with its report.

_REPLAYS = pytest.StashKey[list]()


@pytest.hookimpl(specname="pytest_addoption")
def pytest_addoption_replay(parser):
    from vdpcp.cli import DTYPES, SPLITS

    group = parser.getgroup("vdpcp-replay", "vdpcp replay of saved microbatch specs")
    group.addoption("--replay", action="append", default=[], metavar="SPEC.json",
                    help="run this spec (repeatable) as the only test, sharded against unsharded")
    group.addoption("--replay-cp", type=RANKS, default=None, metavar="N", help="CP ranks (default: the file's, or its name's -cp<N> tag)")
    group.addoption("--replay-impl", default=None, metavar="IMPL", help="implementation (default: the file's, else reference)")
    group.addoption("--replay-split", default=None, metavar="SPLIT",
                    help=f"the implementation's partition (default: the file's, else its first; the reference's: {', '.join(SPLITS)})")
    group.addoption("--replay-dtype", choices=DTYPES, default=None, help="dtype (default: the file's, else float64)")
    group.addoption("--replay-no-even-pad", action="store_const", const=False, default=None, help="switch off even-grid padding")
    group.addoption("--replay-mutant", default=None, metavar="NAME", help="apply a named mutant of the sharded path")
    group.addoption("--replay-no-known-limits", dest="replay_known_limits", action="store_false",
                    help="judge as if the implementation declared no known limit, so an upstream bug's reproduction "
                         "fails until it is fixed")


@pytest.hookimpl(specname="pytest_configure")
def pytest_configure_replay(config):
    # Load every spec now, so a bad file is one usage error naming the file and field before anything runs.
    from vdpcp.cli import UsageError
    from vdpcp.cli.replay import load_case

    if not config.getoption("replay"):  # nothing to load: a bad spec limit is pytest_configure's to name, unprefixed
        config.stash[_REPLAYS] = []
        return
    options = dict(impl=config.getoption("replay_impl"), split=config.getoption("replay_split"),
                   dtype=config.getoption("replay_dtype"), even_pad=config.getoption("replay_no_even_pad"),
                   mutant=config.getoption("replay_mutant"))
    try:  # each case sized as replay sizes it: one over the spec limit is refused here, unrun
        with budget.limited(config.getoption("vdpcp_max_spec_bytes"), "--vdpcp-max-spec-bytes"):
            config.stash[_REPLAYS] = [(path, load_case(path, config.getoption("replay_cp"), **options))
                                      for path in config.getoption("replay")]
    except (UsageError, budget.BudgetError) as err:
        raise pytest.UsageError(f"--replay: {err}") from None


@pytest.hookimpl(specname="pytest_ignore_collect")
def pytest_ignore_collect_replay(collection_path, config):
    return True if config.stash.get(_REPLAYS, []) else None  # replays are the whole session: collect nothing else


@pytest.hookimpl(specname="pytest_collection_modifyitems", trylast=True)
def pytest_collection_modifyitems_replay(session, config, items):
    replays = config.stash.get(_REPLAYS, [])
    if not replays:
        return
    config.hook.pytest_deselected(items=list(items))
    items[:] = [ReplayItem.from_parent(session, name=f"replay[{path}]", spec_path=path, case=case) for path, case in replays]


class ReplayFailed(AssertionError):
    """A replayed spec did not pass; the message is the replay report."""


class ReplayItem(pytest.Item):
    def __init__(self, *, spec_path, case, **kwargs):
        super().__init__(**kwargs)
        self.spec_path, self.case = spec_path, case

    def runtest(self):
        from vdpcp.cli.replay import report
        from vdpcp.matrix.runner import run_judged

        known_limits = self.config.getoption("replay_known_limits")
        judged = run_judged(self.case, known_limits=known_limits)
        text = report(judged, self.spec_path, known_limits=known_limits)
        print(text)  # the plan, shown with -s or -rP even when the case passes
        if judged.verdict == "xfail":
            pytest.xfail(judged.why)
        if not judged.passing:
            raise ReplayFailed(text)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ReplayFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.spec_path, None, f"replay {self.spec_path}"
