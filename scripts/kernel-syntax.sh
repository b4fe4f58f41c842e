#!/usr/bin/env bash
# Checks the CUDA kernel program (stage/cuda/kernels/*.cu, in the order
# NVRTC gets it) through clang's CUDA front end and NVPTX back end for
# sm_90, on a machine without a GPU or the CUDA toolkit: syntax, types,
# templates and PTX generation (not ptxas: inline PTX is not assembled).
# Needs clang 16 or newer (Debian: apt-get install clang-19).
#
#   bash scripts/kernel-syntax.sh [CLANG]
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG=${1:-$(command -v clang-19 || command -v clang)}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# What NVRTC declares implicitly and the sources use.
cat >"$dir/prelude.h" <<'H'
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
#define __cluster_dims__(...)
#include <__clang_cuda_builtin_vars.h>
typedef unsigned long size_t;
__device__ void __syncthreads();
__device__ void __syncwarp(unsigned mask = 0xffffffffu);
__device__ void __threadfence();
__device__ float __shfl_xor_sync(unsigned, float, int, int w = 32);
__device__ int __shfl_xor_sync(unsigned, int, int, int w = 32);
__device__ unsigned __shfl_xor_sync(unsigned, unsigned, int, int w = 32);
__device__ float __int_as_float(int);
__device__ int __float_as_int(float);
__device__ float __uint_as_float(unsigned);
__device__ unsigned __float_as_uint(float);
__device__ int atomicAdd(int*, int);
__device__ unsigned atomicAdd(unsigned*, unsigned);
__device__ int atomicCAS(int*, int, int);
__device__ int atomicMin(int*, int);
__device__ float rsqrtf(float);
__device__ float expf(float);
__device__ float __expf(float);
__device__ float logf(float);
__device__ float fmaxf(float, float);
__device__ float fminf(float, float);
__device__ float fabsf(float);
__device__ void sincosf(float, float*, float*);
__device__ int min(int, int);
__device__ int max(int, int);
__device__ unsigned min(unsigned, unsigned);
__device__ long long clock64();
H
{
	echo '#include "prelude.h"'
	for f in $(ls stage/cuda/kernels/*.cu | sort); do
		echo "#line 1 \"$(basename "$f")\""
		cat "$f"
		echo
	done
} >"$dir/prog.cu"
# As the stages compile it, and with the block timeline (TANDEM_TIMELINE).
for defs in "" -DTANDEM_TIMELINE; do
	"$CLANG" -x cuda --cuda-device-only --cuda-gpu-arch=sm_90 -nocudainc -nocudalib -O2 -S \
		-Wno-unknown-cuda-version $defs -o "$dir/prog.ptx" "$dir/prog.cu"
	echo "kernel program${defs:+ ($defs)}: $(grep -c '^.visible .entry' "$dir/prog.ptx") entry points compiled to PTX for sm_90"
done
