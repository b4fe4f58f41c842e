// embed gathers rows of the bf16 embedding table into the fp32 residual
// stream: out[t] = table[tokens[t]].
// Grid: (tokens). Block: any multiple of 32.
extern "C" __global__ void embed(const int* tokens, const bf16* table, float* out, int hidden) {
    int t = blockIdx.x;
    const bf16* src = table + (size_t)tokens[t] * hidden;
    float* dst = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = bf2f(src[i]);
    }
}
