#!/bin/bash
# in_trixie.sh CMD... : run CMD inside the Debian 13 userland /work/scratch/envs/trixie, in a private
# mount namespace (unshare -m), so the bind mounts vanish when CMD exits (safe to rm -rf the tree later).
# Bound in: /proc /sys /dev (+/dev/shm), this machine's pyenv (/root/.pyenv), /work/scratch/envs.
R=/work/scratch/envs/trixie
# trixie glibc 2.41 refuses dlopen of libs flagged exec-stack (IPEX libintel-ext-pt-cpu.so); 2 = allow
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.rtld.execstack=2}
[ -f $R/.ok ] || /work/scratch/envs/make_trixie.sh >&2 || exit 1
exec unshare -m --propagation private bash -c '
R=$1; shift
mkdir -p $R/root/.pyenv $R/work/scratch/envs
mount -t proc proc $R/proc
mount --rbind /sys $R/sys
mount --rbind /dev $R/dev
mount --bind /root/.pyenv $R/root/.pyenv
mount --bind /work/scratch/envs $R/work/scratch/envs
cd "${PWD}" 2>/dev/null || true
exec chroot $R /usr/bin/env -C "$PWD" PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"
' in_trixie "$R" "$@"
