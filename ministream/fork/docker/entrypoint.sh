#!/bin/sh
# The image's entry point, on Docker's convention, so that a recipe written for vllm/vllm-openai runs with this
# image by changing only the image's name:
#   no arguments, or options first -> `ministream serve` of the folder at $MODEL (default /model) on $HOST:$PORT,
#                                     with `make serve`'s defaults (every core for the model, a KV cache sized for
#                                     the container, in-flight requests drained on SIGTERM). The options are
#                                     serve's (--dtype float32, --tp 2) or vLLM's: --model DIR names the folder,
#                                     --tensor-parallel-size and --served-model-name set serve's own, the rest
#                                     (--max-num-seqs 64) go to vLLM as they are
#   a folder first                 -> the same, serving that folder (vLLM's image: `docker run IMAGE MODEL ...`)
#   a command (vllm serve ..., ministream ..., sh)  -> that command, as it is
# Every value is forwarded quoted, as one argument: HOST='0.0.0.0 --api-key x' is a host serve refuses, not an
# option, and PORT='*' is not globbed (tests/test_entrypoint.py runs this script with such values).
set -eu
host=${HOST:-0.0.0.0} port=${PORT:-8000}
case "${1:-}" in
"" | -*)
	for arg in "$@"; do
		case "$arg" in --model | --model=*) exec ministream serve --host "$host" --port "$port" "$@" ;; esac
	done
	exec ministream serve "${MODEL:-/model}" --host "$host" --port "$port" "$@"
	;;
*)
	if [ -d "$1" ]; then exec ministream serve --host "$host" --port "$port" "$@"; fi
	exec "$@"
	;;
esac
