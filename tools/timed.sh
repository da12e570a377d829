#!/usr/bin/env bash
# tools/timed.sh NAME CMD...: run CMD as phase NAME, then print its wall time; where PHASE_TIMES
# names a file, also append "NAME<TAB>SECONDS<TAB>EXIT" to it (.ci/run prints those as a table,
# so the growth of every phase shows in every run). Exits with CMD's status.
set -uo pipefail
name=$1
shift
start=$(date +%s.%N)
"$@"
rc=$?
secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.0f", b - a }')
if [ "$rc" = 0 ]; then
  echo "== $name: $secs s"
else
  echo "== $name: $secs s (failed: exit $rc)"
fi
if [ -n "${PHASE_TIMES:-}" ]; then
  printf '%s\t%s\t%s\n' "$name" "$secs" "$rc" >>"$PHASE_TIMES"
fi
exit "$rc"
