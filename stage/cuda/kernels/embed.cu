// embed gathers rows of the embedding table: out[t] = table[tokens[t]].
// Grid: (tokens). Block: any multiple of 32.
extern "C" __global__ void embed(const int* tokens, const bf16* table, bf16* out, int hidden) {
    int t = blockIdx.x;
    const bf16* src = table + (size_t)tokens[t] * hidden;
    bf16* dst = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = src[i];
    }
}
