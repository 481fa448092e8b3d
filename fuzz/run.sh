#!/usr/bin/env bash
# Runs the fuzz targets that `make fuzz` built into build/fuzz: each one's
# regressions first (fuzz/regressions/<target>/, inputs of fixed findings,
# each run once), then FUZZ_SECONDS (default 10) of fuzzing from a fresh
# scratch copy of its seed corpus (fuzz/corpus/<target>/), with the OTLP
# dictionary for the wire targets. Any finding (a sanitizer report, a crash,
# a leak, an input slower than 10 s) fails the run; its input is kept in
# build/fuzz/findings/<target>/, the log in build/fuzz/logs/<target>.log.
# One line per target gives libFuzzer's final figures. Arguments: the
# targets to run (default: every fuzz/*.c).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build/fuzz
SECONDS_EACH=${FUZZ_SECONDS:-10}

# Python's allocator is the C library's (the harness sets it too), so that
# ASan sees each object's own block.
export PYTHONMALLOC=malloc
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
if [ -z "${ASAN_SYMBOLIZER_PATH:-}" ]; then
  sym=$(command -v llvm-symbolizer-16 || command -v llvm-symbolizer || true)
  [ -z "$sym" ] || export ASAN_SYMBOLIZER_PATH=$(readlink -f "$sym")
fi

# A target's own flags: its dictionary, and room for the largest input it
# reads (ring_read: 19 bytes of selectors and positions, a two-page ring).
flags_of() {
  case $1 in
    wire_*) echo "-dict=fuzz/otlp.dict" ;;
    ring_read) echo "-max_len=8211" ;;
  esac
}

# stat::number_of_executed_units, stat::average_exec_per_sec and the last
# cov/ft/corp line of a log, as one line.
figures() {
  local log=$1
  awk '/^stat::number_of_executed_units/ {runs=$2}
       /^stat::average_exec_per_sec/ {rate=$2}
       /cov: / {for (i = 1; i <= NF; i++) {if ($i == "cov:") c=$(i+1); if ($i == "ft:") f=$(i+1);
                                            if ($i == "corp:") k=$(i+1)}}
       END {printf "%s runs, %s exec/s, cov %s, ft %s, corpus %s", runs, rate, c, f, k}' "$log"
}

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for src in fuzz/*.c; do targets+=("$(basename "$src" .c)"); done
fi
mkdir -p "$BUILD/logs"
failed=()
for t in "${targets[@]}"; do
  bin=$BUILD/$t
  [ -x "$bin" ] || { echo "fuzz: $bin is not built (make fuzz builds it)" >&2; exit 2; }
  log=$BUILD/logs/$t.log
  found=$BUILD/findings/$t
  mkdir -p "$found"
  regressions=(fuzz/regressions/$t/*)
  if [ -e "${regressions[0]}" ]; then
    if ! "$bin" "${regressions[@]}" >"$log.regressions" 2>&1; then
      echo "fuzz: $t: a regression input fails again (log: $log.regressions)" >&2
      failed+=("$t")
      continue
    fi
    echo "fuzz: $t: ${#regressions[@]} regression input(s) pass"
  fi
  scratch=$BUILD/corpus/$t
  rm -rf "$scratch"
  mkdir -p "$scratch"
  cp fuzz/corpus/$t/* "$scratch/"
  # shellcheck disable=SC2046
  if "$bin" $(flags_of "$t") -max_total_time="$SECONDS_EACH" -timeout=10 -print_final_stats=1 \
       -artifact_prefix="$found/" "$scratch" >"$log" 2>&1; then
    echo "fuzz: $t: ${SECONDS_EACH}s: $(figures "$log")"
  else
    echo "fuzz: $t: FINDING after $(figures "$log"); input in $found/, log $log" >&2
    grep -m 1 -E "ERROR: |runtime error|fuzz: " "$log" >&2 || tail -n 20 "$log" >&2
    failed+=("$t")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: findings in: ${failed[*]}" >&2
  exit 1
fi
