"""Where things are: the files this package ships, and where its outputs go.

Shipped files (patch sets, the model file, the apply script, the Dockerfiles, the demo corpus) are
package data, found through importlib.resources, so a regular `pip install` works from any folder:
pip installs packages as plain folders, so each is a real path. Outputs go under the current
folder (build/, dist/), as `make` in a checkout has always put them.
"""

import os
from importlib.resources import files
from pathlib import Path


def shipped(*parts: str) -> Path:
    return Path(str(files("ministream").joinpath(*parts)))


PATCH_SETS = shipped("fork", "patches")  # patches/vX/: one patch set per supported vLLM release
RELEASE_PINS = shipped("fork", "releases.json")  # sha256 of the supported releases' wheels and sdists
CPU_LINES = shipped("fork", "lines.json")  # how each release with a CPU build runs here (`make matrix RUN=1`)
MODEL_FILE = shipped("fork", "models", "ministream.py")  # the hand-made model file (0.32.0's llama.py + ours)
APPLY_SCRIPT = shipped("fork", "apply_patch.sh")  # applies a patch set to a vLLM tree
DOCKER = shipped("fork", "docker")  # Dockerfiles and their scripts
CORPUS = shipped("data", "corpus.txt")  # the demo models' training text
HELDOUT = shipped("data", "heldout.txt")  # text of the same kind the demo models never trained on (perplexity)

# Outputs, relative to the current folder (the checkout's root under `make`).
BUILD = Path("build")  # build/vllm-X/ (patched trees), build/cache/ (release artifacts), build/bench/
DIST = Path("dist")  # our wheels
# downloaded release artifacts; MINISTREAM_CACHE shares one cache between checkouts and folders
CACHE = Path(os.environ.get("MINISTREAM_CACHE") or BUILD / "cache")
