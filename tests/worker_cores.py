"""Each pytest-xdist worker on cores of its own (`make test`: two workers on CI's two cores), set when conftest is
first imported, before torch loads OpenMP, which sizes its pool by the cores it may use.

Why: an engine binds an OpenMP thread to every core it may use, and every product waits at a barrier for all of
them, so an engine spread over a core the other worker keeps busy waits for it (docs/testing.md, the quick
tier's workers). Kept to its own core, each worker's engines run beside the other's, and the suite's engines
need not queue in one worker.

A test whose subject needs more cores than its worker's share (a core per tensor-parallel rank) is marked
`every_core`: conftest widens its worker to every core for that test, and the launcher's commands follow
(they take the affinity of the test that runs them, as subprocess.run's children inherit it)."""

import os

EVERY = frozenset(os.sched_getaffinity(0))  # the cores the run may use, before a worker takes its share


def share(cores: frozenset[int], worker: str | None, workers: int) -> frozenset[int] | None:
    """Worker `worker`'s ("gw0", "gw1", ...) equal share of `cores` among `workers` (the remainder unused), or None
    where there is nothing to share: not an xdist worker, one worker, or fewer cores than workers."""
    if not worker or workers < 2 or len(cores) < workers:
        return None
    per, ordered = len(cores) // workers, sorted(cores)
    index = int(worker.removeprefix("gw")) % workers
    return frozenset(ordered[index * per : (index + 1) * per])


# MINISTREAM_TEST_OWN_CORES=0: the workers share every core and the engines queue in one worker, to compare
OWN = (
    share(EVERY, os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")))
    if os.environ.get("MINISTREAM_TEST_OWN_CORES", "1") != "0"
    else None
)
if OWN is not None:
    os.sched_setaffinity(0, OWN)
