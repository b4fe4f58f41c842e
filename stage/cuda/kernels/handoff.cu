// handoff_apply records hand-off rows on the first stage: rows holds n
// (slot, token) pairs, and slot_tokens[slot] = token for each. A row whose
// slot is outside [0, nslots), whose token is outside [0, vocab) or whose
// slot an earlier row names refuses the whole message: nothing is recorded
// and STATUS_BAD_ROW names the first such row.
// Grid: 1. Block: any multiple of 32.
extern "C" __global__ void handoff_apply(const int* rows, int n, int* slot_tokens, int nslots,
                                         int vocab, int* status) {
    __shared__ int bad;
    if (threadIdx.x == 0) {
        bad = n;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        int slot = rows[2 * i], tok = rows[2 * i + 1];
        bool refused = slot < 0 || slot >= nslots || tok < 0 || tok >= vocab;
        for (int j = 0; j < i && !refused; j++) {
            refused = rows[2 * j] == slot;
        }
        if (refused) {
            atomicMin(&bad, i);
        }
    }
    __syncthreads();
    if (bad < n) {
        if (threadIdx.x == 0 && atomicCAS(status, 0, STATUS_BAD_ROW) == 0) {
            status[1] = bad;
            status[2] = rows[2 * bad];
            status[3] = rows[2 * bad + 1];
        }
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        slot_tokens[rows[2 * i]] = rows[2 * i + 1];
    }
}
