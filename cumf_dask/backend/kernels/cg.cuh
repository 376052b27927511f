// CG solver for the MO-ALS kernels (mo_als.cu includes this file after chol_solve; the CuPy
// backend splices it in, so the compiled text and CuPy's kernel cache key include it).
//
// cg_solve: `steps` steps of conjugate gradient on the register tiles of the extended Gram
// (A in both triangles of the diagonal tiles, row f = B), warm-started from x0, with
// implicit's recurrence and absolute thresholds. A p is one pass over the tiles into per-(I, J)
// slots in shared memory, summed in a fixed order (deterministic, no atomics); dot products
// are warp shuffles and one barrier.

// Shared memory of cg_solve: slot (I, J) of `part` holds A_IJ p_J (8 floats); the vectors
// (length F, zero past f); warp sums for two alternating reductions.
template <int F, int NT>
struct __align__(16) CgSmem {
    float part[F / TILE][F / TILE][TILE];
    float b[F], x[F], r[F], p[F], q[F];
    float red[2][NT / 32];
};

// Sum of v over the block, returned to every thread (warp shuffles, one barrier). Calls
// alternate between the two halves of `red` so one barrier per call suffices.
template <int NT>
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) s += red[w];
    return s;
}

// part = the tiles' products with p (see CgSmem); ends with a barrier. Rows and columns >= f
// of a tile (B, padding) only meet p's zeros or land in slots nobody reads.
template <int F, int NT>
__device__ __forceinline__ void tile_matvec(const float (&acc)[TILE][TILE], int ib, int jb,
                                            bool active, CgSmem<F, NT>& sh) {
    if (active) {
        float pj[TILE], pi[TILE], out[TILE];
#pragma unroll
        for (int c = 0; c < TILE; ++c) {
            pj[c] = sh.p[jb * TILE + c];
            pi[c] = sh.p[ib * TILE + c];
        }
#pragma unroll
        for (int r = 0; r < TILE; ++r) {
            float v = 0.0f;
#pragma unroll
            for (int c = 0; c < TILE; ++c) v = fmaf(acc[r][c], pj[c], v);
            out[r] = v;
        }
#pragma unroll
        for (int r = 0; r < TILE; ++r) sh.part[ib][jb][r] = out[r];
        if (ib != jb) {
#pragma unroll
            for (int c = 0; c < TILE; ++c) {
                float v = 0.0f;
#pragma unroll
                for (int r = 0; r < TILE; ++r) v = fmaf(acc[r][c], pi[r], v);
                out[c] = v;
            }
#pragma unroll
            for (int c = 0; c < TILE; ++c) sh.part[jb][ib][c] = out[c];
        }
    }
    __syncthreads();
}

// (A p)_i from the slots of block row i / 8, in a fixed order.
template <int F, int NT>
__device__ __forceinline__ float row_sum(const CgSmem<F, NT>& sh, int i) {
    float v = 0.0f;
#pragma unroll
    for (int J = 0; J < F / TILE; ++J) v += sh.part[i / TILE][J][i % TILE];
    return v;
}

#define CG_SMALL 1e-20f  // implicit's absolute threshold on r.r

