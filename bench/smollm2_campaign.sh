#!/usr/bin/env bash
# The SmolLM2 preset (configs/smollm2-gpu.yaml) rebuilt on a lent GPU machine (the x2 host, or
# one H200 with GPUS=1 SIDE=0), with the checks that need a GPU and a finished stage run beside
# it on the GPU the build leaves free:
#
#   - acceptance_gap dtype  (once training has started: the verifier and prepare are done)
#   - acceptance_gap draft at k = 3 and 5 (once the checkpoint is checked), by replay: the
#     decode loop gives the same counts (76 of 80 MT-bench prompts compared on an H200,
#     BENCHMARKS.md) but took about 8 s a prompt there, replay a fraction of that
#   - with TRAIN_ARGS set, bench/train.py (e.g. --same-training 50: ours against speculators'
#     trainer on the same batches) after the dtype check
#
# Regeneration leases both GPUs; training and evaluation lease one each, so a side check takes
# the other through the same GPU locks (.snakemake/gpu_locks) and never shares a device with a
# workflow job (whose NVML memory readings it would disturb).
#
# On the device machine, after bench/gpu_setup.sh install and install-data (BENCHMARKS.md):
#   bench/smollm2_campaign.sh start     # returns at once; the build runs in its own session
#   bench/smollm2_campaign.sh wait 540  # up to 540 s for it to end; then copies the small
#                                       # outputs (reports, logs, benchmarks, checks) to $OUT,
#                                       # and once it has ended the checkpoint's parts 0-3
#   bench/smollm2_campaign.sh checkpoint-back 1  # the checkpoint's other parts
# Outputs go to $CAMPAIGN (default /tmp/campaign), never into the repository copy.
set -euo pipefail
cd "$(dirname "$0")/.."
C=${CAMPAIGN:-/tmp/campaign}
R=results/${RUN_NAME:-smollm2-gpu}
CONFIGS=${CONFIGS:-configs/smollm2-gpu.yaml configs/overlays/regen-2-gpus.yaml}
PROMPTS=${PROMPTS:-80}   # per set, for both acceptance_gap checks
METHOD=${METHOD:-replay} # of the draft check: replay or decode
# e.g. "--samples 120 --steps 28 --warmup 8 --profile-steps 0 --variants ours --same-training 50"
TRAIN_ARGS=${TRAIN_ARGS:-}
# GREEDY=1: once the build has ended, the run's verifier answers MT-bench's first turns with each
# attention of bench/decode_attention.py greedy (in $C/greedy.log)
# Side checks: 1 while the build runs (on the GPU it leaves free), 0 none (the build alone: on one
# GPU they would queue with its jobs), after: only the draft check, once the build has ended
SIDE=${SIDE:-1}
# GPUs the builds lease (--resources gpu=N): every GPU of the machine (none without nvidia-smi)
GPUS=${GPUS:-$({ nvidia-smi -L 2>/dev/null || true; } | wc -l)}
#
# fp8 acceptance parity (extract.storage bf16 against fp8, one train.seed): two builds one after
# the other in the same run folder, so the second reruns only extract and what follows it; each
# build's reports, benchmarks, logs and training summary are kept in $C/<storage>-seed<SEED>:
#   CONFIGS="configs/smollm2-gpu.yaml configs/overlays/no-regen.yaml" \
#     bench/smollm2_campaign.sh start-parity 42     # then: wait 540, as above
# The build alone on one GPU (SIDE=0, or SIDE=after for the draft check once it has ended), e.g.
# regeneration at full size:
#   SIDE=after RUN_NAME=smollm2-gpu-regen-all \
#     CONFIGS="configs/smollm2-gpu.yaml configs/overlays/regen-all.yaml" bench/smollm2_campaign.sh start
# A build that did not finish in one session's device time can start from the regenerated
# conversations its wait calls brought back (regenerated.jsonl.gz.part-NN and .sha256): put them
# in .xfer-regen/ and carry it, or commit them in bench/conversations/<name>/ (they travel with
# the working tree and outlive the session), then
#   bench/smollm2_campaign.sh unpack-regenerated [bench/conversations/<name>]
#   REGENERATED=/tmp/regenerated.jsonl.gz SIDE=after ... bench/smollm2_campaign.sh start
# start-regenerate runs the build only up to those conversations (then wait, as above): one
# session regenerates, a later one trains on them.
# (regeneration off, data.train.path that file: prepare, extract and what follows run as before).
# With synthetic prompts (regenerate.synthetic_prompts) added to those conversations: a build of
# its own samples and answers N prompts (regeneration of one ShareGPT conversation plus them),
# they are spread evenly among the earlier conversations, then the build runs as above:
#   REGENERATED=/tmp/regenerated.jsonl.gz SIDE=after RUN_NAME=... CONFIGS="..." \
#     bench/smollm2_campaign.sh start-synthetic N
# start-prompts N runs only that prompts build (wait brings its answered prompts back as
# <RUN_NAME>-prompts): a session that samples more prompts, a later one that merges and builds.
# (a rehearsal on a CPU: GPUS=2 CUDA_VISIBLE_DEVICES=0,1 give the locks two "GPUs", and
#  CONFIGS="configs/smollm2-gpu.yaml configs/overlays/cpu-slice.yaml" RUN_NAME=smollm2-cpu-slice
#  PROMPTS=2 TRAIN_ARGS="--smoke --variants ours --profile-steps 0 --same-training 6")

