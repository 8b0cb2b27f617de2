"""What the quick tier would otherwise make or fetch inside pytest, made beside `make test`'s install instead
(`make test-warm`), where pip leaves one core and the network idle for about two minutes: the two test models,
trained into build/cache/trained (demo.trained_file, where conftest.trained takes them), and the files of each
supported release that its patch set touches and its upstream part reads (port's and the matrix's first reads)
from PyPI into build/cache. The matrix rows' own reads (the internals', the model checks', an sdist's names) cost
CPU as well as waits (18-40 s a release, measured) and stay in pytest.

In a fresh clone these cost pytest about four minutes of its two saturated workers: training waits (a worker held
on the other's lock), and reads of single files from release wheels and sdists over HTTP. Nothing here is needed:
a failure is said and the suite makes or fetches what is missing itself.

pip replaces numpy while this runs, and torch imported half of a numpy being replaced once (`cannot import name
'NP_SUPPORTED_MODULES'`, docs/testing.md), so numpy is hidden before torch is imported: torch runs without it and
training needs none (the same weights, byte for byte). Nothing imported here is one pip replaces.
"""

import sys
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODELS = ("tiny", "tiny-gqa")  # conftest's two test models


def _said(what: str, work) -> None:
    start = time.monotonic()
    try:
        work()
    except Exception as e:  # noqa: BLE001  # never fatal: pytest makes or fetches it again
        print(f"warm: {what}: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc(limit=2)
        return
    print(f"warm: {what} in {time.monotonic() - start:.0f}s", flush=True)


def train() -> None:
    import tempfile

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

    from ministream.checkpoint.demo import make_checkpoint
    from ministream.paths import CACHE

    torch.set_num_threads(1)  # the other core is the install's

    def one(preset: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            make_checkpoint(Path(tmp) / "m", preset, log=lambda *a: None, cache=CACHE)

    for preset in MODELS:
        _said(f"test model {preset}", lambda p=preset: one(p))


def fetch() -> None:
    from ministream.fork.patchset import supported_versions
    from ministream.fork.port import pristine_files
    from ministream.fork.release import NoSdist
    from ministream.fork.upstream import NoUpstream, upstream_files

    def release(version: str) -> None:
        pristine_files(version)
        try:
            upstream_files(version)
        except (NoSdist, NoUpstream):
            pass  # the release has none: its tests say so themselves

    with ThreadPoolExecutor(4) as pool:  # network-bound: the waits overlap
        for version in supported_versions():
            pool.submit(_said, f"release files of {version}", lambda v=version: release(v))


if __name__ == "__main__":
    sys.modules["numpy"] = None  # type: ignore[assignment]  # see above: torch then runs without numpy
    start = time.monotonic()
    with ThreadPoolExecutor(2) as both:
        for job in (train, fetch):
            both.submit(_said, job.__name__, job)
    print(f"warm: done in {time.monotonic() - start:.0f}s")
