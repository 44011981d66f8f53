#!/usr/bin/env bash
# Run a list of benchmark commands on a lent GPU machine over several calls. A call lasts at
# most 10 minutes and the machine stays warm about 30 s after it, so the first call starts the
# list in the background and the next calls, sent back to back, wait on it and fetch results.
#
#   bench/gpu_queue.sh start QUEUE   # from the repository root with .xfer/ carried: copies the
#                                    # tree to /tmp/repo, installs the wheels (gpu_setup.sh),
#                                    # starts QUEUE's commands one after the other, detached
#   bench/gpu_queue.sh wait SECONDS  # until every command ended or SECONDS passed
#   bench/gpu_queue.sh collect       # packs each command's log, exit status and its --out's
#                                    # bench_*.json files and bench/train.py's profile-*.txt
#                                    # tables as NAME/ into $OUT/results.tgz, with
#                                    # the host's lscpu.txt (a call brings back at most 8 files)
#
# QUEUE is a file of lines "NAME COMMAND...", run by bash from /tmp/repo; "#" starts a comment.
# NAME's output goes to /tmp/gpuq/NAME.log, its exit status to NAME.rc; a command that fails
# does not stop the rest. collect takes the bench_*.json and profile-*.txt files of the folder
# after --out, and of a workflow run (--run RUN) its jobs' logs, the train job's summary.json
# and metrics.jsonl and workflow_gpu.py's JSON; after each command the other files under /tmp/o,
# workflow_gpu.py's default verifier folder and the runs' shards and training state are
# deleted (the disk for the next command; the training metrics first move to the run's train/
# folder).
# A later call whose machine is fresh (no /tmp/gpuq) says so and exits 3.
set -euo pipefail
Q=${GPUQ_DIR:-/tmp/gpuq}
REPO=${GPUQ_REPO:-/tmp/repo}
OUTS=${GPUQ_OUTS:-/tmp/o}            # the entries' --out folders
WORK=${GPUQ_WORK:-/tmp/workflow_gpu} # workflow_gpu.py's default --work (these four set otherwise
#                                      only by tests/test_bench_train.py)

entries() { grep -v '^[[:space:]]*\(#\|$\)' "$Q/queue"; }

case "${1:-}" in
start)
  queue=${2:?usage: gpu_queue.sh start QUEUE}
  [ -f "$queue" ] || {
    echo "error: no queue file $queue" >&2
    exit 2
  }
  rm -rf "$REPO" "$Q"
  mkdir -p "$Q"
  cp -r . "$REPO"
  cp "$queue" "$Q/queue"
  cd "$REPO"
  start=$(date +%s)
  eval "$(bench/gpu_setup.sh install)"
  export PYTHONPATH PATH
  echo "installed in $(($(date +%s) - start)) s"
  nvidia-smi -L
  lscpu >"$Q/lscpu.txt" # the host's CPU: cores, threads a core, model (beside every timing)
  grep -E '^(Model name|Thread|Core|Socket|CPU\(s\))' "$Q/lscpu.txt"
  # its own session, so that nothing of this call's ending reaches it
  setsid nohup "$REPO/bench/gpu_queue.sh" run </dev/null >/dev/null 2>&1 &
  ;;
run) # the background part of start
  cd "$REPO"
  while read -r name command; do
    date +%s >"$Q/$name.start"
    rc=0
    bash -c "$command" >"$Q/$name.log" 2>&1 || rc=$?
    echo "$rc" >"$Q/$name.rc"
    date +%s >"$Q/$name.end"
    # a workflow run's figures (workflow_gpu.py's JSON, reruns of its train job included) as
    # NAME.workflow_gpu.json, so that the next run does not overwrite them
    if [ -f "$WORK/workflow_gpu.json" ]; then mv "$WORK/workflow_gpu.json" "$Q/$name.workflow_gpu.json"; fi
    # the disk for the next command (one 8B-shape verifier and its shards fill most of a 64 GiB
    # disk): the large files go; what collect takes (bench_*.json files, profile tables, logs)
    # stays, and a workflow run's training metrics move out of the state folder first
    find "$OUTS" -type f ! -name 'bench_*.json' ! -name 'profile-*.txt' -delete 2>/dev/null || true
    for metrics in "$REPO"/results/*/train/state/metrics.jsonl; do
      if [ -f "$metrics" ]; then mv "$metrics" "${metrics%/state/metrics.jsonl}/metrics.jsonl"; fi
    done
    rm -rf "$WORK/verifier" "$REPO"/results/*/hidden_states "$REPO"/results/*/train/state
  done < <(entries)
  touch "$Q/all-done"
  ;;
wait)
  seconds=${2:?usage: gpu_queue.sh wait SECONDS}
  [ -d "$Q" ] || {
    echo "error: no queue on this machine (a fresh machine: start again)" >&2
    exit 3
  }
  end=$(($(date +%s) + seconds))
  while [ ! -f "$Q/all-done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 2; done
  while read -r name _; do
    if [ -f "$Q/$name.rc" ]; then
      echo "$name: exit $(cat "$Q/$name.rc") after $(($(cat "$Q/$name.end") - $(cat "$Q/$name.start"))) s"
    elif [ -f "$Q/$name.start" ]; then
      echo "$name: running for $(($(date +%s) - $(cat "$Q/$name.start"))) s"
    else
      echo "$name: waiting"
    fi
  done < <(entries)
  ;;
collect)
  [ -d "$Q" ] || exit 3
  # one archive: a call brings back at most 8 files
  staged=$(mktemp -d)
  while read -r name command; do
    [ -f "$Q/$name.start" ] || continue
    mkdir -p "$staged/$name"
    cp "$Q/$name".* "$staged/$name/"
    out=$(sed -n 's/.*--out[= ]\([^ ]*\).*/\1/p' <<<"$command")
    if [ -n "$out" ]; then cp "$out"/bench_*.json "$out"/profile-*.txt "$staged/$name/" 2>/dev/null || true; fi
    # a workflow run (workflow_gpu.py --run RUN): its jobs' logs and the train job's summary
    # and metrics, as NAME/run/
    run=$(sed -n 's/.*--run[= ]\([^ ]*\).*/\1/p' <<<"$command")
    if [ -n "$run" ] && [ -d "$REPO/results/$run" ]; then
      mkdir -p "$staged/$name/run"
      cp -r "$REPO/results/$run/logs" "$staged/$name/run/" 2>/dev/null || true
      cp "$REPO/results/$run"/train/{summary.json,metrics.jsonl} "$staged/$name/run/" 2>/dev/null || true
    fi
  done < <(entries)
  cp "$Q/lscpu.txt" "$staged/" 2>/dev/null || true
  tar -czf "$OUT/results.tgz" -C "$staged" .
  rm -rf "$staged"
  ;;
*)
  sed -n '2,22p' "$0" >&2
  exit 2
  ;;
esac
