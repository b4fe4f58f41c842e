/*
 * A stand-in for libcuda, libnvrtc, libcublas and libnccl, built by the
 * tests with the host compiler. It exports the ABI symbols package gpu binds,
 * with the C signatures of the CUDA headers, so that the Go side's argument
 * passing (mixed scalar arguments on the stack, 128-byte structs by value,
 * pointers to scalars) and its status handling are checked without a GPU.
 * "Device memory" is host memory; kernels named vec_add run on the host.
 * Calls that need a context fail with CUDA_ERROR_INVALID_CONTEXT on threads
 * where none was made current, as the driver does.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum { OK = 0, INVALID_VALUE = 1, INVALID_DEVICE = 101, INVALID_IMAGE = 200,
       INVALID_CONTEXT = 201, NOT_FOUND = 500, NOT_READY = 600 };

static __thread void *current_ctx;
static int busy;          /* streams and events report NOT_READY */
static int async_error;   /* ncclCommGetAsyncError result */
static int aborts;
static char wire[1 << 20]; /* NCCL sends not yet received, in order */
static size_t wire_len;
static unsigned long long last_launch[11];
static unsigned long long last_gemm[19];
static float last_alpha, last_beta;
static unsigned long long last_init[4];
static char last_options[1024];
static int attr_set[3];

#define NEED_CTX() do { if (!current_ctx) return INVALID_CONTEXT; } while (0)

/* ---- control and inspection, for the tests ---- */
void mock_reset(void) {
	busy = 0; async_error = 0; aborts = 0; wire_len = 0;
	memset(last_launch, 0, sizeof last_launch);
	memset(last_gemm, 0, sizeof last_gemm);
	memset(last_init, 0, sizeof last_init);
	last_options[0] = 0;
}
void mock_set_busy(int b) { busy = b; }
void mock_set_async_error(int e) { async_error = e; }
int mock_aborts(void) { return aborts; }
void mock_last_launch(unsigned long long out[11]) { memcpy(out, last_launch, sizeof last_launch); }
void mock_last_gemm(unsigned long long out[19], float *alpha, float *beta) {
	memcpy(out, last_gemm, sizeof last_gemm); *alpha = last_alpha; *beta = last_beta;
}
void mock_last_init(unsigned long long out[4]) { memcpy(out, last_init, sizeof last_init); }
void mock_last_options(char *buf, int n) { snprintf(buf, n, "%s", last_options); }
void mock_last_func_attr(int out[3]) { memcpy(out, attr_set, sizeof attr_set); }

/* ---- driver: devices and contexts ---- */
CUresult cuInit(unsigned flags) { return flags ? INVALID_VALUE : OK; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = 2; return OK; }
CUresult cuDeviceGet(int *d, int ordinal) {
	if (ordinal < 0 || ordinal >= 2) return INVALID_DEVICE;
	*d = ordinal; return OK;
}
CUresult cuDeviceGetName(char *name, int len, int dev) { snprintf(name, len, "Mock GPU %d", dev); return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
	(void)dev;
	switch (attr) {
	case 75: *v = 9; return OK;          /* compute capability major */
	case 76: *v = 0; return OK;          /* minor */
	case 16: *v = 132; return OK;        /* multiprocessors */
	case 38: *v = 50 << 20; return OK;   /* L2 bytes */
	case 8: *v = 48 << 10; return OK;    /* shared per block */
	case 97: *v = 227 << 10; return OK;  /* shared per block, opt-in */
	case 41: *v = 1; return OK;          /* unified addressing */
	}
	return INVALID_VALUE;
}
CUresult cuDeviceTotalMem_v2(size_t *b, int dev) { (void)dev; *b = (size_t)80 << 30; return OK; }
static char contexts[2];
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = &contexts[dev]; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; return OK; }
CUresult cuCtxSetCurrent(void *ctx) { current_ctx = ctx; return OK; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current_ctx; return OK; }

/* ---- memory ---- */
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	NEED_CTX();
	void *m = malloc(n ? n : 1);
	if (!m) return 2;
	*p = (CUdeviceptr)(uintptr_t)m; return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) { NEED_CTX(); free((void *)(uintptr_t)p); return OK; }
