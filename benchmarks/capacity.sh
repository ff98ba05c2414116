#!/usr/bin/env bash
# Capacity of one worker (issue 12): jaxserve loadtest closed and open loop
# against a worker with a bounded interactive queue, and jaxserve plan's
# prediction for the same workload, in one run.
#
#   benchmarks/capacity.sh [OUT_DIR]        # about 6 minutes on 2 cores
#
# Steps:
#   1. jaxserve plan --measure: the tiny model's prefill/decode rates -> profile.json
#   2. a worker: --model tiny, memory store, --interactive-max-length 64
#      (the bounded queue: a full queue refuses the publish, queue_full),
#      --target-ttft 0.5 (interactive admission: overloaded);
#   3. jaxserve loadtest, closed loop at CONCURRENCY clients (20 s each):
#      1, 4 and 8 as issue 12 asks, then 32 and 128, where a closed loop can
#      hold more jobs than the bounded queue and the worker's seats;
#   4. jaxserve loadtest, open loop at RATES jobs/s (20 s each), up past
#      the worker's capacity so that the rejections begin;
#   5. jaxserve plan with the closed-loop run's measured workload and the
#      profile (its capacity line: jobs/s one worker completes).
# Environment: CONCURRENCY (default 1,4,8,32,128), RATES (default
# 10,20,40,80), DURATION (default 20).
set -euo pipefail
cd "$(dirname "$0")/.."
STAMP="$(date -u +%Y-%m-%dT%H%M%SZ)"
OUT="${1:-benchmarks/results/capacity-$STAMP}"   # a working folder (ignored by git)
KEEP="benchmarks/results/capacity-$STAMP"        # the summaries kept beside it
CONCURRENCY="${CONCURRENCY:-1,4,8,32,128}"
RATES="${RATES:-10,20,40,80}"
DURATION="${DURATION:-20}"
JS=.venv/bin/jaxserve
PREFIX="cap-$(date +%s)-$$"
mkdir -p "$OUT"

echo "== plan --measure" >&2
$JS plan --measure --model tiny --batches 1,4,16,32 --output "$OUT/profile.json" > "$OUT/plan-measure.txt"

echo "== worker $PREFIX" >&2
$JS worker --model tiny --prefix "$PREFIX" --store memory --max-num-seqs 32 \
  --interactive-max-length 64 --target-ttft 0.5 --log-format json > "$OUT/worker.log" 2>&1 &
WORKER=$!
cleanup() {
  kill -TERM "$WORKER" 2>/dev/null || true
  wait "$WORKER" 2>/dev/null || true
  PYTHONPATH=benchmarks .venv/bin/python -c "import sys, queue_common; queue_common.delete_topology(sys.argv[1])" "$PREFIX" || true
}
trap cleanup EXIT
for _ in $(seq 120); do grep -q worker_consuming "$OUT/worker.log" && break; sleep 1; done
grep -q worker_consuming "$OUT/worker.log" || { echo "worker did not start" >&2; tail -20 "$OUT/worker.log" >&2; exit 1; }

echo "== loadtest closed $CONCURRENCY" >&2
$JS loadtest --prefix "$PREFIX" --concurrency "$CONCURRENCY" --duration "$DURATION" --no-progress --output "$OUT/closed" | tee "$OUT/closed.txt" || true
echo "== loadtest open $RATES" >&2
$JS loadtest --prefix "$PREFIX" --rate "$RATES" --duration "$DURATION" --no-progress --output "$OUT/open" | tee "$OUT/open.txt" || true

echo "== plan for the measured workload" >&2
# Its "capacity:" line is the prediction to set beside the measured one;
# --rps (the open loop's top rate) only sets how many workers it asks for.
$JS plan --profile "$OUT/profile.json" --workload "$OUT/closed/loadtest.json" --rps "${RATES##*,}" \
  --ttft-target-s 0.5 | tee "$OUT/plan.txt" || true
# The run's summaries, kept beside the ignored working folder.
cp "$OUT/closed/loadtest.json" "$KEEP-closed.json"
cp "$OUT/open/loadtest.json" "$KEEP-open.json" 2>/dev/null || true
cp "$OUT/profile.json" "$KEEP-profile.json"
cp "$OUT/plan.txt" "$KEEP-plan.txt"
cp "$OUT/closed/loadtest.png" "docs/img/loadtest-tiny-closed.png"
cp "$OUT/open/loadtest.png" "docs/img/loadtest-tiny-open.png" 2>/dev/null || true
echo "results in $OUT; summaries $KEEP-*; plots docs/img/loadtest-tiny-*.png" >&2
