#!/usr/bin/env bash
# One drafter recipe, start to end on one GPU: prompts from three sources answered by the target,
# a drafter trained online on all of them (no capture on disk; ONLINE=0: from a capture), then
# acceptance at k = 5 on MT-Bench and HumanEval against plain decoding, and n-gram lookup on
# MT-Bench for scale.
# Every stage resumes, so a rerun after a stop continues; DIR/done marks the end.
#
#   bash benchmarks/recipe_trial.sh DIR
#   FIRST=14000 SELF=6000 MULTI=3000 EPOCHS=3 CUDA_GRAPHS=1 bash benchmarks/recipe_trial.sh /root/recipe
#
# FIRST: ShareGPT first turns of <= CHARS (600) characters (the GPU quickstart's prompts), answered once;
#        a larger CHARS brings longer prompts, more text for an answer to quote.
# MULTI: further such conversations with every user turn answered on the regenerated history.
# SELF:  prompts the target writes itself (--prompts self, --self-topics broad), then answers.
# ONLINE=0: capture the states to disk, then train from them (faster per epoch, ~4.6 KB a token).
# HUMANEVAL=0, NGRAM=0: without HumanEval, without n-gram lookup (MT-Bench at k = 5 always runs).
# LR (1e-3), BATCH_TOKENS (4096): the training's learning rate and tokens per batch.
# QUESTIONS (20), MAX_NEW_TOKENS (256): questions per evaluation; new tokens per answer, in training data too.
set -euo pipefail
D=$1
T=${TARGET:-smollm2-135m-instruct}
mkdir -p "$D"
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }

stamp "prompts"
python3 - "$D" "${FIRST:-14000}" "${MULTI:-3000}" "${CHARS:-600}" <<'EOF'
import json, sys
from specdec.data.datasets import short_first_turns
d, first, multi, chars = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
convs = short_first_turns("sharegpt", chars, pool=4 * (first + multi))
for name, part, whole in (("first", convs[:first], False), ("multi", convs[first:first + multi], True)):
    with open(f"{d}/{name}.prompts.jsonl", "w") as f:
        for c in part:
            f.write(json.dumps({"id": c.id, "messages": c.messages if whole else c.messages[:1]}) + "\n")
    print(name, len(part))
EOF
regen() { python3 -m specdec regenerate --target "$T" --max-new-tokens "${MAX_NEW_TOKENS:-256}" --no-progress "$@"; }
stamp "regenerate first turns"
regen --prompts "$D/first.prompts.jsonl" --single-turn -o "$D/first.jsonl"
if [ "${SELF:-6000}" -gt 0 ]; then
  stamp "write and answer own prompts"
  regen --prompts self --limit "${SELF:-6000}" --self-topics broad -o "$D/self.jsonl"
fi
if [ "${MULTI:-3000}" -gt 0 ]; then
  stamp "regenerate whole conversations"
  regen --prompts "$D/multi.prompts.jsonl" -o "$D/multi.jsonl"
fi
parts=("$D/first.jsonl")
for f in "$D/self.jsonl" "$D/multi.jsonl"; do if [ -f "$f" ]; then parts+=("$f"); fi; done
cat "${parts[@]}" > "$D/all.jsonl"
wc -l "${parts[@]}" "$D/all.jsonl"

data=(--online --data "$D/all.jsonl")
if [ "${ONLINE:-1}" = 0 ]; then  # captured to disk first (~4.6 KB a token for SmolLM2), then trained from it
  stamp "capture"
  python3 -m specdec capture --target "$T" --data "$D/all.jsonl" -o "$D/capture" --no-progress
  data=(--data "$D/capture")
fi
stamp "train"
[ -f "$D/train/train_summary.json" ] || python3 -m specdec train --target "$T" "${data[@]}" \
  -o "$D/train" --epochs "${EPOCHS:-3}" --batch-tokens "${BATCH_TOKENS:-4096}" --lr "${LR:-1e-3}" \
  --ttt-steps 7 --draft-vocab-size 16384 \
  --eval-every 1000 --save-every 1000 --resume ${CUDA_GRAPHS:+--cuda-graphs} --json > "$D/train.json"
cp "$D/train/train_summary.json" "$D/train_summary.json"

evaluate() {  # evaluate NAME ARGS...
  [ -s "$D/$1.json" ] || python3 -m specdec eval --target "$T" --limit "${QUESTIONS:-20}" \
    --max-new-tokens "${MAX_NEW_TOKENS:-256}" --compare-plain \
    --no-progress --json "${@:2}" > "$D/$1.json"
}
stamp "evaluate"
evaluate eval_mtbench_k5 --drafter "$D/train/drafter" --k 5
if [ "${NGRAM:-1}" = 1 ]; then evaluate eval_mtbench_ngram --ngram 3; fi
if [ "${HUMANEVAL:-1}" = 1 ]; then evaluate eval_humaneval_k5 --drafter "$D/train/drafter" --k 5 --prompts humaneval; fi
stamp "done"
touch "$D/done"
