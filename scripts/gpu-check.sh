#!/usr/bin/env bash
# tandem's GPU check: the CUDA stage against Hugging Face transformers.
#
#   bash scripts/gpu-check.sh          here (with Go): builds the test binary
#                                      into .carry/cuda/ and prints nothing else
#   bash scripts/gpu-check.sh device   on the GPU machine (python3 with torch and
#                                      transformers; no Go): runs the check
#   bash scripts/gpu-check.sh device nccl
#                                      on a machine of two GPUs: only (6)
#   bash scripts/gpu-check.sh device quick
#                                      the check without its heavy parts: no
#                                      informational std 0.05 checkpoint, no
#                                      timings (5), tests in -short mode (200
#                                      requests in the long run of (7))
#
# The device part (1) makes random-init checkpoints with transformers and saves
# them in bf16 (a Llama-3.2-1B shape and a small Qwen2 shape with q/k/v bias),
# (2) computes the float32 transformers reference on those weights (prefill +
# 32 teacher-forced decode steps) and times transformers' eager bf16 decode
# step, (3) runs the stage/cuda GPU tests: the comparison with the reference
# (relative L2 of logits <= 2e-2 at every position, same top-1 wherever the
# reference's top-1/top-2 gap exceeds 0.1; transformers' own bf16 error is
# reported beside it), (4) CPU backend vs CUDA backend on
# tiny checkpoints, the conformance suite, the sampler and kernel-cache tests,
# (5) decode step times at batch 1, 8 and 32 in each CUDA-graph mode (NONE,
# PIECEWISE, FULL, FULL_AND_PIECEWISE) next to the HBM floor, with the time
# and memory of capturing the graphs, (6) with two GPUs, a model split over
# both through NCCL against the same model on one, and (7) the CUDA-graph
# tests: replays against eager runs on one and two stages, refused steps,
# and 2,000 random requests with zero device memory growth. Logs and
# summary.json go to $OUT; the summary table is printed last. The GPU tests
# include the conformance suite of stage/stagetest on the paged KV cache with
# on-device hand-off, and hand-off inside replayed CUDA graphs. (1b) writes
# two tiny checkpoints with tandemctl model init, loads them with
# transformers (every tensor must be found, the tokenizer must give tandem's
# ids) and adds them to the comparison of (3).
#
# Run it with the device tool as:
#   bash scripts/gpu-check.sh   (here), then on the device with carry [".carry"]:
#   bash scripts/gpu-check.sh device
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" != device ]; then
	set -e
	mkdir -p .carry/cuda
	CGO_ENABLED=0 go test -c -o .carry/cuda/cuda.test ./stage/cuda
	CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o .carry/cuda/tandemctl ./cmd/tandemctl
	exit 0
fi

export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tandem-gpu-check}
WORK=${WORK:-/tmp/tandem-hf}
RESULTS=$WORK/results
mkdir -p "$OUT" "$WORK" "$RESULTS"
LOG=$OUT/check.log
status=0
step() { echo "== $*" | tee -a "$LOG"; }

if [ "${2:-}" = nccl ]; then
	step "(6) model split over two GPUs through NCCL"
	TANDEM_RESULTS=$RESULTS .carry/cuda/cuda.test -test.v -test.run 'TestTwoGPUSplit' -test.timeout 300s 2>&1 | tee -a "$LOG" || status=1
	python3 scripts/hf_summary.py "$WORK" "$RESULTS" "$OUT" "tandem two-GPU check, $(date -u +%Y-%m-%d), exit status $status" 2>&1 | tee -a "$LOG"
	exit $status
fi

step "environment"
{
	date -u
	nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
	python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
} 2>&1 | tee -a "$LOG"
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)

quick=
[ "${2:-}" = quick ] && quick=1

step "(1, 2) checkpoints and float32 references with transformers"
# Init std 0.02 (transformers' default) is what tandem is held to; at 0.05
# the random network is chaotic enough that bf16 inference itself (tandem or
# transformers) strays past the bounds, so that case is informational.
if [ -n "$quick" ]; then
	python3 scripts/hf_ref.py --shape llama1b --std 0.02 --out "$WORK" 2>&1 | tee -a "$LOG" || status=1
else
	python3 scripts/hf_ref.py --shape llama1b --std 0.02 --out "$WORK" --time-batches 1,8,32 2>&1 | tee -a "$LOG" || status=1
	python3 scripts/hf_ref.py --shape llama1b --std 0.05 --name llama1b-std0.05 --informational --out "$WORK" 2>&1 | tee -a "$LOG" || status=1
fi
python3 scripts/hf_ref.py --shape qwen2 --std 0.02 --out "$WORK" 2>&1 | tee -a "$LOG" || status=1

step "(1b) checkpoints of tandemctl model init, read by transformers"
# A tiny llama (llama3 rope scaling) and a tiny qwen2 (q/k/v bias) written by
# tandem: transformers must load every tensor and tokenize as tandem does;
# its float32 reference on them is then held to the same bounds in (3).
printf '%s' '["Hello, world!", "  two  spaces and\ttabs\n", "naïve café, 123 + 4567", "日本語のテキスト 🙂", "<|begin_of_text|>x<|end_of_text|>"]' >"$WORK/init-texts.json"
for arch in llama qwen2; do
	src=$WORK/src/init-$arch
	extra=()
	[ "$arch" = llama ] && extra=(--rope-scaling)
	{
		.carry/cuda/tandemctl model init --out "$src" --arch "$arch" --seed 5 "${extra[@]}" &&
			.carry/cuda/tandemctl tokenize --tokenizer "$src/tokenizer.json" <"$WORK/init-texts.json" >"$WORK/init-$arch.ids.json" &&
			python3 scripts/hf_ref.py --from "$src" --name "init-$arch" --out "$WORK" \
				--texts "$WORK/init-texts.json" --tandem-ids "$WORK/init-$arch.ids.json"
	} 2>&1 | tee -a "$LOG" || status=1
done

if [ -n "$quick" ]; then
	step "(3, 4, 7) stage/cuda GPU tests, short"
	TANDEM_HF_DIR=$WORK TANDEM_RESULTS=$RESULTS TANDEM_CACHE_DIR=$WORK/cache \
		.carry/cuda/cuda.test -test.v -test.short -test.timeout 480s 2>&1 | tee -a "$LOG" || status=1
else
	step "(3, 4, 5, 7) stage/cuda GPU tests"
	TANDEM_HF_DIR=$WORK TANDEM_BENCH_CHECKPOINT=$WORK/llama1b TANDEM_RESULTS=$RESULTS TANDEM_CACHE_DIR=$WORK/cache \
		.carry/cuda/cuda.test -test.v -test.timeout 480s 2>&1 | tee -a "$LOG" || status=1
fi

# (6) runs inside the tests above (TestTwoGPUSplit) when the machine has two
# GPUs; it skips, saying so, on one.

step "summary"
grep -E '^(=== RUN|--- (PASS|FAIL|SKIP)|PASS|FAIL|ok )' "$LOG" | grep -E -- '--- (FAIL|SKIP)' | tail -20
python3 scripts/hf_summary.py "$WORK" "$RESULTS" "$OUT" "tandem GPU check on $DEVICE, $(date -u +%Y-%m-%d), exit status $status" 2>&1 | tee -a "$LOG"
exit $status
