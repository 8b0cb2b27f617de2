#!/usr/bin/env bash
# gpu-proof's engines on a GPU machine that reaches no package index (docs/gpu.md, "Run on an H200").
# Run from the repository root of a copy of the tree, after `ministream gpu-proof VERSION --export` here:
#   scripts/gpu_offline.sh VERSION [PARALLEL]
# BUNDLE (default .gpu/) may hold archives split into NAME.00, NAME.01, ...: site.tar.xz (the patched CUDA wheel and
# the requirements the machine lacks, installed with pip --target here: unpacked onto PYTHONPATH), any other the
# export's files (unpacked into the tree). JOBS: the jobs file (default: the whole export). The outputs go to
# $OUT/outputs.json (OUT: default build/gpu-proof/VERSION/offline-run), with each probe process's log; judge them
# where the export was made: ministream gpu-proof VERSION --judge outputs.json
set -euo pipefail
version=${1:?usage: scripts/gpu_offline.sh VERSION [PARALLEL]}
parallel=${2:-4}
bundle=${BUNDLE:-.gpu}
work=build/gpu-proof/$version/offline-run
out=${OUT:-$work}
mkdir -p "$work" "$out"
started=$(date +%s)
# each archive, once: NAME.tar[.xz].00, .01, ... concatenated; site.* onto /tmp/ministream-site, the rest into the tree
site=/tmp/ministream-site
mkdir -p "$site"
for first in "$bundle"/*.00; do
  [ -e "$first" ] || continue
  base=${first%.00}; name=$(basename "$base")
  [ -e "$site/.unpacked-$name" ] && continue
  case $name in site.*) into=$site ;; *) into=. ;; esac
  case $name in *.xz) unpack="xz -dc -T0" ;; *) unpack=cat ;; esac
  cat "$base".[0-9][0-9] | $unpack | tar -x -C "$into"
  touch "$site/.unpacked-$name"
done
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
jobs=${JOBS:-build/gpu-proof/$version/offline/jobs.json}
[ -f "$jobs" ] || { echo "error: $jobs is missing: run \`ministream gpu-proof $version --export\` first" >&2; exit 2; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
# vLLM samples with FlashInfer where it is installed; this machine has not got it (a JIT package of its own)
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
echo "unpacked in $(($(date +%s) - started)) s"
nvidia-smi -L
python3 -c 'import sys, torch, vllm; print(sys.version.split()[0], "torch", torch.__version__, "vllm", vllm.__version__, vllm.__file__)'
python3 -m ministream.checks.gpu_probe "$jobs" "$work/outputs.json" --parallel "$parallel" || true
for log in "$work"/outputs.parts/probe-*.log; do
  [ "$out" = "$work" ] || cp "$log" "$out/"
  echo "== $log (tail)"; tail -n 15 "$log"
done
[ "$out" = "$work" ] || cp "$work/outputs.json" "$out/"
python3 - "$jobs" "$work/outputs.json" <<'EOF'
import json, sys
jobs, got = (json.load(open(p)) for p in sys.argv[1:3])
for job, g in zip(jobs, got):
    print(f"{job['name']}: {g.get('error') or 'ran'} {g.get('cudagraph_mode', '')} {g.get('engine_seconds', '')} s")
EOF
echo "done in $(($(date +%s) - started)) s"