// `steps` CG steps on (A + reg I) x = B from the extended Gram held as register tiles (A in
// both triangles of the diagonal tiles, row f = B), from x0 (zeros when null), writing x to
// x_out: implicit's recurrence (skip the row when r.r < 1e-20 at the start, stop when it
// falls below; a NaN that arises gives 0). A system that is not finite (its starting r.r is
// NaN or inf) gives NaN, for the finite checks, as objective.batched_cg does. All threads of
// the block must call it.
template <int F, int NT>
__device__ __forceinline__ void cg_solve(float (&acc)[TILE][TILE], int ib, int jb, bool active,
                                         int f, float reg, const float* __restrict__ x0,
                                         int steps, CgSmem<F, NT>& sh,
                                         float* __restrict__ x_out) {
    const int i0 = ib * TILE, j0 = jb * TILE;
    if (active && ib == jb) {
#pragma unroll
        for (int r = 0; r < TILE; ++r)
            if (i0 + r < f) acc[r][r] += reg;
    }
    if (active && ib == f / TILE) {
#pragma unroll
        for (int r = 0; r < TILE; ++r)
            if (i0 + r == f) {
#pragma unroll
                for (int c = 0; c < TILE; ++c)
                    if (j0 + c < f) sh.b[j0 + c] = acc[r][c];
            }
    }
    for (int i = threadIdx.x; i < F; i += NT) {
        const float v = (x0 != nullptr && i < f) ? x0[i] : 0.0f;
        sh.x[i] = v;
        sh.p[i] = v;
    }
    __syncthreads();
    tile_matvec<F, NT>(acc, ib, jb, active, sh);  // A x0
    int buf = 0;
    float local = 0.0f;
    for (int i = threadIdx.x; i < f; i += NT) {
        const float r = sh.b[i] - row_sum<F, NT>(sh, i);
        sh.r[i] = r;
        sh.p[i] = r;
        local = fmaf(r, r, local);
    }
    float rsold = block_sum<NT>(local, sh.red[buf]);
    buf ^= 1;
    const bool broken = !isfinite(rsold);  // the same in every thread (a block sum)
    if (!broken && rsold >= CG_SMALL) {
        for (int it = 0; it < steps; ++it) {
            tile_matvec<F, NT>(acc, ib, jb, active, sh);  // q = A p
            local = 0.0f;
            for (int i = threadIdx.x; i < f; i += NT) {
                const float q = row_sum<F, NT>(sh, i);
                sh.q[i] = q;
                local = fmaf(sh.p[i], q, local);
            }
            const float a = rsold / block_sum<NT>(local, sh.red[buf]);
            buf ^= 1;
            local = 0.0f;
            for (int i = threadIdx.x; i < f; i += NT) {
                sh.x[i] = fmaf(a, sh.p[i], sh.x[i]);
                const float r = fmaf(-a, sh.q[i], sh.r[i]);
                sh.r[i] = r;
                local = fmaf(r, r, local);
            }
            const float rsnew = block_sum<NT>(local, sh.red[buf]);
            buf ^= 1;
            if (rsnew < CG_SMALL) break;
            const float beta = rsnew / rsold;
            for (int i = threadIdx.x; i < f; i += NT) sh.p[i] = fmaf(beta, sh.p[i], sh.r[i]);
            rsold = rsnew;
            __syncthreads();
        }
    }
    const bool bad = rsold != rsold;  // NaN
    const float qnan = __int_as_float(0x7fffffff);
    for (int i = threadIdx.x; i < f; i += NT) x_out[i] = broken ? qnan : bad ? 0.0f : sh.x[i];
}

// CG from A in memory (p > 1, after the reduction): block u loads system u (both triangles
// of the diagonal tiles mirrored from A's lower one, full or packed: lower_entry), adds G0
// and reg_u, and runs cg_solve from x0[u]. One system per block; zeros where counts[u] <= 0.
template <int F, int NT, int MINB>
__global__ void __launch_bounds__(NT, MINB)
    cg_solve_kernel(const float* __restrict__ A, int packed, const float* __restrict__ B, int f,
                    const long long* __restrict__ counts, float lam, int weighted,
                    const float* __restrict__ gram0, const float* __restrict__ x0, int steps,
                    float* __restrict__ X) {
    __shared__ CgSmem<F, NT> sh;
    const long long u = blockIdx.x;
    if (counts[u] <= 0) {  // the whole block leaves together, before any barrier
        for (int j = threadIdx.x; j < f; j += NT) X[u * f + j] = 0.0f;
        return;
    }
    const bool active = threadIdx.x < Cfg<F>::NTRI;
    int ib = 0, jb = 0;
    if (active) tile_of(threadIdx.x, Cfg<F>::NTILE, ib, jb);
    float acc[TILE][TILE];
#pragma unroll
    for (int r = 0; r < TILE; ++r) {
        const int i = ib * TILE + r;
#pragma unroll
        for (int c = 0; c < TILE; ++c) {
            const int j = jb * TILE + c;
            float v = 0.0f;
            if (active && i < f && j < f) {
                v = __ldg(lower_entry(A, packed, u, f, max(i, j), min(i, j)));
                if (gram0 != nullptr) v += __ldg(gram0 + (long long)i * f + j);
            } else if (active && i == f && j < f) {
                v = __ldg(B + u * f + j);
            }
            acc[r][c] = v;
        }
    }
    const float reg = weighted ? lam * (float)counts[u] : lam;
    cg_solve<F, NT>(acc, ib, jb, active, f, reg, x0 == nullptr ? nullptr : x0 + u * f, steps,
                    sh, X + u * f);
}
