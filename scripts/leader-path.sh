#!/usr/bin/env bash
# The leader's path on the CPU: what the whole stack adds to a known step
# time. A leader and one stage daemon (tandemd's test binary, which runs as
# tandemd) serve a tiny model whose stage sits behind an emulated device
# (stagetest.Timed): every step takes STEP on it, like a GPU's, while the
# CPU computes the tokens. `tandemctl bench --concurrency 1` then measures
# the inter-token latency through the gRPC API, for a stage that launches
# each step behind the running one (a stage.Launcher, as stage/cuda is) and
# for one run one Forward at a time (as stage/cuda was), side by side.
#
#   bash scripts/leader-path.sh [STEP [ROUNDS]]     STEP default 1ms, ROUNDS 2
#
# Prints per mode and round the ITL p50/p99, ITL p50 over STEP, and the
# emulated device's use (steps, steps launched behind another, idle time).
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:-1ms}
ROUNDS=${2:-2}
TOKENS=${TOKENS:-256}
REQUESTS=${REQUESTS:-8}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
CGO_ENABLED=0 go test -c -o "$DIR/tandemd" ./cmd/tandemd
CGO_ENABLED=0 go build -o "$DIR/tandemctl" ./cmd/tandemctl
"$DIR/tandemctl" model init --out "$DIR/model" --layers 2 --hidden 64 --heads 2 --kv-heads 1 --intermediate 128 --vocab 512 >/dev/null

# run MODE: a cluster with the stage in MODE (launch or sync), bench, stop.
run() {
	local mode=$1 port=$2
	local sync=0
	[ "$mode" = sync ] && sync=1
	local env=(TANDEMD_TEST_AS_DAEMON=1 TANDEMD_TEST_DEVICE_STEP="$STEP" TANDEMD_TEST_DEVICE_SYNC=$sync)
	local common=(serve --model "$DIR/model" --leader leader --fast-gossip --max-seqs 64 --max-batch-tokens 512 --log-level warn --backend cpu)
	env "${env[@]}" "$DIR/tandemd" "${common[@]}" --name leader --stage=false --grpc 127.0.0.1:$port \
		--gossip 127.0.0.1:$((port + 1)) --expect-stages 1 >/dev/null 2>"$DIR/leader.log" &
	local leader=$!
	env "${env[@]}" "$DIR/tandemd" "${common[@]}" --name s0 --grpc 127.0.0.1:$((port + 10)) \
		--gossip 127.0.0.1:$((port + 11)) --seeds 127.0.0.1:$((port + 1)) >/dev/null 2>"$DIR/stage.log" &
	local st=$!
	for _ in $(seq 1 120); do
		"$DIR/tandemctl" --addr 127.0.0.1:$port status --json 2>/dev/null | grep -q '"serving": *true' && break
		sleep 0.5
	done
	"$DIR/tandemctl" --addr 127.0.0.1:$port bench --concurrency 1 --requests "$REQUESTS" --prompt-tokens 16 \
		--max-tokens "$TOKENS" --vocab 512 --json >"$DIR/bench.json"
	kill -TERM $leader $st
	wait $leader $st || true
	python3 - "$DIR/bench.json" "$STEP" "$mode" "$(grep -h 'emulated device' "$DIR/stage.log" | tail -1)" <<'EOF'
import json, re, sys
b = json.load(open(sys.argv[1]))
step = sys.argv[2]
m = re.fullmatch(r"([\d.]+)(ms|us|µs|s)", step)
ms = float(m.group(1)) * {"ms": 1, "us": 1e-3, "µs": 1e-3, "s": 1e3}[m.group(2)]
dev = re.sub(r"^emulated device: step [^:]*: ", "", sys.argv[4])
print("%-7s ITL p50 %.3f ms  p99 %.3f ms  p50/step %.3f  %6.0f tokens/s  device: %s" % (
    sys.argv[3], b["itl_p50_ms"], b["itl_p99_ms"], b["itl_p50_ms"] / ms, b["tokens_per_s"], dev))
EOF
}

echo "leader path: step $STEP on an emulated device, concurrency 1, $REQUESTS requests of $TOKENS tokens, $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
	run sync $((18400 + 40 * r))
	run launch $((18420 + 40 * r))
done
