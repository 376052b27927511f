// Squared error of a factorization over a CSR block of ratings, for the per-iteration RMSE.
//
// One thread block per row u of the block: x_u is staged in shared memory once, then each
// warp takes ratings of the row in turn (warp w: ratings w, w + WARPS, ...), its 32 lanes
// reading the fixed factor's row theta_v coalesced and summing the dot product with
// shuffles; lane 0 accumulates (r_uv - x_u . theta_v)^2 in double. The block's sum is added
// to *out with one atomic. Reads: each rating's theta_v row once (the fixed factor is small
// enough to stay in L2 on the X side), each x_u once.

#define WARPS 4

extern "C" __global__ void __launch_bounds__(WARPS * 32)
squared_error_kernel(const long long* __restrict__ indptr, const int* __restrict__ indices,
                     const float* __restrict__ values, const float* __restrict__ X,
                     const float* __restrict__ fixed, const int f, double* __restrict__ out)
{
    extern __shared__ float x[];
    __shared__ double partial[WARPS];
    const long long row = blockIdx.x;
    for (int k = threadIdx.x; k < f; k += blockDim.x) x[k] = X[row * (long long)f + k];
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    double acc = 0.0;
    for (long long e = indptr[row] + warp; e < indptr[row + 1]; e += WARPS) {
        const float* theta = fixed + (long long)indices[e] * f;
        float dot = 0.f;
        for (int k = lane; k < f; k += 32) dot += x[k] * theta[k];
        for (int s = 16; s > 0; s >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, s);
        if (lane == 0) {
            const double d = (double)values[e] - (double)dot;
            acc += d * d;
        }
    }
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (int w = 0; w < WARPS; ++w) sum += partial[w];
        if (sum != 0.0) atomicAdd(out, sum);
    }
}
