# Gives a virtual environment BCC's Python module (sourced by setup.sh and
# wheel_check.sh): `bcc_into_venv VENV`.
# BCC's Python module ships for Debian's interpreter only; it is pure Python
# over libbcc.so, so the venv sees it through a folder holding only that link.
bcc_into_venv() {
  local venv=$1 bccdir="$1/bcc-site" site
  mkdir -p "$bccdir"
  ln -sfn /usr/lib/python3/dist-packages/bcc "$bccdir/bcc"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$bccdir" > "$site/spanlet-bcc.pth"
}