CUresult cuMemAllocHost_v2(void **p, size_t n) { NEED_CTX(); *p = malloc(n); return OK; }
CUresult cuMemFreeHost(void *p) { NEED_CTX(); free(p); return OK; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { NEED_CTX(); memcpy((void *)(uintptr_t)d, s, n); return OK; }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { NEED_CTX(); memcpy(d, (void *)(uintptr_t)s, n); return OK; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) { (void)st; return cuMemcpyHtoD_v2(d, s, n); }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, void *st) { (void)st; return cuMemcpyDtoH_v2(d, s, n); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) {
	(void)st; NEED_CTX(); memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n); return OK;
}
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, void *st) {
	(void)st; NEED_CTX();
	for (size_t i = 0; i < n; i++) ((unsigned *)(uintptr_t)d)[i] = v;
	return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void *st) {
	(void)st; NEED_CTX(); memset((void *)(uintptr_t)d, v, n); return OK;
}
CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) { NEED_CTX(); *free_ = (size_t)70 << 30; *total = (size_t)80 << 30; return OK; }

/* ---- streams, events and graphs: a stream records launches while captured ---- */
typedef struct { void *f; unsigned grid, block; void *a, *b, *out; int n; } launch;
typedef struct { int capturing; int mode; int n; launch l[64]; } stream;
typedef struct { int n; launch l[64]; } graph;

CUresult cuStreamCreate(void **s, unsigned flags) {
	NEED_CTX();
	if (flags != 1) return INVALID_VALUE; /* package gpu makes non-blocking streams */
	*s = calloc(1, sizeof(stream)); return OK;
}
CUresult cuStreamSynchronize(void *s) { (void)s; NEED_CTX(); return OK; }
CUresult cuStreamQuery(void *s) { (void)s; NEED_CTX(); return busy ? NOT_READY : OK; }
CUresult cuStreamWaitEvent(void *s, void *e, unsigned f) { (void)s; (void)e; NEED_CTX(); return f ? INVALID_VALUE : OK; }
CUresult cuStreamDestroy_v2(void *s) { NEED_CTX(); free(s); return OK; }
CUresult cuEventCreate(void **e, unsigned flags) { NEED_CTX(); *e = malloc(8); *(long *)*e = flags; return OK; }
static long clock_ticks;
CUresult cuEventRecord(void *e, void *s) { (void)s; NEED_CTX(); *(long *)e = ++clock_ticks; return OK; }
CUresult cuEventSynchronize(void *e) { (void)e; NEED_CTX(); return OK; }
CUresult cuEventQuery(void *e) { (void)e; NEED_CTX(); return busy ? NOT_READY : OK; }
/* 1.5 ms per record between the two events */
CUresult cuEventElapsedTime_v2(float *ms, void *a, void *b) { NEED_CTX(); *ms = 1.5f * (float)(*(long *)b - *(long *)a); return OK; }
CUresult cuEventDestroy_v2(void *e) { NEED_CTX(); free(e); return OK; }

static const char vec_add_name[] = "vec_add";
CUresult cuModuleLoadData(void **m, const void *image) {
	NEED_CTX();
	if (memcmp(image, "MOCKBIN", 7) != 0 && memcmp(image, "MOCKPTX", 7) != 0) return INVALID_IMAGE;
	*m = malloc(1); return OK;
}
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
	(void)m; NEED_CTX();
	if (strcmp(name, vec_add_name) != 0) return NOT_FOUND;
	*f = (void *)vec_add_name; return OK;
}
CUresult cuModuleUnload(void *m) { NEED_CTX(); free(m); return OK; }
CUresult cuFuncSetAttribute(void *f, int attr, int v) {
	NEED_CTX(); attr_set[0] = f == vec_add_name; attr_set[1] = attr; attr_set[2] = v; return OK;
}

static void run(const launch *l) {
	const float *a = l->a, *b = l->b; float *out = l->out;
	for (int i = 0; i < l->n && (unsigned)i < l->grid * l->block; i++) out[i] = a[i] + b[i];
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shmem, void *st, void **params, void **extra) {
	NEED_CTX();
	unsigned long long v[11] = {(uintptr_t)f, gx, gy, gz, bx, by, bz, shmem, (uintptr_t)st, (uintptr_t)params, (uintptr_t)extra};
	memcpy(last_launch, v, sizeof v);
	if (f != vec_add_name || !params || extra) return INVALID_VALUE;
	launch l = {f, gx, bx, *(void **)params[0], *(void **)params[1], *(void **)params[2], *(int *)params[3]};
	stream *s = st;
	if (s && s->capturing) {
		if (s->n == 64) return INVALID_VALUE;
		s->l[s->n++] = l;
		return OK;
	}
	run(&l);
	return OK;
}

/* CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out. */
typedef struct { int id; char pad[4]; union { char pad[64]; int value; } v; } launch_attr;
typedef struct {
	unsigned gx, gy, gz, bx, by, bz, shmem;
	void *stream;
	launch_attr *attrs;
	unsigned num_attrs;
} launch_config;

/* cuLaunchKernelEx records what cuLaunchKernel would, with slot 10 holding
 * the first attribute as num_attrs << 32 | id << 16 | value, then launches. */
CUresult cuLaunchKernelEx(const launch_config *c, void *f, void **params, void **extra) {
	NEED_CTX();
	if (!c || c->num_attrs != 1 || !c->attrs) return INVALID_VALUE;
	unsigned long long a = (unsigned long long)c->num_attrs << 32 |
	                       (unsigned long long)(c->attrs[0].id & 0xffff) << 16 | (c->attrs[0].v.value & 0xffff);
	CUresult r = cuLaunchKernel(f, c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->shmem, c->stream, params, extra);
	last_launch[10] = a;
	return r;
}

CUresult cuStreamBeginCapture_v2(void *st, int mode) {
	NEED_CTX(); stream *s = st;
	if (!s || s->capturing) return INVALID_VALUE;
	s->capturing = 1; s->mode = mode; s->n = 0; return OK;
}
CUresult cuStreamEndCapture(void *st, void **g) {
	NEED_CTX(); stream *s = st;
	if (!s || !s->capturing) return INVALID_VALUE;
	graph *gr = malloc(sizeof *gr);
	gr->n = s->n; memcpy(gr->l, s->l, sizeof s->l);
	s->capturing = 0; *g = gr; return OK;
}
CUresult cuGraphInstantiateWithFlags(void **exec, void *g, unsigned long long flags) {
	NEED_CTX();
	if (flags) return INVALID_VALUE;
	graph *e = malloc(sizeof *e); memcpy(e, g, sizeof *e); *exec = e; return OK;
}
CUresult cuGraphUpload(void *e, void *s) { (void)e; (void)s; NEED_CTX(); return OK; }
CUresult cuGraphLaunch(void *e, void *s) {
	(void)s; NEED_CTX(); graph *g = e;
	for (int i = 0; i < g->n; i++) run(&g->l[i]);
	return OK;
}
CUresult cuGraphGetNodes(void *g, void **nodes, size_t *n) { NEED_CTX(); if (nodes) return INVALID_VALUE; *n = ((graph *)g)->n; return OK; }
CUresult cuGraphExecDestroy(void *e) { NEED_CTX(); free(e); return OK; }
CUresult cuGraphDestroy(void *g) { NEED_CTX(); free(g); return OK; }

CUresult cuGetErrorName(CUresult r, const char **s) {
	switch (r) {
	case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return OK;
	case INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; return OK;
	case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; return OK;
	case NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; return OK;
	case NOT_READY: *s = "CUDA_ERROR_NOT_READY"; return OK;
	}
	*s = NULL; return INVALID_VALUE;
}
CUresult cuGetErrorString(CUresult r, const char **s) {
	switch (r) {
	case INVALID_VALUE: *s = "invalid argument"; return OK;
	case INVALID_IMAGE: *s = "device kernel image is invalid"; return OK;
	case INVALID_CONTEXT: *s = "invalid device context"; return OK;
	case NOT_FOUND: *s = "named symbol not found"; return OK;
	case NOT_READY: *s = "device not ready"; return OK;
	}
	*s = NULL; return INVALID_VALUE;
}

