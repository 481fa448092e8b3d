#!/usr/bin/env bash
# Checks that the wheel works: builds it from a clean copy of HEAD, installs it
# without the extra (the client alone) and with [agent] in fresh venvs, and runs each.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
py="${SPANLET_PYTHON:-python3}"
source "$here/scripts/wheel_lib.sh"
started=$SECONDS
step() { printf '==> wheel check (%ds): %s\n' $((SECONDS - started)) "$*"; }

# install VENV SPEC: SPEC installed into VENV from the wheelhouse, filled first if
# need be; no bytecode compiled (it would double the files to write and remove).
install() {
  local into=(--python "$1/bin/python" install --no-compile "$2")
  offline "${into[@]}" 2>/dev/null || { fill "$2"; offline "${into[@]}"; }
}

work=$(mktemp -d "${TMPDIR:-/tmp}/spanlet-wheel-check.XXXXXX")
trap 'step "removing $work"; rm -rf "$work"' EXIT
mkdir -p "$work/run"

step "the wheel of a clean copy of HEAD ($(git -C "$here" rev-parse --short HEAD), git archive; pip wheel --no-deps)"
wheel=$(build_wheel "$work") || { echo "wheel check: no wheel" >&2; exit 1; }
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
