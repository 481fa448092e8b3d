#!/usr/bin/env bash
# The sanitizer run: the native extensions (native/*.c) built with ASan and
# UBSan, loaded in place of the package's own (SPANLET_NATIVE_DIR,
# tests/support/sanitized.py), under the unit tier. Python's allocator is
# the C library's (PYTHONMALLOC=malloc), so ASan sees every object's own
# block: an overread past a bytes object's end is a finding. LeakSanitizer
# reports what is unreachable at exit (tests/sanitize/lsan.supp: the
# libraries of others that leave blocks behind by design). Any finding fails
# the run. Arguments go to pytest (default: tests/unit).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=build/sanitize
mkdir -p "$OUT"
INC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
SUFFIX=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
FLAGS=(-shared -fPIC -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined
       -fno-sanitize-recover=undefined -I"$INC")
echo "sanitize: building the native extensions with ASan and UBSan into $OUT"
gcc "${FLAGS[@]}" native/spanlet_wire.c -o "$OUT/_wire$SUFFIX" -lm
gcc "${FLAGS[@]}" native/spanlet_ring.c -o "$OUT/_ring$SUFFIX"
gcc "${FLAGS[@]}" -fcf-protection=none native/spanlet_marker.c -o "$OUT/libspanlet_marker$SUFFIX"
if [ $# -eq 0 ]; then
  set -- tests/unit
  while read -r path _; do
    case "$path" in
      ''|'#'*) ;;
      *::*) set -- "$@" --deselect="$path" ;;
      *) set -- "$@" --ignore="$path" ;;
    esac
  done < tests/sanitize/leave_out.txt
fi
echo "sanitize: pytest $* with them loaded"
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:allocator_may_return_null=1 \
LSAN_OPTIONS=suppressions=$PWD/tests/sanitize/lsan.supp:print_suppressions=0 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
PYTHONMALLOC=malloc SPANLET_NATIVE_DIR="$PWD/$OUT" \
  "$PY" -m pytest -q -p no:cacheprovider "$@"
