#!/bin/sh
# The image's entry point: serve the model folder mounted at /model with `ministream serve`, i.e. the
# same defaults as `make serve` (CPU: every core for the model, KV cache sized for the container).
# Arguments go to `ministream serve` (e.g. --dtype float32 --tp 2 --vllm-args="--max-num-seqs 64").
set -eu
exec ministream serve "${MODEL:-/model}" --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}" "$@"
