#!/usr/bin/env bash
# Everything BENCHMARKS.md reports for the H200, in two parts of under 10 minutes each.
#
#   bash benchmarks/h200.sh 1   # 8B-shaped roofline; SmolLM2 shapes with random weights
#   bash benchmarks/h200.sh 2   # SmolLM2 real weights: timing, fp32 agreement, bench table
#   bash benchmarks/h200.sh 3   # cuBLAS variant at T=1..16 and the 8B checks against HF
#
# Part 2 reads the SmolLM2 GGUF from .devdata/ (split in two parts, part0 and part1, as copied to
# a machine without PyPI access) and MT-Bench questions from .devdata/question.jsonl; wheels that
# the GPU machine lacks (gguf) go in .whl/. Results are written under $OUT (default
# benchmarks/results).
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv;
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"; } \
  > "$OUT/env_$1.txt" 2>&1
case "$1" in
  1)
    timeout 320 python3 benchmarks/roofline_8b.py --budget-s 250 --out "$OUT" 2>&1 | tee "$OUT/roofline_8b.log"
    timeout 170 python3 benchmarks/smollm2.py --budget-s 140 --tag smollm2_random --out "$OUT" \
      --plan "hf;graph:1;cd:1,8,32,16,2,4;nocd:1" 2>&1 | tee "$OUT/smollm2_random.log"
    ;;
  2)
    if [ -f .devdata/p1/smol.gguf.part0 ] && [ -f .devdata/p2/smol.gguf.part1 ]; then
      cat .devdata/p1/smol.gguf.part0 .devdata/p2/smol.gguf.part1 > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
      sha256sum /tmp/SmolLM2-135M-Instruct.Q4_1.gguf | tee -a "$OUT/env_2.txt"
      WEIGHTS="--gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --prompts .devdata/question.jsonl"
    else
      echo "first GGUF half missing (machine went cold): random weights" | tee -a "$OUT/env_2.txt"
      WEIGHTS=""
    fi
    timeout 420 python3 benchmarks/smollm2.py $WEIGHTS --budget-s 300 --limit 5 --max-new-tokens 256 \
      --out "$OUT" --plan "hf;cd:1,8,32;e2e;bench;fp32" 2>&1 | tee "$OUT/smollm2.log"
    ;;
  3)
    # After call 1: cuBLAS GEMV (nocd) was the fastest one-token step, so time every bucket
    # under it; logits vs HF sdpa and eager attention; agreement on sharpened random weights.
    timeout 220 python3 benchmarks/roofline_8b.py --budget-s 160 --tag roofline_8b_nocd --out "$OUT" \
      --plan "nocd:1,8,2,4,16;check;check_eager" 2>&1 | tee "$OUT/roofline_8b_nocd.log"
    timeout 240 python3 benchmarks/agreement.py --out "$OUT" 2>&1 | tee "$OUT/agreement.log"
    ;;
esac
