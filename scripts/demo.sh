#!/usr/bin/env bash
# The README's main job: install everything (scripts/setup.sh), make a tiny transformers Llama once
# (examples/tiny_model.py → runs/tiny-llama: 1.6M parameters, BPE vocab 4096 trained on docs/ + README.md),
# then `meshplan train plans/train.yaml --nproc 4`: tp 2 × dp 2 on 4 CPU processes (gloo) over the repo's docs/,
# printing loss, grad norm, lr, tokens/s and eval loss, checkpointing under runs/ and exporting runs/tiny-llama-trained.
# PLAN and NPROC override the plan and the process count; extra arguments are settings (--steps 20, --optimizer.lr 1e-3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
MODEL="${MODEL:-runs/tiny-llama}"
if [ ! -f "$MODEL/config.json" ]; then
  python examples/tiny_model.py "$MODEL" --arch llama --vocab 4096 --hidden 128 --layers 4
fi
exec python -m meshplan train "${PLAN:-plans/train.yaml}" --nproc "${NPROC:-4}" "$@"
