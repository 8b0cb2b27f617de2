"""make test's pytest-xdist workers each on cores of their own (worker_cores.py), a test marked every_core on all."""

import os

import pytest
import worker_cores
from worker_cores import share


def test_each_worker_takes_an_equal_share_of_the_cores_and_the_remainder_goes_unused():
    assert [share(frozenset({0, 1}), f"gw{i}", 2) for i in range(2)] == [{0}, {1}]
    assert [share(frozenset(range(16)), f"gw{i}", 2) for i in range(2)] == [set(range(8)), set(range(8, 16))]
    assert [share(frozenset({2, 5, 7}), f"gw{i}", 2) for i in range(2)] == [{2}, {5}]
    assert share(frozenset({0, 1, 2, 3}), "gw5", 3) == {2}  # a worker restarted by --maxworkerrestart: gw5 of 3


@pytest.mark.parametrize(
    "cores, worker, workers", [({0, 1}, None, 2), ({0, 1}, "gw0", 1), ({0}, "gw0", 2), ({0, 1, 2}, "gw1", 4)]
)
def test_nothing_is_shared_outside_a_worker_alone_or_with_fewer_cores_than_workers(cores, worker, workers):
    assert share(frozenset(cores), worker, workers) is None


def test_this_test_runs_on_its_workers_share():
    want = worker_cores.OWN if worker_cores.OWN is not None else worker_cores.EVERY
    assert os.sched_getaffinity(0) == want


@pytest.mark.every_core
def test_a_test_marked_every_core_runs_on_every_core():
    assert os.sched_getaffinity(0) == worker_cores.EVERY
