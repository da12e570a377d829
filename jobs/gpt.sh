#!/usr/bin/env bash
# make demo-gpt: examples/gpt.py (a character-level GPT on the standard library's sources:
# attention heads, MLP and vocabulary over tp, batch over dp, AdamW with clipping) under mpirun:
# STEPS_1 steps on 4 ranks (dp=2 x tp=2) with a checkpoint, resumed on 3 ranks (dp=1 x tp=3) up
# to STEPS; its validation loss must fall below the bigram baseline of the same split.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS_1=${STEPS_1:-300}
STEPS=${STEPS:-500}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none DTM_TIMEOUT=${DTM_TIMEOUT:-120}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
RUN=(mpirun --timeout 1800 --bind-to none)
GPT=("$PY" -m mpi4py examples/gpt.py --quiet --store "$work/store" --checkpoint-every "$STEPS_1")  # and after the last step
echo "== gpt: $STEPS_1 steps on 4 ranks (dp=2,tp=2)"
"${RUN[@]}" -n 4 "${GPT[@]}" --mesh dp=2,tp=2 --steps "$STEPS_1"
echo "== gpt: resumed on 3 ranks (dp=1,tp=3) up to step $STEPS"
"${RUN[@]}" -n 3 "${GPT[@]}" --mesh dp=1,tp=3 --steps "$STEPS" --resume | tee "$work/log"
grep -q "NOT below" "$work/log" && { echo "gpt: the validation loss is not below the bigram baseline" >&2; exit 1; }
grep -q "below the bigram baseline" "$work/log"