host_sample() { # every 2 s (HOST_SAMPLE_SECONDS) until the build ends or this script is gone,
  # a line of $C/host.log: the clock (epoch seconds), /proc/stat's cpu line (jiffies: user nice
  # system idle iowait irq softirq steal ...), the load, each GPU's SM clock, power and use, and
  # training's latest progress line (printed every 10 s: the samples between two lines give the
  # host over that line's span); read by bench/host_pace.py (does the pace follow the host?)
  local gpus train
  while [ ! -e "$C/done" ] && kill -0 $$ 2>/dev/null; do
    gpus=$({ timeout 5 nvidia-smi --query-gpu=clocks.sm,power.draw,utilization.gpu \
      --format=csv,noheader,nounits 2>/dev/null || true; } | tr '\n' ';')
    train=$(tail -c 4000 "$R/logs/train.log" 2>/dev/null | grep -a '^train: ' | tail -1 || true)
    # one write a line: a wait that archives $C meanwhile finds whole lines
    printf '%s %s | %s | %s | %s\n' "$(date +%s)" "$(head -1 /proc/stat)" \
      "$(cut -d' ' -f1-3 /proc/loadavg)" "$gpus" "$train" >>"$C/host.log"
    sleep "${HOST_SAMPLE_SECONDS:-2}"
  done
}

side() { # NAME COMMAND...: on one GPU leased through the workflow's locks, logged in $C
  local name=$1
  shift
  echo "$(date +%T) $name: start" >>"$C/status"
  if python3 -m eagle3lib.gpu run --gpus 1 --record "$C/$name.gpu.json" --rule "$name" \
    --log "$C/$name.log" -- "$@"; then
    echo "$(date +%T) $name: done" >>"$C/status"
  else
    echo "$(date +%T) $name: FAILED ($?)" >>"$C/status"
  fi
}

draft_check() { # the draft on MT-bench and on held-out ShareGPT prompts (acceptance_gap.py)
  side draft python3 bench/acceptance_gap.py draft --run "$R" --prompts "$PROMPTS" \
    --method "$METHOD" --k 3 5 --json "$C/draft.json"
}

bring_back() { # FILE NAME: FILE once, gzip in parts that a call can bring back, and its sha256
  if [ -e "$1" ] && [ ! -e "$C/$2.sha256" ]; then
    gzip -9 -n -c "$1" >"$C/$2.jsonl.gz"
    split -b 15M -d -a 2 "$C/$2.jsonl.gz" "$OUT/$2.jsonl.gz.part-"
    (cd "$C" && sha256sum "$2.jsonl.gz" >"$2.sha256") && cp "$C/$2.sha256" "$OUT/"
    ls -l "$OUT/$2".*
  fi
}

