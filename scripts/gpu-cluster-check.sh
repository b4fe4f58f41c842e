#!/usr/bin/env bash
# tandem's GPU cluster check: tandemd daemons serving a model over two GPUs,
# NCCL between them, CUDA graphs dispatched by the leader, on-device
# hand-off of sampled tokens.
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
#                                             TestGPUStageFailover)
#   BACKEND=cpu bash scripts/gpu-cluster-check.sh device [mixed|failover]
#                                             here, on the CPU with a tiny model:
#                                             checks the script itself
#
# The device part (1) makes a random-init Llama-3.2-1B-shaped checkpoint with
# transformers (bf16, init std 0.02, as scripts/hf_ref.py builds it) and gives
# it a tokenizer of its vocabulary (tandemctl model init); (2) starts a leader
# (no stage) and two `tandemd serve --backend cuda` stage daemons, one per GPU
# (CUDA_VISIBLE_DEVICES=0 and 1), which the leader wires with NCCL; (3) runs a
# few greedy prompts one at a time through `tandemctl generate --json` and
# saves `tandemctl status` and `tandemctl graphs`; (4) measures tokens/s and
# latencies of N concurrent requests with `tandemctl bench`; (5) restarts the
# cluster with --handoff=false (p steps in flight instead of p+1) and
# measures the same; (6) starts a leader and
# one stage daemon on GPU 0 and runs the same prompts: the tokens must match
# the two-GPU cluster's and the log-probabilities agree within bf16
# tolerance. Logs, outputs and summary.json go to $OUT; the summary is
# printed last.
#
# With the device tool (nvidia-h200-x2): run `bash scripts/gpu-cluster-check.sh`
# here, then on the device with carry [".carry"]:
# `bash scripts/gpu-cluster-check.sh device`.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" != device ]; then
	set -e
	mkdir -p .carry/cluster
	CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o .carry/cluster/tandemd ./cmd/tandemd
	CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o .carry/cluster/tandemctl ./cmd/tandemctl
	CGO_ENABLED=0 go test -c -trimpath -o .carry/cluster/tandemd.test ./cmd/tandemd
	exit 0
fi

export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
BACKEND=${BACKEND:-cuda}
MODE=${2:-pair}
OUT=${OUT:-/tmp/tandem-cluster-check}
WORK=${WORK:-/tmp/tandem-cluster}
BIN=${BIN:-$PWD/.carry/cluster}
CONCURRENT=${CONCURRENT:-8 32 64}
THROUGHPUT_TOKENS=${THROUGHPUT_TOKENS:-256}
mkdir -p "$OUT" "$WORK/logs" "$WORK/runs"
LOG=$OUT/cluster.log
: >"$LOG"
status=0
step() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
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

step "(1) checkpoint"
MODEL=$WORK/model
if [ "$BACKEND" = cuda ] && [ "$MODE" != mixed ]; then
	python3 - "$MODEL" <<'EOF' 2>&1 | tee -a "$LOG"
import sys, time
sys.path.insert(0, "scripts")
import hf_ref
t = time.time()
model, _ = hf_ref.build("llama1b", 0.02, 1234)
model.save_pretrained(sys.argv[1])
print("llama1b random init (std 0.02) saved in bf16 in %.1f s" % (time.time() - t))
EOF
	"$BIN/tandemctl" model init --out "$WORK/tok" --vocab 128256 --layers 1 --hidden 64 --heads 2 --kv-heads 1 --intermediate 64 >>"$LOG"
	cp "$WORK/tok/tokenizer.json" "$MODEL/"
	VOCAB=128256
else
	"$BIN/tandemctl" model init --out "$MODEL" --layers 4 --hidden 256 --heads 4 --kv-heads 2 --intermediate 512 | tee -a "$LOG"
	VOCAB=512
fi

# Prompts: random token ids, fixed seeds, of several lengths.
prompt_ids() { python3 -c "import random,sys; r=random.Random($1); print(','.join(str(r.randrange($VOCAB)) for _ in range($2)))"; }

