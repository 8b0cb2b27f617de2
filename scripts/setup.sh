#!/usr/bin/env bash
# Create .venv/ with the tools' dependencies. torch is the CPU build where there is no GPU.
# Usage: scripts/setup.sh TORCH_VERSION
set -euo pipefail
torch_version=${1:?usage: setup.sh TORCH_VERSION}
cd "$(dirname "$0")/.."

# Two makes at once with a stale stamp (say, after a pull changed pyproject.toml) would run pip into one venv
# together: the second waits for the first here, then finds the stamp fresh.
if command -v flock >/dev/null; then
    exec {lock}<scripts/setup.sh
    flock "$lock"
    if [ .venv/.setup-done -nt pyproject.toml ] && [ .venv/.setup-done -nt scripts/setup.sh ]; then
        echo "setup: .venv set up by another make meanwhile"
        exit 0
    fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)

if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$torch_version' else 1)" 2>/dev/null; then
    echo "setup: torch $torch_version already in .venv"
elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" "torch==$torch_version"
else
    # A local wheel folder (pip's find-links) may hold the CPU build; otherwise PyTorch's CPU index has it.
    "${pip[@]}" "torch==$torch_version+cpu" 2>/dev/null \
        || "${pip[@]}" "torch==$torch_version+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
"${pip[@]}" -e '.[test,bench]'
touch .venv/.setup-done  # under the lock: a make waiting on it must find the stamp fresh
