// embed gathers rows of the bf16 embedding table into the fp32 residual
// stream: out[t] = table[tokens[t]]. A negative token word -1 - s is a
// placeholder for the token last recorded for hand-off slot s, read from
// slot_tokens[s]; a slot with none (-1) records STATUS_NO_TOKEN and embeds
// token 0.
// Grid: (tokens). Block: any multiple of 32.
extern "C" __global__ void embed(const int* tokens, const int* slot_tokens, int* status,
                                 const bf16* table, float* out, int hidden, int vocab) {
    pdl_start();
    int t = blockIdx.x;
    int tok = tokens[t];
    if (tok < 0) {
        int slot = -1 - tok;
        tok = slot_tokens[slot];
        if (tok < 0 || tok >= vocab) {
            if (threadIdx.x == 0 && atomicCAS(status, 0, STATUS_NO_TOKEN) == 0) {
                status[1] = t;
                status[2] = slot;
            }
            tok = 0;
        }
    }
    const bf16* src = table + (size_t)tok * hidden;
    float* dst = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = bf2f(src[i]);
    }
}
