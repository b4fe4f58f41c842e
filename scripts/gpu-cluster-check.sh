#!/usr/bin/env bash
# tandem's GPU cluster check: tandemd daemons serving a model over two GPUs,
# NCCL between them, CUDA graphs dispatched by the leader, on-device
# hand-off of sampled tokens, against the same model on one GPU.
#
#   bash scripts/gpu-cluster-check.sh         here (with Go): builds tandemd
#                                             and tandemctl into .carry/cluster/
#   bash scripts/gpu-cluster-check.sh device  on a machine of two GPUs (python3
#                                             with torch and transformers; no Go)
#   bash scripts/gpu-cluster-check.sh device mixed
#                                             on a machine of one GPU or more: a
#                                             tiny model on a CPU and a CUDA stage
#                                             (each order) against two CPU stages
#   bash scripts/gpu-cluster-check.sh device failover
#                                             on a machine of one GPU: a CUDA and
#                                             a CPU stage daemon serve 8 greedy
#                                             requests; the CPU stage is SIGKILLed
#                                             mid-generation and the model moves
#                                             to the CUDA stage alone, where the
#                                             requests finish with the one-GPU
#                                             tokens (cmd/tandemd's
#                                             TestGPUStageFailover, built with
#                                             TEST=1)
#   bash scripts/gpu-cluster-check.sh device kill
#                                             on a machine of two GPUs: the
#                                             Llama-3.2-1B shape split over
#                                             both (NCCL); the last stage's
#                                             daemon SIGKILLed under load; the
#                                             leader moves the model to the
#                                             first GPU alone, every request
#                                             completes, and the greedy prompts
#                                             give the tokens they gave before
#   BACKEND=cpu bash scripts/gpu-cluster-check.sh device [mixed|failover|kill]
#                                             here, on the CPU with a tiny model:
#                                             checks the script itself
#
# The device part, for each model shape of SHAPES (llama1b: Llama-3.2-1B;
# llama8b: the width of Llama-3.1-8B with L8B of its 32 layers, to keep
# the checkpoint's making and loading short), (1) makes a random-init
# checkpoint with transformers (bf16, init std 0.02) and gives it a
# tokenizer of its vocabulary (tandemctl model init); then runs three
# clusters, each a leader (no stage) and `tandemd serve --backend cuda`
# stage daemons, one per GPU (CUDA_VISIBLE_DEVICES=i), all defaults
# otherwise (max 64 sequences and 512 tokens a step): (2) two GPUs, NCCL
# between them, hand-off on (3 steps in flight, two groups of up to 64
# requests taking turns); (3) two GPUs, hand-off off (2 steps in flight);
# (4) one GPU (hand-off on, 2 steps in flight). On each: a few greedy
# prompts one at a time through `tandemctl generate --json` (the two-GPU
# tokens must equal the one-GPU tokens); `tandemctl bench` of N concurrent
# requests for N in CONCURRENT (a 64-token prompt, THROUGHPUT_TOKENS greedy
# tokens each; tokens/s, latencies, and each stage's busy fraction from
# its own timing); and a `tandemctl trace` of TRACE_STEPS steps while
# TRACE_CONCURRENT requests run (where each stage's time goes, the Chrome
# trace kept). A shape is skipped when less than its estimate is left of
# DEADLINE seconds. Logs, traces, outputs and summary.json go to $OUT; a
# table is printed last.
#
#   bash scripts/gpu-cluster-check.sh device compare
#                                             on a machine of two GPUs, in one
#                                             run: the pair check of this tree
#                                             with BY_TIME=1, the same of the
#                                             BASELINE revision's tandemd (when
#                                             built), then kill; each into
#                                             OUT/<part>, all of it packed into
#                                             OUT/results.tar.gz
#
# With the device tool (nvidia-h200-x2): run `bash scripts/gpu-cluster-check.sh
# build [DIR]` here (DIR default .carry/cluster; BASELINE=<git ref> also
# builds that revision's tandemd; TEST=1 the test binary that failover runs),
# then on the device, with carry [DIR], `bash scripts/gpu-cluster-check.sh
# device [MODE]` (BIN=DIR when DIR is not the default). The binaries travel
# gzipped, to fit what the device takes (64 MiB with the tree).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-build}" = build ]; then
	set -e
	DIR=${2:-.carry/cluster}
	mkdir -p "$DIR" "$DIR/base"
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$tmp/tandemd" ./cmd/tandemd
	CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$tmp/tandemctl" ./cmd/tandemctl
	if [ "${TEST:-0}" = 1 ]; then
		CGO_ENABLED=0 go test -c -trimpath -ldflags="-s -w" -o "$tmp/tandemd.test" ./cmd/tandemd
	fi
	if [ -n "${BASELINE:-}" ]; then
		git worktree add --detach "$tmp/base-src" "$BASELINE" >/dev/null
		(cd "$tmp/base-src" && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$tmp/base/tandemd" ./cmd/tandemd)
		git worktree remove --force "$tmp/base-src"
		git rev-parse --short "$BASELINE" >"$DIR/base/REVISION"
		gzip -9c "$tmp/base/tandemd" >"$DIR/base/tandemd.gz"
	fi
	for f in tandemd tandemctl tandemd.test; do
		[ -f "$tmp/$f" ] && gzip -9c "$tmp/$f" >"$DIR/$f.gz"
	done
	du -sh "$DIR"
	exit 0
fi
if [ "$1" != device ]; then
	echo "usage: gpu-cluster-check.sh [build [DIR]] | device [pair|mixed|failover|kill|compare]" >&2
	exit 2
fi

export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
BACKEND=${BACKEND:-cuda}
MODE=${2:-pair}
OUT=${OUT:-/tmp/tandem-cluster-check}
WORK=${WORK:-/tmp/tandem-cluster}
BIN=${BIN:-$PWD/.carry/cluster}
# Binaries that travel gzipped are unpacked into WORK/bin (and the
# baseline's into WORK/bin-base).
if [ -f "$BIN/tandemd.gz" ]; then
	mkdir -p "$WORK/bin"
	for f in "$BIN"/*.gz; do
		gunzip -c "$f" >"$WORK/bin/$(basename "$f" .gz)" && chmod +x "$WORK/bin/$(basename "$f" .gz)"
	done
	if [ -f "$BIN/base/tandemd.gz" ]; then
		mkdir -p "$WORK/bin-base"
		gunzip -c "$BIN/base/tandemd.gz" >"$WORK/bin-base/tandemd" && chmod +x "$WORK/bin-base/tandemd"
		ln -sf "$WORK/bin/tandemctl" "$WORK/bin-base/tandemctl"
		cp "$BIN/base/REVISION" "$WORK/bin-base/" 2>/dev/null
	fi
	BIN=$WORK/bin
fi
if [ "$MODE" = compare ]; then
	# Each part runs this script again, into its own OUT and WORK.
	self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
	part() { # name BIN mode [env...]
		local name=$1 bin=$2 mode=$3
		shift 3
		env "$@" BIN="$bin" WORK="$WORK/$name" OUT="$OUT/$name" bash "$self" device "$mode" >"$OUT/$name.console" 2>&1
		local rc=$?
		echo "== $name: exit status $rc (${SECONDS}s)"
		if [ "$mode" = kill ]; then
			grep -E 'SIGKILL|bench under|^change:|same tokens|^prompt [0-9]|exit status' "$OUT/$name.console"
		else
			sed -n '/stage times/,/slowest stage\|nothing to move/p;/) summary$/,$p' "$OUT/$name.console"
		fi
		return $rc
	}
	mkdir -p "$OUT"
	status=0
	part after "$BIN" pair BY_TIME=1 || status=1
	if [ -x "$WORK/bin-base/tandemd" ]; then
		echo "baseline revision $(cat "$WORK/bin-base/REVISION" 2>/dev/null)"
		part before "$WORK/bin-base" pair || status=1
	fi
	part kill "$BIN" kill || status=1
	tar -C "$OUT" -czf "$WORK/results.tar.gz" . && mv "$WORK/results.tar.gz" "$OUT/"
	echo "exit status $status"
	exit $status
fi
SHAPES=${SHAPES:-llama1b llama8b}
L8B=${L8B:-8}
CONCURRENT=${CONCURRENT:-8 64 128}
THROUGHPUT_TOKENS=${THROUGHPUT_TOKENS:-256}
TRACE_STEPS=${TRACE_STEPS:-300}
TRACE_CONCURRENT=${TRACE_CONCURRENT:-128}
DEADLINE=${DEADLINE:-100000}
# SELECT=visible: each CUDA stage daemon sees only its GPU
# (CUDA_VISIBLE_DEVICES=k, as systemd/tandemd@.service runs it);
# SELECT=ordinal: every daemon sees all GPUs and takes --device k.
SELECT=${SELECT:-visible}
# BY_TIME=1: after its throughput runs, the two-GPU cluster with hand-off
# moves to the placement `tandemctl rebalance --by-time` makes from the
# stages' times over them, and is measured again (cluster two-bytime).
BY_TIME=${BY_TIME:-0}
# PLAN_llama1b, PLAN_llama8b: an explicit placement the two-GPU clusters
# of that shape move to before they are measured (tandemctl rebalance
# --plan, e.g. PLAN_llama1b=gpu0=0-9,gpu1=9-16); default: the leader's.
mkdir -p "$OUT" "$WORK/logs" "$WORK/runs"
LOG=$OUT/cluster.log
: >"$LOG"
: >"$WORK/runs/throughput.jsonl"
: >"$WORK/runs/traces.jsonl"
status=0
step() { echo "== $(date -u +%T) (${SECONDS}s) $*" | tee -a "$LOG"; }
ctl() { "$BIN/tandemctl" --addr "$LEADER" "$@"; }

step "environment"
{
	date -u
	if [ "$BACKEND" = cuda ]; then
		nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
		nvidia-smi topo -m
	fi
} 2>&1 | tee -a "$LOG"

if [ "$MODE" = failover ]; then
	# The test binary doubles as tandemd; it writes its own checkpoint.
	step "(F) a CUDA and a CPU stage; the CPU stage SIGKILLed mid-generation"
	fenv=()
	[ "$BACKEND" = cpu ] && fenv=(TANDEM_FAILOVER_BACKEND=cpu)
	env "${fenv[@]}" TANDEM_FAILOVER_LOG="$OUT/failover-daemons.log" timeout 420 "$BIN/tandemd.test" \
		-test.run '^TestGPUStageFailover$' -test.v -test.count=1 -test.timeout=400s 2>&1 | tee "$OUT/failover.log" | grep -v '^        ' | tee -a "$LOG"
	status=${PIPESTATUS[0]}
	step "summary"
	{
		grep -E 'gpu_failover_test.go:[0-9]+:' "$OUT/failover.log" | sed 's/^ *//'
		grep -E '^(--- |PASS|FAIL|ok)' "$OUT/failover.log"
		echo "exit status $status"
	} | tee "$OUT/summary.txt" | tee -a "$LOG"
	exit "$status"