# I: parts 4I to 4I+3 of the checkpoint archive (packed once per run name; its sha256 is
# written last, so a call cut short packs again) to $OUT
checkpoint_parts() {
  if [ ! -e "$C/checkpoint.sha256" ] || [ "$(cat "$C/checkpoint.run" 2>/dev/null)" != "$R" ]; then
    rm -f "$C"/checkpoint.tar.gz.part-* "$C/checkpoint.sha256"
    tar -cf - "$R/checkpoint" "$R/reports/acceptance.json" "$R/reports/summary.json" |
      gzip -1 -n >"$C/checkpoint.tar.gz"
    split -b 15M -d -a 2 "$C/checkpoint.tar.gz" "$C/checkpoint.tar.gz.part-"
    echo "$R" >"$C/checkpoint.run"
    (cd "$C" && sha256sum checkpoint.tar.gz >checkpoint.sha256)
  fi
  for n in $(seq $((4 * $1)) $((4 * $1 + 3))); do
    part=$(printf '%s/checkpoint.tar.gz.part-%02d' "$C" "$n")
    if test -e "$part"; then cp "$part" "${OUT:?}/"; fi
  done
  cp "$C/checkpoint.sha256" "$OUT/"
  ls -l "$C"/checkpoint.tar.gz* "$OUT"
}

until_exists() { # PATH: wait until it exists (true) or the build has ended without it (false)
  while [ ! -e "$1" ]; do
    kill -0 "$SM" 2>/dev/null || return 1
    sleep 5
  done
}

prompts_build() { # N: N synthetic prompts (regenerate.synthetic_prompts), answered: a build of
  # their own up to regenerate, on one GPU, whose one ShareGPT conversation a merge leaves out
  P=${RUN_NAME:-smollm2-gpu}-prompts
  {
    echo "run: $P"
    echo "data: {train: {max_samples: 1}}"
    echo "extract: {shards: 1}" # the checks before a build ask for no more shards than samples
    # max_turns 1: the ShareGPT conversation's later turns would each take a generate call
    echo "regenerate: {enabled: true, synthetic_prompts: $1, workers: 1, gpus: 1, max_turns: 1}"
  } >"$C/prompts.yaml"
  echo "$(date +%T) prompts: start" >>"$C/status"
  # shellcheck disable=SC2086
  python3 -m snakemake "results/$P/regenerated/conversations.jsonl" --configfile $BASE_CONFIGS \
    "$C/noserve.yaml" "$C/prompts.yaml" --cores "$(nproc)" --resources gpu="$GPUS" \
    >"$C/snakemake-prompts.log" 2>&1
  cp "results/$P/regenerated/regenerate.json" "$C/prompts-regenerate.json"
  echo "$(date +%T) prompts: done" >>"$C/status"
}

launch() { # MODE [ARGS]: a fresh $C, then this script's MODE in its own session
  rm -rf "$C" && mkdir -p "$C"
  echo "serve_check: {enabled: false}" >"$C/noserve.yaml" # the GPU image has no vLLM
  export BASE_CONFIGS="$CONFIGS"
  if [ -n "${REGENERATED:-}" ]; then # an earlier session's regenerated conversations
    local train=$REGENERATED
    [ "$1" = run-synthetic ] && train=$C/combined.jsonl.gz # with the synthetic ones merged in
    # every conversation of the file: the build that made it chose them (its max_samples
    # would otherwise cut the synthetic ones and the last of the others)
    printf 'regenerate: {enabled: false}\ndata: {train: {path: %s, max_samples: null}}\n' \
      "$train" >"$C/from-regenerated.yaml"
    export CONFIGS="$CONFIGS $C/from-regenerated.yaml"
  fi
  setsid nohup bash "$0" "$@" >"$C/campaign.log" 2>&1 </dev/null &
  echo "started; outputs in $C"
}