/* ---- NVRTC: "#error" in the source fails; compute_XX gives PTX only ---- */
typedef struct { char *src; int ptx; char log[128]; } program;
int nvrtcVersion(int *major, int *minor) { *major = 13; *minor = 0; return 0; }
int nvrtcCreateProgram(program **p, const char *src, const char *name, int nh, const char *const *h, const char *const *hn) {
	if (nh || h || hn || !name) return 3;
	*p = calloc(1, sizeof(program)); (*p)->src = strdup(src); return 0;
}
int nvrtcCompileProgram(program *p, int n, const char *const *opts) {
	last_options[0] = 0;
	for (int i = 0; i < n; i++) {
		if (i) strncat(last_options, " ", sizeof last_options - strlen(last_options) - 1);
		strncat(last_options, opts[i], sizeof last_options - strlen(last_options) - 1);
		if (strncmp(opts[i], "--gpu-architecture=compute_", 27) == 0) p->ptx = 1;
	}
	if (strstr(p->src, "#error")) { snprintf(p->log, sizeof p->log, "mock.cu(1): error: boom"); return 6; }
	return 0;
}
int nvrtcGetProgramLogSize(program *p, size_t *n) { *n = strlen(p->log) + 1; return 0; }
int nvrtcGetProgramLog(program *p, char *log) { strcpy(log, p->log); return 0; }
int nvrtcGetCUBINSize(program *p, size_t *n) { if (p->ptx) { *n = 0; return 4; } *n = 7 + strlen(p->src); return 0; }
int nvrtcGetCUBIN(program *p, char *out) { memcpy(out, "MOCKBIN", 7); memcpy(out + 7, p->src, strlen(p->src)); return 0; }
int nvrtcGetPTXSize(program *p, size_t *n) { *n = 8 + strlen(p->src); return 0; }
int nvrtcGetPTX(program *p, char *out) { memcpy(out, "MOCKPTX", 7); strcpy(out + 7, p->src); return 0; }
int nvrtcDestroyProgram(program **p) { free((*p)->src); free(*p); *p = NULL; return 0; }
const char *nvrtcGetErrorString(int r) { return r == 6 ? "NVRTC_ERROR_COMPILATION" : "NVRTC_ERROR_OTHER"; }

/* ---- cuBLAS: GemmEx computes column-major GEMMs of bf16 or fp32 on the host ---- */
static float load(const void *p, int type, size_t i) {
	if (type == 0) return ((const float *)p)[i];
	uint32_t w = (uint32_t)((const uint16_t *)p)[i] << 16; float f; memcpy(&f, &w, 4); return f;
}
static void store(void *p, int type, size_t i, float f) {
	if (type == 0) { ((float *)p)[i] = f; return; }
	uint32_t w; memcpy(&w, &f, 4); w += 0x7fff + ((w >> 16) & 1); ((uint16_t *)p)[i] = (uint16_t)(w >> 16);
}
int cublasCreate_v2(void **h) { *h = malloc(64); return 0; }
int cublasDestroy_v2(void *h) { free(h); return 0; }
int cublasSetStream_v2(void *h, void *s) { (void)h; (void)s; return 0; }
int cublasSetWorkspace_v2(void *h, void *ws, size_t n) { (void)h; return ws && n ? 0 : 7; }
int cublasGetVersion_v2(void *h, int *v) { (void)h; *v = 130100; return 0; }
int cublasGemmEx(void *h, int ta, int tb, int m, int n, int k, const void *alpha,
                 const void *A, int at, int lda, const void *B, int bt, int ldb, const void *beta,
                 void *C, int ct, int ldc, int compute, int algo) {
	unsigned long long v[19] = {(uintptr_t)h, ta, tb, m, n, k, (uintptr_t)alpha, (uintptr_t)A, at, lda,
	                            (uintptr_t)B, bt, ldb, (uintptr_t)beta, (uintptr_t)C, ct, ldc, compute, (unsigned)algo};
	memcpy(last_gemm, v, sizeof v);
	float al = *(const float *)alpha, be = *(const float *)beta;
	last_alpha = al; last_beta = be;
	if (compute != 68 || algo != -1) return 15;
	if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m) return 7;
	for (int j = 0; j < n; j++)
		for (int i = 0; i < m; i++) {
			float acc = 0;
			for (int p = 0; p < k; p++) {
				float a = load(A, at, ta ? (size_t)i * lda + p : (size_t)p * lda + i);
				float b = load(B, bt, tb ? (size_t)p * ldb + j : (size_t)j * ldb + p);
				acc += a * b;
			}
			float c = be != 0 ? be * load(C, ct, (size_t)j * ldc + i) : 0;
			store(C, ct, (size_t)j * ldc + i, al * acc + c);
		}
	return 0;
}

