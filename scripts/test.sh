#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the test suite.
#   scripts/test.sh            full suite (what CI runs)
#   scripts/test.sh -m fast    the inner-loop subset (< 5 minutes)
#   scripts/test.sh ARGS       plain pytest with ARGS
# The full suite runs as two pytest processes at once: the tests that launch torchrun processes (-m dist) and the
# in-process tests (-m "not dist"), which use one core while a launch's ranks often leave one idle (importing,
# waiting in a collective): 877 s (with a since-withdrawn gc.freeze) against 1,237 s one after the other, here. Moving five launching
# files to the second stream, after the in-process tests, made it slower (962 s): launches then share the cores.
# The launches' output streams; the in-process tests' is printed after it; the exit status is the first non-zero
# of the two.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$#" -gt 0 ]; then
  exec python -m pytest "$@"
fi
LOG="$(mktemp -t meshplan-inprocess.XXXXXX)"
python -m pytest -m "not dist" >"$LOG" 2>&1 &
INPROCESS=$!
launches=0
python -m pytest -m dist || launches=$?
inprocess=0
wait "$INPROCESS" || inprocess=$?
echo
echo "================================ in-process tests (-m 'not dist') ================================"
cat "$LOG"
rm -f "$LOG"
echo
echo "launches (-m dist): exit $launches; in-process (-m 'not dist'): exit $inprocess"
if [ "$launches" -ne 0 ]; then exit "$launches"; fi
exit "$inprocess"
