"""The two errors a caller of run_ranks can meet besides the case's own skip/xfail."""


class RankFailure(AssertionError):
    """A case failed on one or more ranks: a rank raised, died, or was still running at the timeout.

    An AssertionError so that pytest shows it as a test failure, not an error. The message names every
    failing rank and carries each one's traceback or stack; ``failures`` maps rank -> a one-line summary.
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures

    def __reduce__(self):
        return type(self), (self.args[0], self.failures)


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot serve this world size here (NCCL needs one GPU per rank).

    The pytest plugin turns it into a skip: a CPU machine asked for ``--backend nccl`` skips what it
    cannot run instead of failing it. Outside pytest it is an error.
    """
