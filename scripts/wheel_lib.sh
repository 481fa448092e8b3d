# The wheelhouse and the wheel of HEAD, shared by wheel_check.sh and image.sh
# (sourced; `here` and `py` set by the caller).
# The wheels of the build and install dependencies, kept between runs: pip takes
# them from here with no index at all, and only when one is missing does it
# download what is asked into it (from the index; pip's own HTTP cache is not
# written on every machine, so it cannot be relied on for this).
wheelhouse="${SPANLET_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/spanlet/wheelhouse}"
pipq=(-qq --disable-pip-version-check)

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
# ensure_in_wheelhouse SPEC: SPEC's dependencies all in the wheelhouse, filled if not.
ensure_in_wheelhouse() {
  offline download -d "$wheelhouse" "$@" >/dev/null 2>&1 || fill "$@"
  rm -f "$wheelhouse"/spanlet-*.whl
}

# build_wheel WORK: a clean copy of HEAD (git archive) in WORK/src built into
# WORK/dist; prints the wheel's path.
build_wheel() {
  local work=$1 requires
  mkdir -p "$work/src" "$work/dist"
  if [ -n "$(git -C "$here" status --porcelain --untracked-files=no)" ]; then
    echo "   (the checkout has uncommitted changes: they are not in this wheel)" >&2
  fi
  git -C "$here" archive --format=tar HEAD | tar -x -C "$work/src"
  _build() { offline wheel --no-deps -w "$work/dist" "$work/src" > "$work/build.log" 2>&1; }
  if ! _build; then
    mapfile -t requires < <("$py" -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"], sep="\n")' "$work/src/pyproject.toml")
    fill "${requires[@]}" >&2
    _build || { cat "$work/build.log" >&2; echo "the wheel did not build" >&2; return 1; }
  fi
  local wheels=("$work"/dist/spanlet-*.whl)
  [ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] || { echo "not one spanlet wheel: ${wheels[*]}" >&2; return 1; }
  echo "${wheels[0]}"
}