case "${1:-}" in
unpack-regenerated) # [DIR] what wait brought back, in DIR (default .xfer-regen/, carried; or a
  # tracked folder such as bench/conversations/, which travels with the working tree): for each
  # NAME.sha256 there, /tmp/NAME.jsonl.gz from its parts, checked (regenerated, synthetic, ...;
  # UNPACK_TO: another folder than /tmp)
  dir=$(cd "${2:-.xfer-regen}" && pwd)
  to=${UNPACK_TO:-/tmp}
  for sum in "$dir"/*.sha256; do
    name=$(basename "$sum" .sha256)
    cat "$dir/$name.jsonl.gz.part-"* >"$to/$name.jsonl.gz"
    (cd "$to" && sha256sum -c "$sum")
  done
  ;;
merge) # BASE SYNTHETIC OUT [TAG]: the synthetic conversations of SYNTHETIC (a prompts build's
  # output) spread evenly among BASE's (eagle3lib.regenerate.interleave, as the job does), ids
  # synthetic-TAG-<i> with a TAG; OUT gzip. Left out: one whose prompt BASE or an earlier one
  # holds (a build sampling with an earlier build's seed repeats its prompts). Answers lose a
  # character the token limit cut, as regenerate.answer_text now does (earlier files kept it).
  python3 - "${2:?BASE}" "${3:?SYNTHETIC}" "${4:?OUT}" "${5:-}" <<'PY'
import sys
from pathlib import Path
from eagle3lib.conversations import first_prompt_key, read_records, write_gzipped_jsonl
from eagle3lib.regenerate import interleave, without_cut_character
def read(path):
    return [record for _, record in read_records(Path(path))]
base, tag = read(sys.argv[1]), sys.argv[4]
seen = {first_prompt_key(r["messages"]) for r in base}
synthetic, repeats = [], 0
for r in read(sys.argv[2]):
    if not str(r["id"]).startswith("synthetic-"):
        continue
    if (key := first_prompt_key(r["messages"])) in seen:
        repeats += 1
        continue
    seen.add(key)
    if tag:
        r["id"] = f"synthetic-{tag}-{r['id'].removeprefix('synthetic-')}"
    synthetic.append(r)
merged = interleave(base, synthetic)
for r in merged:
    for m in r["messages"]:
        if m["role"] == "assistant":
            m["content"] = without_cut_character(m["content"])
write_gzipped_jsonl(Path(sys.argv[3]), merged)  # the same bytes each run: the same stamp
print(f"merged: {len(base)} conversations and {len(synthetic)} synthetic ones "
      f"({repeats} left out, their prompt already there)")
PY
  ;;
without-synthetic) # IN OUT: IN's conversations but the synthetic ones (ids synthetic-*), in
  # order, gzip (the regenerated ShareGPT conversations of a merged file: an ablation's data)
  python3 - "${2:?IN}" "${3:?OUT}" <<'PY'
import sys
from pathlib import Path
from eagle3lib.conversations import read_records, write_gzipped_jsonl
kept = [r for _, r in read_records(Path(sys.argv[1])) if not str(r["id"]).startswith("synthetic-")]
write_gzipped_jsonl(Path(sys.argv[2]), kept)
print(f"without synthetic conversations: {len(kept)}")
PY
  ;;
start)
  launch run
  ;;
start-parity)
  launch run-parity "${2:?seed}"
  ;;
start-regenerate) # the build up to its regenerated conversations only (wait brings them
  # back): a session whose device time holds regeneration but not the whole build
  launch run-regenerate
  ;;
run-regenerate)
  echo "$(date +%T) regenerate: start" >>"$C/status"
  rc=0
  # shellcheck disable=SC2086
  python3 -m snakemake "$R/regenerated/conversations.jsonl" --configfile $CONFIGS "$C/noserve.yaml" \
    --cores "$(nproc)" --resources gpu="$GPUS" >"$C/snakemake.log" 2>&1 || rc=$?
  echo "$(date +%T) regenerate: exit $rc" >>"$C/status"
  touch "$C/done"
  ;;
start-synthetic)
  test -n "${REGENERATED:-}" || {
    echo "start-synthetic needs REGENERATED (an earlier session's conversations)" >&2
    exit 2
  }
  launch run-synthetic "${2:?number of synthetic prompts}"
  ;;
start-prompts) # N: only the prompts build of start-synthetic (its answered prompts come back
  # with wait as <RUN_NAME>-prompts); a later session merges them and builds
  launch run-prompts "${2:?number of synthetic prompts}"
  ;;
run-prompts)
  trap 'echo "$(date +%T) synthetic prompts: FAILED" >>"$C/status"; touch "$C/done"' ERR
  prompts_build "$2"
  touch "$C/done"
  ;;
run-synthetic)
  # a failed step ends the campaign at once (wait returns instead of sitting out its time)
  trap 'echo "$(date +%T) synthetic prompts: FAILED" >>"$C/status"; touch "$C/done"' ERR
  # 1. the synthetic prompts, answered
  prompts_build "$2"
  # 2. spread among the earlier conversations
  bash "$0" merge "$REGENERATED" "results/$P/regenerated/conversations.jsonl" "$C/combined.jsonl.gz" \
    "${SYNTHETIC_TAG:-}" >>"$C/status"
  # 3. the build from the merged conversations, as start's
  trap - ERR
  exec bash "$0" run
  ;;
run-parity)
  echo "train: {seed: $2}" >"$C/seed.yaml"
  rc=0
  for storage in bf16 fp8; do
    echo "extract: {storage: $storage}" >"$C/storage.yaml"
    echo "$(date +%T) build $storage seed $2: start" >>"$C/status"
    # shellcheck disable=SC2086
    python3 -m snakemake --configfile $CONFIGS "$C/noserve.yaml" "$C/seed.yaml" "$C/storage.yaml" \
      --cores "$(nproc)" --resources gpu="$GPUS" >"$C/snakemake-$storage.log" 2>&1 || rc=$?
    echo "$(date +%T) build $storage seed $2: exit $rc" >>"$C/status"
    mkdir -p "$C/$storage-seed$2"
    cp -r "$R/reports" "$R/benchmarks" "$R/logs" "$R/train/summary.json" "$C/$storage-seed$2/" \
      2>/dev/null || true
  done
  touch "$C/done"
  ;;
run)
  echo "$(date +%T) build: start" >>"$C/status"
  # the host's CPU model and cores: a host-bound step's pace differs between machines
  { lscpu || head -30 /proc/cpuinfo; } >"$C/lscpu.txt" 2>&1 || true
  host_sample &
  # shellcheck disable=SC2086
  python3 -m snakemake --configfile $CONFIGS "$C/noserve.yaml" --cores "$(nproc)" --resources gpu="$GPUS" \
    >"$C/snakemake.log" 2>&1 &
  SM=$!
  during=$([ "$SIDE" != 0 ] && [ "$SIDE" != after ] && echo 1 || true)
  if [ -n "$during" ] && until_exists "$R/logs/train.log"; then
    side dtype python3 bench/acceptance_gap.py dtype --run "$R" --prompts "$PROMPTS" \
      --json "$C/dtype.json"
  fi
  if [ -n "$during" ] && [ -n "$TRAIN_ARGS" ]; then
    # shellcheck disable=SC2086
    side bench_train python3 bench/train.py $TRAIN_ARGS --out "$C/bench-train"
  fi
  if [ -n "$during" ] && until_exists "$R/reports/checkpoint.json"; then
    draft_check
  fi
  rc=0
  wait "$SM" || rc=$?
  echo "$(date +%T) build: exit $rc" >>"$C/status"
  if [ "$SIDE" = after ] && [ -e "$R/reports/checkpoint.json" ]; then
    draft_check
  fi
  if [ -n "${GREEDY:-}" ] && [ -d "$R/verifier/hf" ]; then # the run's verifier, each attention
    side greedy python3 bench/decode_attention.py greedy --verifier "$R/verifier/hf"
  fi
  touch "$C/done"
  ;;
wait)
  test -e "$C/status" || { # a machine released while idle comes back bare: nothing to wait for
    echo "error: no build on this machine ($C/status is missing); set it up and start again" >&2
    exit 1
  }
  end=$((SECONDS + ${2:-540}))
  while [ ! -e "$C/done" ] && [ $SECONDS -lt $end ]; do sleep 5; done
  # one archive: a call brings back only a few files, and none of the big ones
  small=()
  for f in reports logs benchmarks train/summary.json regenerated/regenerate.json; do
    test -e "$R/$f" && small+=("$R/$f")
  done
  for f in "$R"/hidden_states/shard-*.json; do # every shard's manifest, its sha256 included
    test -e "$f" && small+=("$f")
  done
  P=results/${RUN_NAME:-smollm2-gpu}-prompts # start-synthetic's prompts build
  for f in logs/regenerate.log regenerated/regenerate.json; do
    test -e "$P/$f" && small+=("$P/$f")
  done
  tar -czf "${OUT:?}/campaign.tgz" --exclude "*.safetensors" --exclude "bench-train/*/*" \
    --exclude "*.jsonl.gz" --exclude "checkpoint.tar.gz*" \
    "$C" "${small[@]}" 2>/dev/null || true
  ls -l "$OUT/campaign.tgz"
  # the regenerated conversations, once (gzip, in parts a call can bring back): a build that
  # does not finish in the session's device time can start from them next time, as
  # data.train.path with regeneration off; likewise start-synthetic's answered prompts
  bring_back "$R/regenerated/conversations.jsonl" regenerated
  bring_back "$P/regenerated/conversations.jsonl" "${RUN_NAME:-smollm2-gpu}-prompts"
  cat "$C/status"
  grep -m1 -i "model name" "$C/lscpu.txt" 2>/dev/null || true
  grep -E "steps|Error|error" "$C"/snakemake*.log | tail -3 || true
  # training's latest pace and time left (snakemake's log has only its first line)
  tail -c 20000 "$R/logs/train.log" 2>/dev/null | grep -a "^train: " | tail -1 || true
  df -h . | tail -1
  # a build that has ended sends its checkpoint's first four parts with this call where they fit
  # beside its files (a call brings back 8 files, 64 MiB): one call fewer, and a machine lost
  # before the next call still leaves them here; checkpoint-back 1 brings the rest
  if [ -e "$C/done" ] && [ -e "$R/checkpoint/model.safetensors" ] &&
    [ "$(find "$OUT" -type f | wc -l)" -le 3 ] && [ "$(du -sb "$OUT" | cut -f1)" -le $((3 << 20)) ]; then
    checkpoint_parts 0 >/dev/null
    echo "checkpoint parts 0-3 came back with this call; the rest: checkpoint-back 1"
  fi
  ;;
checkpoint-back) # I: the build's checkpoint and offline acceptance (acceptance.json), gzip'd
  # tar in parts of 15 MiB, parts 4I to 4I+3 to $OUT (a call brings back 64 MiB) with the whole
  # archive's sha256; bench/serve_gpu_draft.py serves it with vLLM on a CPU. A wait call that
  # finds the build ended has already brought back parts 0-3 where they fit beside its files.
  test -e "$R/checkpoint/model.safetensors" || {
    echo "error: $R/checkpoint/model.safetensors is missing: no finished build to bring back" >&2
    exit 1
  }
  checkpoint_parts "${2:-0}"
  ;;
*)
  echo "usage: $0 start | start-parity SEED | start-synthetic PROMPTS | start-prompts PROMPTS | start-regenerate | wait [SECONDS] | unpack-regenerated [DIR] | merge BASE SYNTHETIC OUT [TAG] | without-synthetic IN OUT | checkpoint-back [I]" >&2
  exit 2
  ;;
esac