fi

# checkpoint SHAPE DIR: a random-init checkpoint of the shape (on the CPU
# backend: a tiny one) with a tokenizer of its vocabulary; sets VOCAB.
checkpoint() {
	local shape=$1 dir=$2
	if [ "$BACKEND" != cuda ]; then
		local hidden=256
		[ "$shape" = llama8b ] && hidden=384
		"$BIN/tandemctl" model init --out "$dir" --layers 4 --hidden $hidden --heads 4 --kv-heads 2 --intermediate 512 >>"$LOG"
		VOCAB=512
		return
	fi
	python3 - "$shape" "$dir" "$L8B" <<'EOF' 2>&1 | tee -a "$LOG"
import sys, time
sys.path.insert(0, "scripts")
import hf_ref, torch
shape, out, l8b = sys.argv[1], sys.argv[2], int(sys.argv[3])
hf_ref.SHAPES["llama8b"] = dict(
    arch="llama", hidden_size=4096, num_hidden_layers=l8b, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
    max_position_embeddings=131072, rope_theta=500000.0, rope=hf_ref.LLAMA3_ROPE,
    tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=128000,
    eos_token_id=128001)
t = time.time()
model, _ = hf_ref.build(shape, 0.02, 1234)
model.save_pretrained(out)
n = sum(p.numel() for p in model.parameters())
print("%s (%d layers, %.2fB parameters) random init (std 0.02) saved in bf16 in %.1f s" % (shape, model.config.num_hidden_layers, n / 1e9, time.time() - t))
EOF
	[ "${PIPESTATUS[0]}" = 0 ] || return 1
	if [ ! -f "$WORK/tok/tokenizer.json" ]; then
		"$BIN/tandemctl" model init --out "$WORK/tok" --vocab 128256 --layers 1 --hidden 64 --heads 2 --kv-heads 1 --intermediate 64 >>"$LOG"
	fi
	cp "$WORK/tok/tokenizer.json" "$dir/"
	VOCAB=128256
}

