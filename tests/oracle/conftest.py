import pytest

from vdpcp.feature import comm


@pytest.fixture
def one_rank_sums(monkeypatch):
    """The oracle run in-process as a CP group of one: a sum over the group is the rank's own tensors."""
    monkeypatch.setattr(comm, "all_reduce_sums", lambda tensors, group=None: [t.detach().clone() for t in tensors])
