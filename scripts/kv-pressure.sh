#!/usr/bin/env bash
# The KV-pressure and overload measurements of issue 13 on a real CPU
# cluster: a leader without a stage and two stage daemons (tandemd serve,
# --backend cpu) on loopback, a small random-init model, and a KV cache made
# small with --memory (about five requests of 1,500 positions).
#
#   bash scripts/kv-pressure.sh BIN_DIR [MEMORY]
#
# BIN_DIR holds tandemd and tandemctl (build them with
# CGO_ENABLED=0 go build -o BIN_DIR ./cmd/tandemd ./cmd/tandemctl, from any
# commit, to compare schedulers). It prints the KV capacity, then
# `tandemctl bench --json` of 16 requests of 64 + 1,436 tokens at
# concurrency 16 and at fixed concurrencies (CONCURRENCIES, default
# "16 1 2 3 4 5 6 8"), the leader's preemption count after each
# (Prometheus), and an overload run: OVERLOAD requests (default 3000; 0:
# none) at once of 16 + 16 tokens, with the leader's peak RSS.
set -euo pipefail
bin=$(cd "$1" && pwd)
memory=${2:-${MEMORY:-72949760}}
overload=${OVERLOAD:-3000}
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
"$bin/tandemctl" model init --out "$work/model" --max-positions 2048 --vocab 512 >/dev/null
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
lg=$(port); lgo=$(port); lm=$(port)
common=(serve --model "$work/model" --leader leader --fast-gossip --backend cpu --memory "$memory" --log-level info)
"$bin/tandemd" "${common[@]}" --name leader --stage=false --expect-stages 2 --grpc 127.0.0.1:$lg \
  --gossip 127.0.0.1:$lgo --metrics 127.0.0.1:$lm >"$work/leader.out" 2>"$work/leader.log" &
pids+=($!); leader=$!
for i in 1 2; do
  "$bin/tandemd" "${common[@]}" --name stage-$i --grpc 127.0.0.1:$(port) --gossip 127.0.0.1:$(port) \
    --seeds 127.0.0.1:$lgo >/dev/null 2>"$work/stage-$i.log" &
  pids+=($!)
done
export TANDEM_ADDR=127.0.0.1:$lg
for _ in $(seq 120); do
  if "$bin/tandemctl" status 2>/dev/null | grep -q '^pipeline: *serving'; then break; fi
  sleep 0.5
done
grep -ho 'kv_blocks=[0-9]*' "$work"/stage-*.log | sort -u | tr '\n' ' '; echo "(blocks of 16 positions per stage; 72949760 bytes: 470 blocks, 7,520 positions)"
[ -n "${ONLY_KV:-}" ] && exit 0
preemptions() { curl -s 127.0.0.1:$lm/metrics | awk '/^tandem_preemptions_total/ {print $2}'; }
bench() { "$bin/tandemctl" bench --json --vocab 512 "$@" || true; }
for c in ${CONCURRENCIES:-16 1 2 3 4 5 6 8}; do
  before=$(preemptions)
  r=$(bench --concurrency $c --requests 16 --prompt-tokens 64 --max-tokens 1436)
  echo "concurrency $c: $r preemptions_total_before=${before:-?} after=$(preemptions)"
done
[ "$overload" = 0 ] && exit 0
( while kill -0 $leader 2>/dev/null; do
    awk '/VmRSS/ {print $2}' /proc/$leader/status; sleep 0.2
  done ) >"$work/rss" &
rss_watch=$!
echo "leader RSS before the overload: $(awk '/VmRSS/ {print $2}' /proc/$leader/status) kB"
r=$(bench --concurrency $overload --requests $overload --prompt-tokens 16 --max-tokens 16)
kill $rss_watch 2>/dev/null || true
echo "overload $overload at once: $(echo "$r" | head -c 2000)"
echo "leader peak RSS during the overload: $(sort -n "$work/rss" | tail -1) kB"
