#!/usr/bin/env bash
# The old main job, kept as an example: install everything (scripts/setup.sh), then train the example Llama with plans/llama.yaml
# on 4 CPU processes (gloo), printing loss and tokens/s. Extra arguments go to examples/train.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
NPROC="${NPROC:-4}"
exec torchrun --standalone --nproc-per-node "$NPROC" examples/train.py --plan "${PLAN:-plans/llama.yaml}" "$@"
