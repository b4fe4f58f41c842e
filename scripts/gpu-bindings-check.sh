#!/usr/bin/env bash
# GPU check of package gpu (purego bindings to libcuda, NVRTC, cuBLAS, NCCL)
# and collective/nccl, on a real GPU machine.
#
#   scripts/gpu-bindings-check.sh build   # here: builds .carry/gpu/gputest.test
#   scripts/gpu-bindings-check.sh run     # there: runs it, log in $OUT (or /tmp)
#
# The run that was used, through the device tool (kind nvidia-h200-x2, so that
# the NCCL tests have two GPUs; on one GPU they skip), carrying ".carry":
#
#   bash scripts/gpu-bindings-check.sh run
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
build)
	mkdir -p .carry/gpu
	CGO_ENABLED=0 go test -c -o .carry/gpu/gputest.test ./gpu/gputest
	echo "built .carry/gpu/gputest.test"
	;;
run)
	export NCCL_NVLS_ENABLE=0
	out="${OUT:-/tmp}"
	nvidia-smi -L || true
	# The enum values the bindings hard-code, as the headers there define them.
	h=/usr/local/cuda/include
	grep -hE '(CU_DEVICE_ATTRIBUTE_(MULTIPROCESSOR_COUNT|L2_CACHE_SIZE|COMPUTE_CAPABILITY_M(AJOR|INOR)|MAX_SHARED_MEMORY_PER_BLOCK(_OPTIN)?)|CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES|CU_STREAM_CAPTURE_MODE_THREAD_LOCAL|CUBLAS_COMPUTE_32F|CUDA_R_16BF|CUBLAS_GEMM_DEFAULT) +=' \
		"$h/cuda.h" "$h/cublas_api.h" "$h/library_types.h" 2>/dev/null | sed 's/^ *//' | sort -u || true
	set -o pipefail
	.carry/gpu/gputest.test -test.v -test.count=1 -test.timeout 300s 2>&1 | tee "$out/gputest.log"
	;;
*)
	echo "usage: $0 build|run" >&2
	exit 2
	;;
esac
