#!/usr/bin/env bash
# Install what `make image` needs on a Debian/Ubuntu machine without a Docker engine:
# podman with the runc runtime (crun refuses hybrid cgroups), and debootstrap for the local base image.
# Quick when they are already there. Usage: scripts/image_prereqs.sh
set -euo pipefail
need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)
[ ${#need[@]} -eq 0 ] && { echo "image prereqs: podman, runc, debootstrap present"; exit 0; }
sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)
echo "image prereqs: installing ${need[*]} with apt-get"
"${sudo[@]}" apt-get update -q
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${need[@]}"
