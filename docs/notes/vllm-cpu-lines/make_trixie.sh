#!/bin/bash
# make_trixie.sh: a Debian 13 (trixie) minbase userland at /work/scratch/envs/trixie (idempotent),
# with the libraries this machine's pyenv Python 3.11 links to, and this machine's CA bundle.
set -euo pipefail
R=/work/scratch/envs/trixie
[ -f $R/.ok ] && exit 0
command -v debootstrap >/dev/null || { apt-get update -qq; apt-get install -y -qq debootstrap; }
[ -x $R/bin/sh ] || nice -n 19 debootstrap --variant=minbase \
  --include=libffi8,libssl3t64,libsqlite3-0,libbz2-1.0,liblzma5,libreadline8t64,zlib1g,libncursesw6,libuuid1,libtirpc3t64,libnsl2,libcrypt1,libgomp1,libnuma1,ca-certificates \
  trixie $R http://deb.debian.org/debian
command -v $R/usr/bin/g++ >/dev/null && [ -f $R/usr/lib/x86_64-linux-gnu/libnuma.so.1 ] || { chroot $R apt-get update -qq; chroot $R apt-get install -y -qq --no-install-recommends libnuma1 g++; }  # g++: torch.compile (inductor) builds C++
mkdir -p $R/etc/ssl/certs && cp /etc/ssl/certs/ca-certificates.crt $R/etc/ssl/certs/ca-certificates.crt
touch $R/.ok