# Prompts: random token ids, fixed seeds, of several lengths.
prompt_ids() { python3 -c "import random,sys; r=random.Random($1); print(','.join(str(r.randrange($VOCAB)) for _ in range($2)))"; }

PIDS=()
TAG=none
# start_cluster TAG "NAME:BACKEND ..." [leader flags...]: a leader without
# a stage, and a stage daemon of each NAME and BACKEND (the k-th cuda one
# on GPU k; the layers go to the stages in name order); waits until the
# leader serves.
start_cluster() {
	local tag=$1 specs=($2)
	TAG=$tag
	shift 2
	local common=(serve --model "$MODEL" --leader leader --fast-gossip --max-seqs 64 --max-batch-tokens 512 --log-level info)
	LEADER=127.0.0.1:17400
	PIDS=()
	"$BIN/tandemd" "${common[@]}" --name leader --stage=false --backend cpu --grpc "$LEADER" --gossip 127.0.0.1:17401 \
		--expect-stages "${#specs[@]}" "$@" >/dev/null 2>"$WORK/logs/$tag-leader.log" &
	PIDS+=($!)
	local i gpu=0
	for ((i = 0; i < ${#specs[@]}; i++)); do
		local name=${specs[$i]%%:*} backend=${specs[$i]#*:} dev
		[ "$BACKEND" = cpu ] && backend=cpu
		if [ "$backend" = cuda ] && [ "$SELECT" = ordinal ]; then
			dev=(--backend cuda --device $((gpu++)))
		elif [ "$backend" = cuda ]; then
			dev=(--backend cuda)
			export CUDA_VISIBLE_DEVICES=$((gpu++))
		else
			dev=(--backend cpu --memory 2GiB)
		fi
		TANDEM_CACHE_DIR=$WORK/cache "$BIN/tandemd" "${common[@]}" --name "$name" "${dev[@]}" \
			--grpc "127.0.0.1:$((17410 + 2 * i))" --gossip "127.0.0.1:$((17411 + 2 * i))" --seeds 127.0.0.1:17401 \
			>/dev/null 2>"$WORK/logs/$tag-$name.log" &
		PIDS+=($!)
		unset CUDA_VISIBLE_DEVICES
	done
	local start=$SECONDS
	until ctl status --json 2>/dev/null | python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin).get("serving") else 1)' 2>/dev/null; do
		if ((SECONDS - start > 180)); then
			echo "cluster $tag: not serving after 180 s" | tee -a "$LOG"
			ctl status 2>&1 | tee -a "$LOG"
			return 1
		fi
		sleep 0.25
	done
	echo "cluster $tag: serving $((SECONDS - start)) s after start" | tee -a "$LOG"
	local plan=PLAN_${tag%%-*}
	if ((${#specs[@]} > 1)) && [ -n "${!plan:-}" ]; then
		ctl rebalance --plan "${!plan}" --timeout 120s 2>&1 | tee -a "$LOG" || return 1
	fi
}

# stop_cluster TAG: SIGTERM (each daemon drains and exits), then the tail
# of each daemon's log into $OUT/daemons.log.
stop_cluster() {
	((${#PIDS[@]})) || return 0
	kill -TERM "${PIDS[@]}" 2>/dev/null
	for p in "${PIDS[@]}"; do
		timeout 40 tail --pid="$p" -f /dev/null || { echo "daemon $p did not stop: killed" | tee -a "$LOG"; kill -KILL "$p"; }
	done
	PIDS=()
	for f in "$WORK/logs/$1"-*.log; do
		echo "### $(basename "$f")"
		tail -n 60 "$f"
	done >>"$OUT/daemons.log"
}
trap 'stop_cluster "$TAG"' EXIT

# prompts TAG: the greedy prompts, one at a time, with log-probabilities.
prompts() {
	local tag=$1 n
	: >"$WORK/runs/$tag.prompts"
	for n in 7 33 100 250; do
		ctl generate --timeout 120s --ids "$(prompt_ids "$n" "$n")" --max-tokens 32 --temperature 0 --ignore-eos --logprobs 5 --json |
			python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))' >>"$WORK/runs/$tag.prompts" || return 1
	done
	echo "cluster $tag: 4 greedy prompts done" | tee -a "$LOG"
}

# throughput TAG: for each N in CONCURRENT, `tandemctl bench` (one process,
# one connection) of N concurrent requests of a 64-token prompt and
# THROUGHPUT_TOKENS tokens each; then a trace of TRACE_STEPS steps taken
# while TRACE_CONCURRENT requests run.
throughput() {
	local tag=$1 n
	for n in $CONCURRENT; do
		ctl bench --timeout 300s --concurrency "$n" --requests "$n" --prompt-tokens 64 --max-tokens "$THROUGHPUT_TOKENS" \
			--vocab "$VOCAB" --seed 1000 --json >"$WORK/runs/$tag-c$n.json" || return 1
		python3 - "$WORK/runs/$tag-c$n.json" "$tag" <<'EOF' | tee -a "$LOG" >>"$WORK/runs/throughput.jsonl"
import json, sys
b = json.load(open(sys.argv[1]))
print(json.dumps({"cluster": sys.argv[2], "concurrent": b["concurrency"], "tokens": b["generated_tokens"], "wall_s": round(b["wall_s"], 3),
                  "tokens_per_s": round(b["tokens_per_s"], 1), "ttft_p50_ms": round(b["ttft_p50_ms"], 2), "ttft_p99_ms": round(b["ttft_p99_ms"], 2),
                  "itl_p50_ms": round(b["itl_p50_ms"], 2), "itl_p99_ms": round(b["itl_p99_ms"], 2),
                  "busy": [round(s["busy"], 3) for s in b.get("stages", [])], "device_busy": [round(s["device_busy"], 3) for s in b.get("stages", [])]}))
EOF
	done
	# The trace: a longer run in the background, the steps recorded once
	# its prompts are in.
	ctl bench --timeout 300s --concurrency "$TRACE_CONCURRENT" --requests $((3 * TRACE_CONCURRENT)) --prompt-tokens 64 \
		--max-tokens "$THROUGHPUT_TOKENS" --vocab "$VOCAB" --seed 2000 --json >"$WORK/runs/$tag-traced.json" &
	local bench=$!
	sleep 0.5
	ctl trace --steps "$TRACE_STEPS" --wait 20s --out "$WORK/runs/$tag-trace.json" | tee "$WORK/runs/$tag-trace.txt" >>"$LOG" || status=1
	wait $bench || status=1
	python3 - "$WORK/runs/$tag-trace.json" "$tag" <<'EOF' >>"$WORK/runs/traces.jsonl"
import json, sys
t = json.load(open(sys.argv[1]))["otherData"]
t["cluster"] = sys.argv[2]
print(json.dumps(t))
EOF
	ctl status --json >"$WORK/runs/$tag.status.json"
}

# shape_run SHAPE: the checkpoint and the three clusters of one shape.
shape_run() {
	local shape=$1
	step "($shape 1) checkpoint"
	MODEL=$WORK/$shape
	checkpoint "$shape" "$MODEL" || return 1
	step "($shape 2) two GPUs, NCCL, hand-off on"
	if start_cluster "$shape-two" "gpu0:cuda gpu1:cuda"; then
		prompts "$shape-two" || status=1
		{ echo "# $shape: tandemctl status (two GPUs, hand-off on)"; ctl status; echo; echo "# tandemctl graphs"; ctl graphs; } >>"$OUT/status-graphs.txt" 2>&1
		throughput "$shape-two-handoff" || status=1
		{ echo; echo "# $shape: tandemctl graphs after the throughput runs"; ctl graphs; echo; ctl status; } >>"$OUT/status-graphs.txt" 2>&1
		if [ "$BY_TIME" = 1 ]; then
			ctl rebalance --by-time --timeout 120s 2>&1 | tee -a "$LOG" || status=1
			prompts "$shape-two-bytime" || status=1
			throughput "$shape-two-bytime" || status=1
		fi
	else
		status=1
	fi
	stop_cluster "$shape-two"

	step "($shape 3) two GPUs, NCCL, hand-off off"
	if start_cluster "$shape-two-nohandoff" "gpu0:cuda gpu1:cuda" --handoff=false; then
		prompts "$shape-two-nohandoff" || status=1
		throughput "$shape-two-nohandoff" || status=1
		{ echo; echo "# $shape: tandemctl status (two GPUs, hand-off off)"; ctl status; } >>"$OUT/status-graphs.txt" 2>&1
	else
		status=1
	fi
	stop_cluster "$shape-two-nohandoff"

	step "($shape 4) one GPU"
	if start_cluster "$shape-one" "gpu0:cuda"; then
		prompts "$shape-one" || status=1
		throughput "$shape-one-handoff" || status=1
	else
		status=1
	fi
	stop_cluster "$shape-one"
}

: >"$OUT/daemons.log"
: >"$OUT/status-graphs.txt"
if [ "$MODE" = kill ]; then
	step "(K) two GPUs, NCCL; the last stage SIGKILLed under load"
	MODEL=$WORK/llama1b
	checkpoint llama1b "$MODEL" || exit 1
	if start_cluster kill "gpu0:cuda gpu1:cuda"; then
		prompts kill-before || status=1
		ctl bench --timeout 300s --concurrency 32 --requests 96 --prompt-tokens 64 --max-tokens "$THROUGHPUT_TOKENS" \
			--vocab "$VOCAB" --seed 3000 --json >"$WORK/runs/kill-bench.json" &
		bench=$!
		sleep 1.5
		echo "SIGKILL gpu1 (pid ${PIDS[2]}) at $(date -u +%T.%N)" | tee -a "$LOG"
		kill -KILL "${PIDS[2]}"
		wait $bench || status=1
		python3 - "$WORK/runs/kill-bench.json" <<'EOF2' | tee -a "$LOG" || status=1
import json, sys
b = json.load(open(sys.argv[1]))
print("bench under the kill: %d requests, %d failed, %d tokens in %.2f s, TTFT p99 %.1f ms, ITL p99 %.1f ms" % (
    b["requests"], b["failed"], b["generated_tokens"], b["wall_s"], b["ttft_p99_ms"], b["itl_p99_ms"]))
for f in b.get("failures", []):
    print("  %d failed: %s" % (f["count"], f["error"]))
sys.exit(1 if b["failed"] else 0)
EOF2
		ctl status 2>&1 | tee -a "$LOG"
		prompts kill-after || status=1
		if cmp -s "$WORK/runs/kill-before.prompts" "$WORK/runs/kill-after.prompts"; then
			echo "the greedy prompts gave the same tokens and log-probabilities on the first GPU alone" | tee -a "$LOG"
		else
			python3 - "$WORK/runs/kill-before.prompts" "$WORK/runs/kill-after.prompts" <<'EOF2' | tee -a "$LOG"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
for i, (x, y) in enumerate(zip(a, b)):
    print("prompt %d: same tokens %s" % (i, x.get("tokenIds") == y.get("tokenIds")))
sys.exit(0 if all(x.get("tokenIds") == y.get("tokenIds") for x, y in zip(a, b)) and len(a) == len(b) == 4 else 1)
EOF2
			[ "${PIPESTATUS[0]}" = 0 ] || status=1
		fi
	else
		status=1
	fi
	stop_cluster kill
	echo "exit status $status" | tee -a "$LOG"
	exit $status
fi
if [ "$MODE" = mixed ]; then
	step "(M) CPU and CUDA stages mixed, TCP between them"
	MODEL=$WORK/model
	"$BIN/tandemctl" model init --out "$MODEL" --layers 4 --hidden 256 --heads 4 --kv-heads 2 --intermediate 512 | tee -a "$LOG"
	VOCAB=512
	for c in "cpu-cpu:a0:cpu a1:cpu" "cpu-cuda:b0:cpu b1:cuda" "cuda-cpu:c0:cuda c1:cpu"; do
		tag=${c%%:*}
		if start_cluster "$tag" "${c#*:}"; then
			prompts "$tag" || status=1
			ctl status >>"$OUT/status-graphs.txt" 2>&1
		else
			status=1
		fi
		stop_cluster "$tag"
	done
else
	for shape in $SHAPES; do
		# What a shape takes here, seconds: its checkpoint and three
		# clusters (two-GPU runs measured at 50-70 s for llama1b).
		need=70
		[ "$shape" = llama8b ] && need=$((60 + 8 * L8B))
		if ((SECONDS + need > DEADLINE)); then
			step "$shape skipped: ${SECONDS}s gone, it needs about ${need}s of the ${DEADLINE}s"
			echo "{\"shape\": \"$shape\", \"skipped\": true}" >>"$WORK/runs/skipped.jsonl"
			continue
		fi
		shape_run "$shape" || status=1
	done
fi

step "summary"
python3 - "$WORK/runs" "$OUT/summary.json" "$status" "$MODE" "$SHAPES" <<'EOF' 2>&1 | tee -a "$LOG"
import json, os, sys
runs, out, status, mode, shapes = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5].split()
def load(tag):
    p = os.path.join(runs, tag + ".prompts")
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
def lines(name):
    p = os.path.join(runs, name)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
def compare(got, want, exact):
    """Per prompt: whether the tokens match, where they first differ, and
    the largest log-probability difference before that."""
    rows, ok = [], len(got) == 4 and len(want) == 4
    for i, (a, b) in enumerate(zip(got, want)):
        ta, tb = a.get("tokenIds", []), b.get("tokenIds", [])
        first = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        n = first if first is not None else min(len(ta), len(tb))
        diff = 0.0
        for la, lb in zip(a.get("logprobs", [])[:n], b.get("logprobs", [])[:n]):
            diff = max(diff, abs(la.get("logprob", 0) - lb.get("logprob", 0)))
            for x, y in zip(la.get("top", []), lb.get("top", [])):
                if x.get("tokenId") == y.get("tokenId"):
                    diff = max(diff, abs(x.get("logprob", 0) - y.get("logprob", 0)))
        rows.append({"prompt": i, "tokens": len(ta), "same_tokens": ta == tb, "first_difference": first, "max_logprob_diff": diff})
        ok = ok and len(ta) == len(tb) and diff <= 0.05 and (ta == tb or not exact)
    return rows, ok
summary = {"status": status, "mode": mode}
ok = True
tp, traces = lines("throughput.jsonl"), lines("traces.jsonl")
summary["throughput"], summary["traces"], summary["skipped"] = tp, traces, lines("skipped.jsonl")
if mode == "mixed":
    # bf16 (CUDA) against float32 (CPU): tokens may part at near-ties.
    for tag in ("cpu-cuda", "cuda-cpu"):
        summary[tag + "_vs_cpu-cpu"], k = compare(load(tag), load("cpu-cpu"), False)
        ok = ok and k
else:
    for shape in shapes:
        if not load(shape + "-one"):
            continue
        for two in ("two", "two-nohandoff", "two-bytime"):
            if two == "two-bytime" and not load(shape + "-" + two):
                continue
            rows, k = compare(load(shape + "-" + two), load(shape + "-one"), True)
            summary[shape + "-" + two + "_vs_one"] = rows
            summary[shape + "-" + two + "_same_tokens"] = k
            print("%s, %s: %s" % (shape, two, "the same tokens as one GPU (4 prompts)" if k else "DIFFERS from one GPU: %s" % rows))
            ok = ok and k
for f in os.listdir(runs):
    if f.endswith(".status.json"):
        st = json.load(open(os.path.join(runs, f)))
        tag = f[:-len(".status.json")]
        summary[tag] = {k: st.get(k) for k in ("graphMode", "handoff", "maxInFlight", "scheduler")}
        summary[tag]["stages"] = [{k: s.get(k) for k in ("node", "layerLo", "layerHi", "backend", "device", "kvTokens", "weightBytes", "kvBytes", "graphBytes", "graphs", "captureTime", "nextLink", "busy", "deviceBusy")} for s in st.get("stages", [])]
json.dump(summary, open(out, "w"), indent=1)

# The table: tokens/s against one GPU, latencies, busy fractions.
print()
print("%-8s %-18s %5s %10s %7s %9s %9s %s" % ("shape", "cluster", "conc", "tokens/s", "x1 GPU", "TTFT p50", "ITL p50", "busy (device) per stage"))
for r in tp:
    shape, cl = r["cluster"].split("-", 1)
    one = next((o for o in tp if o["cluster"] == shape + "-one-handoff" and o["concurrent"] == r["concurrent"]), None)
    ratio = r["tokens_per_s"] / one["tokens_per_s"] if one else float("nan")
    busy = " ".join("%.0f%% (%.0f%%)" % (100 * b, 100 * d) for b, d in zip(r.get("busy", []), r.get("device_busy", [])))
    print("%-8s %-18s %5d %10.0f %7.2f %7.2fms %7.2fms %s" % (shape, cl, r["concurrent"], r["tokens_per_s"], ratio, r["ttft_p50_ms"], r["itl_p50_ms"], busy))
print()
print("traces (%s): where each stage's time went while the pipeline was full" % ", ".join("%d steps" % t["steps"] for t in traces[:1]))
print("%-28s %5s %8s %9s %6s %7s %6s %8s %6s %6s %6s %9s %9s" % ("cluster", "stage", "step ms", "in flight", "busy", "device", "wait", "hand-off", "recv", "send", "other", "fwd ms", "device ms"))
for t in traces:
    for s in t.get("stages", []):
        print("%-28s %5d %8.2f %9.2f %5.1f%% %6.1f%% %5.1f%% %7.1f%% %5.1f%% %5.1f%% %5.1f%% %9.3f %9.3f" % (
            t["cluster"], s["index"], t["step_ms"], t["mean_in_flight"], 100 * s["busy"], 100 * s["device_busy"], 100 * s["wait_step"],
            100 * s["handoff"], 100 * s["recv"], 100 * s["send"], 100 * s["other"], s["forward_ms"], s["device_ms"]))
if not ok:
    sys.exit(1)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || status=1
tar -C "$WORK/runs" -czf "$OUT/runs.tar.gz" . 2>/dev/null
echo "exit status $status" | tee -a "$LOG"
exit $status
