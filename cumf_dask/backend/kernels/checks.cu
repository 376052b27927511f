// One-pass checks of arrays on the GPU for cumf-dask's CuPy backend. Each sets flags with
// one atomicOr per thread block, so no reduction kernel is needed: CuPy's all() and any()
// on the GPU compile a CUB reduction (about 4 s per kernel with an empty kernel cache).
// Grid-stride loops: any grid size covers any n.

// A band of a rating store, cut to a block (cupy_backend.block_from_bands): entry i has row
// major[i] within the band, global column minor[i] and rating val[i].
//   flags[0] = 1: some entry is damaged (row outside [0, rows_here), column outside
//                 [0, n_minor), or a rating that is not finite);
//   flags[1] = 1: some entry lies outside the block (row outside [lo, hi), column outside
//                 [c0, c1)), so the band must be cut.
template <typename I>
__global__ void band_check_kernel(const int* __restrict__ major, const I* __restrict__ minor,
                                  const float* __restrict__ val, long long n, int rows_here,
                                  long long n_minor, int lo, int hi, long long c0, long long c1,
                                  int* __restrict__ flags) {
    int damaged = 0, outside = 0;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step) {
        const int r = major[i];
        const long long c = minor[i];
        damaged |= (r < 0) | (r >= rows_here) | (c < 0) | (c >= n_minor) | !isfinite(val[i]);
        outside |= (r < lo) | (r >= hi) | (c < c0) | (c >= c1);
    }
    damaged = __syncthreads_or(damaged);
    outside = __syncthreads_or(outside);
    if (threadIdx.x == 0) {
        if (damaged) atomicOr(flags, 1);
        if (outside) atomicOr(flags + 1, 1);
    }
}

// *flag = 1 if some of the n values of x is not finite (NaN or infinite).
template <typename T>
__global__ void nonfinite_kernel(const T* __restrict__ x, long long n, int* __restrict__ flag) {
    int bad = 0;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step)
        bad |= !isfinite(x[i]);
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}
