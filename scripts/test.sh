#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the test suite.
#   scripts/test.sh            full suite (what CI runs)
#   scripts/test.sh -m fast    the inner-loop subset (< 5 minutes)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest "$@"
