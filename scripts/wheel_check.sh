#!/usr/bin/env bash
# Checks that the wheel works: builds it from a clean copy of HEAD, installs it
# without the extra (the client alone) and with [agent] in fresh venvs, and runs each.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
py="${SPANLET_PYTHON:-python3}"
# The wheels of the build and install dependencies, kept between runs: pip takes
# them from here with no index at all, and only when one is missing does it
# download what is asked into it (from the index; pip's own HTTP cache is not
# written on every machine, so it cannot be relied on for this).
wheelhouse="${SPANLET_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/spanlet/wheelhouse}"
pipq=(-qq --disable-pip-version-check)
started=$SECONDS
step() { printf '==> wheel check (%ds): %s\n' $((SECONDS - started)) "$*"; }

# One pip serves every venv (`pip --python`): setup.sh's venv's (a recent pip;
# Debian's python3 may have none), else the interpreter's. The venvs are made
# without pip of their own, which saves most of the time of making one.
runner="${SPANLET_VENV:-$here/.venv}/bin/python"
[ -x "$runner" ] || runner=$py
pip() { "$runner" -m pip "$@"; }
# offline PIP-ARGS...: pip with the wheelhouse as its only source.
offline() { pip "$@" "${pipq[@]}" --no-index --find-links "$wheelhouse"; }
# fill SPEC...: the SPECs and their dependencies downloaded into the wheelhouse.
fill() {
  echo "   (downloading $(basename "$*") and its dependencies into $wheelhouse)"
  mkdir -p "$wheelhouse"
  pip download "${pipq[@]}" -d "$wheelhouse" "$@"
  rm -f "$wheelhouse"/spanlet-*.whl
}
# install VENV SPEC: SPEC installed into VENV from the wheelhouse, filled first if
# need be; no bytecode compiled (it would double the files to write and remove).
install() {
  local into=(--python "$1/bin/python" install --no-compile "$2")
  offline "${into[@]}" 2>/dev/null || { fill "$2"; offline "${into[@]}"; }
}

work=$(mktemp -d "${TMPDIR:-/tmp}/spanlet-wheel-check.XXXXXX")
trap 'step "removing $work"; rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/dist" "$work/run"

step "clean copy of HEAD ($(git -C "$here" rev-parse --short HEAD)) by git archive"
if [ -n "$(git -C "$here" status --porcelain --untracked-files=no)" ]; then
  echo "   (the checkout has uncommitted changes: they are not in this wheel)"
fi
git -C "$here" archive --format=tar HEAD | tar -x -C "$work/src"

step "building the wheel (pip wheel --no-deps, build dependencies isolated)"
build() { offline wheel --no-deps -w "$work/dist" "$work/src" > "$work/build.log" 2>&1; }
if ! build; then
  mapfile -t requires < <("$py" -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"], sep="\n")' "$work/src/pyproject.toml")
  fill "${requires[@]}"
  build || { cat "$work/build.log"; echo "wheel check: the wheel did not build" >&2; exit 1; }
fi
wheels=("$work"/dist/spanlet-*.whl)
[ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] || { echo "wheel check: not one spanlet wheel: ${wheels[*]}" >&2; exit 1; }
wheel=${wheels[0]}
echo "   $(basename "$wheel")"

step "client: fresh venv, pip install spanlet (no extra)"
"$py" -m venv --without-pip "$work/client"
install "$work/client" "$wheel"
# -I: neither the checkout nor PYTHONPATH on sys.path; cwd outside the checkout.
(cd "$work/run" && "$work/client/bin/python" -I "$here/scripts/wheel_check_client.py")

step "agent: fresh venv with BCC's module, pip install 'spanlet[agent]'"
"$py" -m venv --without-pip "$work/agent"
source "$here/scripts/bcc_venv.sh"
bcc_into_venv "$work/agent"
install "$work/agent" "$wheel[agent]"

step "agent: the installed spanlet run --dump-bpf, from $work/run"
(cd "$work/run" && "$work/agent/bin/spanlet" run --dump-bpf > "$work/run/dump-bpf.txt")
(cd "$work/run" && "$work/agent/bin/python" -I "$here/scripts/wheel_check_agent.py" "$work/run/dump-bpf.txt")

step "ok: the wheel installs and works, as the client and as the agent"