/* ---- NCCL: sends are queued in the process and received in order; while
 * busy, receives and non-blocking work stay pending ---- */
typedef struct { char internal[128]; } ncclUniqueId;
/* ncclConfig_t as of NCCL 2.14, with its tail padding */
typedef struct { size_t size; unsigned magic, version; int blocking, pad; } ncclConfig;
/* pending counts the ncclCommGetAsyncError polls a non-blocking comm still
 * reports ncclInProgress for (forever while busy). */
typedef struct { int nranks, rank, nonblocking, pending; } comm;
static unsigned long long last_config[4];
static comm *group_comm;
size_t mock_unique_id_size(void) { return sizeof(ncclUniqueId); }
void mock_last_config(unsigned long long out[4]) { memcpy(out, last_config, sizeof last_config); }
int ncclGetVersion(int *v) { *v = 22809; return 0; }
int ncclGetUniqueId(ncclUniqueId *id) { for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 7 + 3); return 0; }
/* The id arrives by value: its checksum (FNV-1a) shows whether every byte
 * landed where C expects it. */
int ncclCommInitRank(comm **c, int nranks, ncclUniqueId id, int rank) {
	uint64_t h = 1469598103934665603ull;
	for (int i = 0; i < 128; i++) { h ^= (unsigned char)id.internal[i]; h *= 1099511628211ull; }
	last_init[0] = (unsigned)nranks; last_init[1] = (unsigned)rank; last_init[2] = h; last_init[3] = 1;
	if (rank < 0 || rank >= nranks) return 4;
	*c = calloc(1, sizeof(comm)); (*c)->nranks = nranks; (*c)->rank = rank; return 0;
}
int ncclCommInitRankConfig(comm **c, int nranks, ncclUniqueId id, int rank, ncclConfig *cfg) {
	last_config[0] = cfg->size; last_config[1] = cfg->magic; last_config[2] = cfg->version; last_config[3] = (unsigned)cfg->blocking;
	if (cfg->size != sizeof(ncclConfig) || cfg->magic != 0xcafebeef || cfg->version != 21400) return 4;
	int r = ncclCommInitRank(c, nranks, id, rank);
	if (r || cfg->blocking) return r;
	(*c)->nonblocking = 1; (*c)->pending = 2; return 7;
}
static size_t type_size(int dt) { return dt <= 1 ? 1 : dt == 6 || dt == 9 ? 2 : dt == 4 || dt == 5 || dt == 8 ? 8 : 4; }
int ncclSend(const void *buf, size_t count, int dt, int peer, comm *c, void *s) {
	(void)s;
	size_t n = count * type_size(dt);
	if (peer < 0 || peer >= c->nranks || peer == c->rank || wire_len + n > sizeof wire) return 4;
	group_comm = c;
	memcpy(wire + wire_len, buf, n); wire_len += n; return 0;
}
int ncclRecv(void *buf, size_t count, int dt, int peer, comm *c, void *s) {
	(void)s;
	size_t n = count * type_size(dt);
	if (peer < 0 || peer >= c->nranks || peer == c->rank) return 4;
	group_comm = c;
	if (busy) return 0; /* pending: the stream never completes */
	if (n > wire_len) return 4;
	memcpy(buf, wire, n); memmove(wire, wire + n, wire_len - n); wire_len -= n; return 0;
}
static int group_depth;
int ncclGroupStart(void) { group_depth++; group_comm = NULL; return 0; }
int ncclGroupEnd(void) {
	if (group_depth-- <= 0) return 5;
	if (group_comm && group_comm->nonblocking) { group_comm->pending = 2; return 7; }
	return 0;
}
int ncclCommGetAsyncError(comm *c, int *r) {
	if (async_error) *r = async_error;
	else if (c->pending > 0) { *r = 7; if (!busy) c->pending--; }
	else *r = 0;
	return 0;
}
int ncclCommAbort(comm *c) { aborts++; free(c); return 0; }
int ncclCommDestroy(comm *c) { free(c); return 0; }
const char *ncclGetErrorString(int r) { return r == 4 ? "invalid argument (run with NCCL_DEBUG=WARN for details)" : r == 6 ? "remote process exited or there was a network error" : "mock nccl error"; }
const char *ncclGetLastError(comm *c) { (void)c; return "mock: last error"; }