PIDS=()
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
		if [ "$backend" = cuda ]; then
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
		sleep 0.5
	done
	echo "cluster $tag: serving $((SECONDS - start)) s after start" | tee -a "$LOG"
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
		tail -n 80 "$f"
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
# THROUGHPUT_TOKENS tokens each.
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
                  "itl_p50_ms": round(b["itl_p50_ms"], 2), "itl_p99_ms": round(b["itl_p99_ms"], 2)}))
EOF
	done
	ctl status --json >"$WORK/runs/$tag.status.json"
}

: >"$OUT/daemons.log"
if [ "$MODE" = mixed ]; then
	step "(M) CPU and CUDA stages mixed, TCP between them"
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
elif start_cluster two "gpu0:cuda gpu1:cuda"; then
	step "(2, 3, 4) two GPUs, NCCL, hand-off on"
	prompts two || status=1
	{ echo "# tandemctl status (two GPUs, hand-off on)"; ctl status; echo; echo "# tandemctl graphs"; ctl graphs; } >"$OUT/status-graphs.txt" 2>&1
	throughput two-handoff || status=1
	{ echo; echo "# tandemctl graphs after the throughput runs"; ctl graphs; echo; ctl status; } >>"$OUT/status-graphs.txt" 2>&1
	stop_cluster two

	step "(5) two GPUs, NCCL, hand-off off"
	if start_cluster two-nohandoff "gpu0:cuda gpu1:cuda" --handoff=false; then
		throughput two-nohandoff || status=1
		{ echo; echo "# tandemctl status (two GPUs, hand-off off)"; ctl status; } >>"$OUT/status-graphs.txt" 2>&1
	else
		status=1
	fi
	stop_cluster two-nohandoff

	step "(6) one GPU"
	if start_cluster one "gpu0:cuda"; then
		prompts one || status=1
		throughput one-handoff || status=1
	else
		status=1
	fi
	stop_cluster one
else
	status=1
	stop_cluster two
fi

step "summary"
python3 - "$WORK/runs" "$OUT/summary.json" "$status" "$MODE" <<'EOF' 2>&1 | tee -a "$LOG"
import json, os, sys
runs, out, status, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def load(tag):
    p = os.path.join(runs, tag + ".prompts")
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
if mode == "mixed":
    # bf16 (CUDA) against float32 (CPU): tokens may part at near-ties.
    for tag in ("cpu-cuda", "cuda-cpu"):
        summary[tag + "_vs_cpu-cpu"], k = compare(load(tag), load("cpu-cpu"), False)
        ok = ok and k
else:
    summary["prompts"], ok = compare(load("two"), load("one"), True)
    summary["two_gpu_matches_one_gpu"] = ok
tp = os.path.join(runs, "throughput.jsonl")
summary["throughput"] = [json.loads(l) for l in open(tp)] if os.path.exists(tp) else []
for tag in ("two-handoff", "two-nohandoff", "one-handoff"):
    p = os.path.join(runs, tag + ".status.json")
    if os.path.exists(p):
        st = json.load(open(p))
        summary[tag] = {k: st.get(k) for k in ("graphMode", "handoff", "maxInFlight", "scheduler")}
        summary[tag]["stages"] = [{k: s.get(k) for k in ("node", "layerLo", "layerHi", "backend", "device", "kvTokens", "weightBytes", "kvBytes", "graphBytes", "graphs", "captureTime", "nextLink")} for s in st.get("stages", [])]
json.dump(summary, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1))
if not ok:
    sys.exit(1)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || status=1
for tag in two one cpu-cuda cuda-cpu cpu-cpu; do
	[ -f "$WORK/runs/$tag.prompts" ] && cp "$WORK/runs/$tag.prompts" "$OUT/$tag-prompts.jsonl"
done
echo "exit status $status" | tee -a "$LOG"
exit $status
