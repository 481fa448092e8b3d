#!/usr/bin/env bash
# Prepares a Debian machine to build, run and test spanlet: Debian packages,
# kernel headers for BCC, tracefs/bpffs mounts, and a Python virtual
# environment in .venv. Safe to run any number of times.
# --image: also what `make image` needs (podman, runc, mmdebstrap).
set -euo pipefail

image=0
for arg in "$@"; do
  case $arg in
    --image) image=1 ;;
    *) echo "setup: unknown option $arg (known: --image)" >&2; exit 2 ;;
  esac
done

here=$(cd "$(dirname "$0")/.." && pwd)
venv="${SPANLET_VENV:-$here/.venv}"
step() { printf '\n==> %s\n' "$*"; }
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

if [ "$(id -u)" != 0 ]; then
  echo "setup: must run as root (it installs packages and mounts tracefs/bpffs)" >&2
  exit 2
fi

# python3-dev: Python.h, for the span marker extension that the install builds.
debs=(python3-bpfcc bpftool linux-headers-cloud-amd64 iproute2 gcc make libc6-dev
      prometheus python3-venv python3-dev)
# clang-16 with its libFuzzer and sanitizer runtimes (libclang-rt-16-dev): the
# fuzz targets (make fuzz, which make test runs briefly; python3-dev's
# libpython to embed).
debs+=(clang-16 libclang-rt-16-dev)
# libbpf: the loader of the CO-RE objects (libbpf1), and its headers for
# building them (libbpf-dev: bpf_helpers.h, bpf_core_read.h, bpf_tracing.h).
debs+=(libbpf1 libbpf-dev)
# kubectl (Debian's kubernetes-client) for the manifests' `kubectl kustomize`
# test, unless a kubectl is already installed (another package of it would clash).
command -v kubectl >/dev/null || debs+=(kubernetes-client)
# The image build (scripts/image.sh): podman with runc, and mmdebstrap for the base.
[ "$image" = 1 ] && debs+=(podman runc mmdebstrap)
missing=()
for p in "${debs[@]}"; do have_pkg "$p" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  step "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  step "Debian packages present"
fi
# Debian starts its prometheus service on install; spanlet's tests run their
# own server on loopback, so the packaged one is left as the admin wants it.

step "kernel headers for $(uname -r)"
moddir="/lib/modules/$(uname -r)"
if [ -e "$moddir/build/include" ]; then
  echo "   $moddir/build already present: $(readlink -f "$moddir/build")"
else
  arch_hdr=$(ls -d /usr/src/linux-headers-*-cloud-amd64 2>/dev/null | sort -V | tail -n 1 || true)
  [ -n "$arch_hdr" ] || arch_hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -z "$arch_hdr" ]; then
    echo "setup: no linux-headers-*-amd64 folder under /usr/src" >&2
    exit 1
  fi
  common_hdr="${arch_hdr%-cloud-amd64}"; common_hdr="${common_hdr%-amd64}-common"
  mkdir -p "$moddir"
  ln -sfn "$arch_hdr" "$moddir/build"
  ln -sfn "$common_hdr" "$moddir/source"
  echo "   build -> $arch_hdr"
  echo "   source -> $common_hdr"
fi

step "mounts"
if ! mountpoint -q /sys/kernel/tracing; then
  mount -t tracefs tracefs /sys/kernel/tracing && echo "   mounted tracefs on /sys/kernel/tracing"
else
  echo "   tracefs already mounted"
fi
if ! mountpoint -q /sys/fs/bpf; then
  mount -t bpf bpf /sys/fs/bpf && echo "   mounted bpffs on /sys/fs/bpf"
else
  echo "   bpffs already mounted"
fi

step "Python virtual environment in $venv"
py="${SPANLET_PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
# BCC's module through a folder holding only its link, named in a .pth file.
source "$here/scripts/bcc_venv.sh"
bcc_into_venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# The editable install also builds the span marker extension in place
# (agent/libspanlet_marker.cpython-*.so).
"$venv/bin/python" -m pip install -q -e "$here[agent,test]"
"$venv/bin/python" -c 'import bcc, pyroute2, yaml, pydantic, spanlet.cli, spanlet.libspanlet_marker; print("   python modules import: bcc, pyroute2, yaml, pydantic, the span marker")'

step "native parts"
make -s -C "$here" native CC="${CC:-gcc}"
echo "   agent/_native/standin/ (the demo's stand-in CUDA and NVML)"

echo
echo "setup done: run the agent with 'make run', the tests with 'make test', the demo with 'make demo-agent' and 'make demo'"
