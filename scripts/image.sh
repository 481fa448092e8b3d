#!/usr/bin/env bash
# make image: the agent's container image, built with podman into the local
# store as localhost/spanlet:<version> and localhost/spanlet:latest, pulling
# nothing from a container registry. Three cached pieces:
#   - the base: a Debian root file system made by mmdebstrap from Debian's
#     packages, imported as localhost/spanlet-base:<key>, where key is a hash
#     of its recipe (suite, mirrors, packages, excludes): made once per recipe;
#   - the kernel headers: Debian's linux-headers-<series>-{common,cloud-amd64}
#     .debs, merged into one tree, kept per package version;
#   - podman's layer cache for the venv layers above them.
# Only the wheel of HEAD (git archive, like wheel_check.sh) is new per commit.
# Needs root, podman, runc and mmdebstrap (scripts/setup.sh --image).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
py="${SPANLET_PYTHON:-python3}"
source "$here/scripts/wheel_lib.sh"
cache="${SPANLET_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spanlet/image}"
started=$SECONDS
step() { printf '==> image (%ds): %s\n' $((SECONDS - started)) "$*"; }
source "$here/scripts/podman.sh"

for tool in podman runc mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "image: $tool missing: run scripts/setup.sh --image" >&2; exit 2; }
done
version=$("$py" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$here/pyproject.toml")
mkdir -p "$cache"

# --- the base --------------------------------------------------------------------
suite=bookworm
mirrors=("deb http://deb.debian.org/debian $suite main"
         "deb http://deb.debian.org/debian $suite-updates main"
         "deb http://deb.debian.org/debian-security $suite-security main")
# python3-bpfcc: BCC (libbcc and its LLVM) and its Python module; python3-venv:
# the venv and its pip; bpftool and iproute2 (tc) to look at what the agent
# loaded from a shell in the pod.
packages=(python3 python3-venv python3-bpfcc bpftool iproute2 ca-certificates)
excludes=('/usr/share/doc/*' '/usr/share/man/*' '/usr/share/info/*' '/usr/share/locale/*'
          '/usr/share/lintian/*' '/usr/share/bash-completion/*')
dpkgopts=(); for e in "${excludes[@]}"; do dpkgopts+=(--dpkgopt="path-exclude=$e"); done
key=$(printf '%s\n' "$suite" "${mirrors[@]}" "${packages[@]}" "${excludes[@]}" | sha256sum | cut -c1-16)
base="localhost/spanlet-base:$key"
if podman image exists "$base"; then
  step "base $base (cached)"
else
  step "base $base: mmdebstrap --variant=minbase $suite (${packages[*]})"
  tarball="$cache/base-$key.tar"
  mmdebstrap --quiet --variant=minbase --include="$(IFS=,; echo "${packages[*]}")" \
    "${dpkgopts[@]}" "$suite" "${tarball%.tar}.part.tar" "${mirrors[@]}"
  mv "${tarball%.tar}.part.tar" "$tarball"
  podman import -q "$tarball" "$base" >/dev/null
  rm -f "$tarball"
fi

# --- the kernel headers -----------------------------------------------------------
arch_pkg=$(apt-cache depends linux-headers-cloud-amd64 | awk '/Depends: linux-headers-/ {print $2; exit}')
common_pkg=$(apt-cache depends "$arch_pkg" | awk '/Depends: linux-headers-.*-common/ {print $2; exit}')
[ -n "$arch_pkg" ] && [ -n "$common_pkg" ] || { echo "image: no linux-headers-cloud-amd64 in apt's lists (apt-get update)" >&2; exit 1; }
hver=$(apt-cache policy "$arch_pkg" | awk '/Candidate:/ {print $2}')
headers="$cache/kernel-headers-$arch_pkg-$hver"
if [ -f "$headers/include/linux/kconfig.h" ]; then
  step "kernel headers $arch_pkg $hver (cached)"
else
  step "kernel headers: $arch_pkg and $common_pkg $hver merged"
  tmp=$(mktemp -d "$cache/headers.XXXXXX")
  (cd "$tmp" && apt-get download -qq "$arch_pkg" "$common_pkg")
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/x"; done
  mkdir -p "$tmp/tree/arch"
  cp -a "$tmp/x/usr/src/$common_pkg"/{include,Makefile} "$tmp/tree/"
  cp -a "$tmp/x/usr/src/$common_pkg/arch/x86" "$tmp/tree/arch/"
  cp -a "$tmp/x/usr/src/$arch_pkg/include/." "$tmp/tree/include/"
  cp -a "$tmp/x/usr/src/$arch_pkg/arch/x86/include/." "$tmp/tree/arch/x86/include/"
  cp -a "$tmp/x/usr/src/$arch_pkg/.config" "$tmp/tree/"
  rm -rf "$headers"; mv "$tmp/tree" "$headers"; rm -rf "$tmp"
fi

# --- the wheel and the build -------------------------------------------------------
# The image of this very commit on this base and these headers is there already
# (SPANLET_IMAGE_REBUILD=1 builds it anyway).
stamp="$(git -C "$here" rev-parse HEAD) $base $arch_pkg=$hver"
tag="localhost/spanlet:$version"
if [ "${SPANLET_IMAGE_REBUILD:-0}" != 1 ] && podman image exists "$tag" \
    && [ "$(podman image inspect --format '{{index .Labels "spanlet.stamp"}}' "$tag")" = "$stamp" ]; then
  podman tag "$tag" localhost/spanlet:latest
  step "ok: $tag and :latest are the image of HEAD already, $(( $(podman image inspect --format '{{.Size}}' "$tag") / 1000000 )) MB"
  exit 0
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/spanlet-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
step "the wheel of HEAD ($(git -C "$here" rev-parse --short HEAD))"
wheel=$(build_wheel "$work")
ensure_in_wheelhouse "$wheel[agent]"
mkdir -p "$work/context"
cp "$wheel" "$work/context/"
"$py" -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]; print(*p["dependencies"], *p["optional-dependencies"]["agent"], sep="\n")' \
  "$here/pyproject.toml" > "$work/context/requirements.txt"
cp -a "$headers" "$work/context/kernel-headers"

step "podman build $tag"
old=$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
spanlet_podman build -q --layers -f "$here/daemonset/Containerfile" \
  --build-arg BASE="$base" --volume "$wheelhouse:/wheelhouse:ro" \
  --label org.opencontainers.image.version="$version" \
  --label org.opencontainers.image.revision="$(git -C "$here" rev-parse HEAD)" \
  --label spanlet.stamp="$stamp" \
  -t "$tag" -t localhost/spanlet:latest "$work/context" >/dev/null
# The image this one replaced, when nothing else names it any more.
new=$(podman image inspect --format '{{.Id}}' "$tag")
if [ -n "$old" ] && [ "$old" != "$new" ] \
    && [ -z "$(podman image inspect --format '{{join .RepoTags " "}}' "$old" 2>/dev/null)" ]; then
  podman rmi -f "$old" >/dev/null 2>&1 || true
fi
size=$(podman image inspect --format '{{.Size}}' "$tag")
step "ok: $tag and :latest, $((size / 1000000)) MB"
