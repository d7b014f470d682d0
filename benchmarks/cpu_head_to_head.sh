#!/usr/bin/env bash
# CPU head-to-head on Qwen2.5-Coder-1.5B-Instruct: HF assisted generation (Qwen2.5-Coder-0.5B as
# assistant) against a specdec EAGLE-3 drafter trained for the 1.5B target, same prompts, same run.
# About 2 h 10 min on 2 cores (regenerate 16 min, capture 9, train 13 + 9 + 30, bench 25);
# every step resumes if killed (add --resume to a train step).
#
#   bash benchmarks/cpu_head_to_head.sh [WORKDIR]      # default runs/qwen
set -euo pipefail
W=${1:-runs/qwen}
T=qwen2.5-coder-1.5b-instruct
S=".venv/bin/specdec"
mkdir -p "$W"
# 400 ShareGPT first turns of <= 600 characters (a prefix-stable random sample, seed 1).
.venv/bin/python - "$W/prompts.jsonl" <<'PY'
import json, sys
from specdec.data.datasets import short_first_turns
with open(sys.argv[1], "w") as f:
    for c in short_first_turns("sharegpt", 600, pool=2000, seed=1)[:400]:
        f.write(json.dumps({"id": c.id, "messages": c.messages[:1]}, ensure_ascii=False) + "\n")
PY
$S regenerate --target $T --prompts "$W/prompts.jsonl" --single-turn --max-new-tokens 128 --batch-size 48 \
  --dtype bf16 --device cpu -o "$W/regen.jsonl"
$S capture --target $T --data "$W/regen.jsonl" -o "$W/capture" --max-length 384 --model-dtype bf16 --device cpu \
  --batch-size 8
common=(--target $T --data "$W/capture" --batch-tokens 256 --ttt-steps 3)
# 3 epochs at 3e-3 (draft vocab 2,048, MLP 3,072 wide), then 600 + 1,800 steps at 1e-3 from it.
$S train "${common[@]}" -o "$W/train" --epochs 3 --lr 3e-3 --draft-vocab-size 2048 --intermediate-size 3072 \
  --eval-every 200 --save-every 200
$S train "${common[@]}" -o "$W/ft1" --init "$W/train/drafter" --epochs 2 --lr 1e-3 --max-steps 600 \
  --eval-every 150 --save-every 150
$S train "${common[@]}" -o "$W/ft2" --init "$W/ft1/drafter" --epochs 6 --lr 1e-3 --max-steps 1800 \
  --eval-every 300 --save-every 300
$S bench --target $T --assistant qwen2.5-coder-0.5b-instruct --drafter "$W/ft2/drafter" --prompts mt-bench \
  --limit 5 --max-new-tokens 96 --k 1,2,3 --tree none --dtype auto \
  --out benchmarks/results/cpu_qwen15_head_to_head.json
