// MO-ALS kernels (cuMF paper, section 3) for cumf-dask's CuPy backend.
//
// Loaded with cupy.RawModule and instantiated per padded size F (a multiple of 8) and
// thread count NT; the Python side picks F = round_up(f + 1, 8).
//
// One Gram build gives A and B. Each rating r_uv of row u extends its fixed-factor row to
//     g_v = [theta_v (f floats), r_uv, 0 ... 0]      (F floats)
// so sum_v g_v g_v^T holds A_u = sum theta_v theta_v^T in its leading f x f block and
// B_u = sum r_uv theta_v in its row f. The F x F lower triangle is cut into 8 x 8 tiles,
// one tile per thread, accumulated in 64 registers (fully unrolled loops: no dynamically
// indexed register arrays). The g_v rows are staged in shared memory in bins of BIN rows
// (cuMF's "bin"), filled by cp.async one bin ahead of the arithmetic (three float32 bins in
// rotation, so one barrier per bin), 16-byte copies when f % 4 == 0. In a bin
// row each 8-float tile chunk takes 12 floats (48 bytes): the 16-byte reads of a warp's
// threads, which start at different chunks, then fall in different banks. The Gram kernels
// take the fixed factor as float32 or bfloat16 (template T, see Bins): bfloat16 rows are
// gathered at half the bytes and widened to float32 in shared memory, so every product and
// sum stays float32.
//
// Weighted rows (implicit feedback, cumf_dask/backend/objective.py): with a per-rating
// scale s (`scale`, null for explicit ratings) the extended row is g_v = [s_v theta_v,
// t_v, 0 ...], t_v the stored value, so the same Gram gives A = sum s^2 theta theta^T and
// B = sum s t theta. Each thread scales the pieces of a bin it copied itself, after its own
// cp.async wait and before the barrier that publishes the bin (Bins::ready): the inner loop
// is unchanged and explicit ratings skip the pass. A row's system may add a dense G0
// (`gram0`, the implicit model's Y^T Y, null otherwise) to its tiles before the solve, and
// reg = lam * counts[u] (weighted) or lam.
//
// The Cholesky factor of the extended matrix [[A + reg I, B], [B^T, *]] carries
// y = L^-1 B in its row f, so the tiled factorization also does the forward solve; a
// tiled backward solve L^T x = y finishes. Indices >= f get a unit pivot, so the padding
// never produces a NaN.
//
// CG (cg_solve): cg_steps steps of conjugate gradient on the same register tiles from a
// warm start x0 (implicit's recurrence and its absolute 1e-20 thresholds). A p is one pass
// of the tiles (each off-diagonal tile gives T p_J to block row I and T^T p_I to block row
// J) into per-(I, J) slots in shared memory, summed in a fixed order (deterministic); dot
// products are warp shuffles plus one barrier. About 5 barriers a step, against the
// Cholesky's 5 per tile column.
//
// Small f (row_update_kernel, f <= 16): the tiles above would leave most of a warp idle (f = 10
// is 3 tiles for 32 threads), so one thread owns one row: the packed lower triangle of A and
// B in registers (f = 10: 65 floats), its ratings read U at a time so that U fixed-factor
// rows are in flight, then a Cholesky in registers. The size FE = f is a template argument,
// so every index is a constant and nothing spills to local memory.
//
// Short rows (dual_update_kernel): a row with n < f ratings solves the n x n system of the
// push-through identity, x = G^T (G G^T + reg I)^-1 r, on the same tiles and Cholesky.
//
// Kernels: hermitian_kernel (A, B of row segments, summed with atomics when a long row is
// split; with sum_into, A's lower triangle packed by rows and added to what A, B hold: a
// partial Hermitian summed in place, no f x f A), update_kernel (fused Gram -> Cholesky or
// CG -> x_u per row, A stays on chip), row_update_kernel (the same, one thread per row,
// small f), dual_update_kernel (short rows by the push-through identity), solve_kernel (the
// Cholesky from A in memory, several small systems per block), cg_solve_kernel (CG from A in
// memory, one system per block). MINB, the minimum resident blocks per SM given to
// __launch_bounds__, caps their registers.

#define TILE 8
#define CHUNK 12  // floats per tile chunk in a bin row: 8 used, 4 against bank conflicts

typedef unsigned short bf16;  // bfloat16 bits: the high half of a float32

template <int F>
struct Cfg {
    static constexpr int NTILE = F / TILE;                // tiles per side
    static constexpr int NTRI = NTILE * (NTILE + 1) / 2;  // tiles in the lower triangle
    static constexpr int ROW = NTILE * CHUNK;             // floats per bin row
    static constexpr int BIN0 = 3840 / ROW;               // about 30 KB for two bins
    static constexpr int BIN = BIN0 > 32 ? 32 : (BIN0 < 2 ? 2 : BIN0);  // rows per bin (bf16)
    static constexpr int BIN3 = 3072 / ROW < 1 ? 1 : 3072 / ROW;  // float32: 36 KB for three
    static constexpr int QUADS = F / 4;                   // 16-byte pieces of a row
    static constexpr int SYS = NTRI < 32 ? 32 / NTRI : 1; // systems per solve_kernel block
};

// Position of factor column `col` in a bin row.
__device__ __forceinline__ int bin_col(int col) { return (col >> 3) * CHUNK + (col & 7); }

// Shared memory of the tiled Cholesky: the current tile column, its diagonal tile, and
// the right-hand side.
// panel[ib] holds L(8 ib + r, 8 kb + c) at [8 c + r]; its 4-float pad puts the tiles of
// different ib in different banks for the 16-byte reads of the trailing update.
template <int F>
struct __align__(16) CholSmem {
    float panel[F / TILE][TILE * TILE + 4];  // tile column kb of L, transposed tiles
    float diag[TILE][TILE];                  // L_kk
    float dinv[F];                           // 1 / L(i, i)
    float y[F];                              // forward result, consumed by the backward solve
    float x[TILE];                           // the current tile's solution, backward solve
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Asynchronous global -> shared copies; dst is a shared-memory address (smem_u32).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async4(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

__device__ __forceinline__ void cp_async_wait_prior1() {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// The t-th of the ntile (ntile + 1) / 2 lower-triangle tiles, numbered by tile column from
// the right (column ntile - 1 first), top down inside a column. The tiles still active late
// in the Cholesky (the right columns) are then the first threads: packed into few warps.
__device__ __forceinline__ void tile_of(int t, int ntile, int& ib, int& jb) {
    int i = (int)((sqrtf(8.0f * t + 1.0f) - 1.0f) * 0.5f);
    if ((i + 1) * (i + 2) / 2 <= t) ++i;
    if (i * (i + 1) / 2 > t) --i;
    jb = ntile - 1 - i;
    ib = jb + t - i * (i + 1) / 2;
}

// Where entry (i, j), j <= i, of system u is in A: full f x f matrices, or (packed) their
// lower triangles row by row, f (f + 1) / 2 floats per system (the reductions' layout).
__device__ __forceinline__ const float* lower_entry(const float* A, int packed, long long u,
                                                    int f, int i, int j) {
    return packed ? A + u * (f * (f + 1) / 2) + i * (i + 1) / 2 + j
                  : A + u * f * f + (long long)i * f + j;
}

// v[it] = the fixed-factor row that copy piece threadIdx.x + it * NT of a bin reads (PER
// pieces per bin row, ratings [e0, e0 + nk)): all loaded before the first copy is issued.
template <int ITERS, int NT, int PER>
__device__ __forceinline__ void load_indices(int (&v)[ITERS], const int* __restrict__ idx,
                                             long long e0, int nk) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int k = (threadIdx.x + it * NT) / PER;
        v[it] = k < nk ? __ldg(idx + e0 + k) : 0;
    }
}

// Bins of extended rows g_v for gram(), by the element type T of the fixed factor:
//   BIN, NBUF               rows per bin, buffers (bins staged round robin);
//   END_BARRIER             whether gram() needs a barrier after computing each bin before
//                           the next ready() (false when NBUF >= 3 float bins rotate);
//   init()                  once per block, before the first stage;
//   stage(buf, e0, nk)      issue the cp.async copies of ratings [e0, e0 + nk) into buffer buf;
//   ready(buf, e0, nk)      after this thread's copies of buf completed: the float bin of
//                           those ratings (BIN rows of ROW floats, each fixed-factor row
//                           scaled by its rating's s when `scale` is given), valid after a
//                           barrier.
template <int F, int NT, typename T, bool SCALED>
struct Bins;

// float32 rows: three float bins filled directly by cp.async: bin b + 1 is staged into the
// buffer read for bin b - 2, which every thread finished before the barrier of bin b - 1, so
// one barrier per bin suffices. With vec, warp w copies the bin rows k = w, w + W, ... (W
// warps), one row per pass, lane l the 16-byte pieces l, l + 32, ... of the factor row. The
// warp reads its rows' indices once per bin (lane i the index of pass i) and passes them by
// shuffles, so a pass is a shuffle, an address and a copy: no division, no index load per
// piece (benchmarks/gpu_notes.md v11). The padding after the rating column is zeroed once
// (init) and never copied into.
template <int F, int NT, bool SCALED>
struct Bins<F, NT, float, SCALED> {
    static constexpr int BIN = Cfg<F>::BIN3, ROW = Cfg<F>::ROW, QUADS = Cfg<F>::QUADS;
    static constexpr int NBUF = 3;
    static constexpr bool END_BARRIER = false;
    static constexpr int W = NT / 32;                      // warps
    static constexpr int PASSES = (BIN + W - 1) / W;       // bin rows per warp (vec)
    static constexpr int SWEEPS = (QUADS + 31) / 32;       // 32-piece sweeps of a row (vec)
    static constexpr int BYTES = NBUF * BIN * ROW * 4;
    float* bins;
    const int* __restrict__ idx;
    const float* __restrict__ val;
    const float* __restrict__ scale;
    const float* __restrict__ fixed;
    int f;
    bool vec;

    __device__ __forceinline__ void init() {
        const int npad = F - f - 1;  // columns after the rating column
        for (int c = threadIdx.x; c < NBUF * BIN * npad; c += NT)
            bins[(c / npad) * ROW + bin_col(f + 1 + c % npad)] = 0.0f;
    }

    __device__ __forceinline__ void stage(int buf, long long e0, int nk) {
        constexpr int ROWB = ROW * 4;
        const unsigned dst = smem_u32(bins) + buf * BIN * ROWB;
        if (vec) {
            const int w = threadIdx.x / 32, lane = threadIdx.x % 32, pieces = f / 4;
            int mine = 0;  // the index of pass (it / 32) * 32 + lane
#pragma unroll
            for (int it = 0; it < PASSES; ++it) {
                if (it % 32 == 0) {
                    const int k = w + W * (it + lane);
                    mine = it + lane < PASSES && k < nk ? __ldg(idx + e0 + k) : 0;
                }
                const int k = w + W * it;
                const int v = __shfl_sync(0xFFFFFFFFu, mine, it % 32);
                if (k >= nk) continue;  // the same for the whole warp
#pragma unroll
                for (int s = 0; s < SWEEPS; ++s) {
                    const int p = lane + 32 * s;
                    if (p < pieces)
                        cp_async16(dst + k * ROWB + 4 * bin_col(4 * p), fixed + (long long)v * f + 4 * p);
                }
            }
        } else {
            for (int c = threadIdx.x; c < nk * F; c += NT) {
                const int k = c / F, col = c - k * F;
                if (col < f)
                    cp_async4(dst + k * ROWB + 4 * bin_col(col),
                              fixed + (long long)__ldg(idx + e0 + k) * f + col);
            }
        }
#pragma unroll
        for (int it = 0; it < (BIN + NT - 1) / NT; ++it) {  // the ratings
            const int k = threadIdx.x + it * NT;
            if (k < nk) cp_async4(dst + k * ROWB + 4 * bin_col(f), val + e0 + k);
        }
    }

    // After this thread's copies of buf landed: scale the pieces it copied (the same
    // pattern as stage) by their rating's s.
    __device__ __forceinline__ const float* ready(int buf, long long e0, int nk) const {
        float* bin = bins + buf * BIN * ROW;
        if constexpr (SCALED) {
            if (vec) {
                const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
                for (int it = 0; it < PASSES; ++it) {
                    const int k = w + W * it;
                    if (k >= nk) break;
                    const float sv = __ldg(scale + e0 + k);
#pragma unroll
                    for (int s = 0; s < SWEEPS; ++s) {
                        const int p = lane + 32 * s;
                        if (4 * p >= f) break;
                        float4* q = reinterpret_cast<float4*>(bin + k * ROW + bin_col(4 * p));
                        float4 v = *q;
                        v.x *= sv;
                        v.y *= sv;
                        v.z *= sv;
                        v.w *= sv;
                        *q = v;
                    }
                }
            } else {
                for (int c = threadIdx.x; c < nk * F; c += NT) {
                    const int k = c / F, col = c - k * F;
                    if (col < f) bin[k * ROW + bin_col(col)] *= __ldg(scale + e0 + k);
                }
            }
        }
        return bin;
    }
};

// bfloat16 rows (bits in unsigned short; row stride round_up(f, 8), so every row starts on
// 16 bytes; the columns past f are ignored): each 16-byte piece is 8 columns, one tile
// chunk. Two staging buffers of bf16 rows and their float ratings, filled by cp.async, and
// one float bin. A thread converts exactly the pieces it copied (and the ratings that fall
// in them), so its own cp.async wait suffices before ready(); the barrier after ready()
// publishes the float bin, and the barrier ending each gram() step protects it.
template <int F, int NT, bool SCALED>
struct Bins<F, NT, bf16, SCALED> {
    static constexpr int BIN = Cfg<F>::BIN, ROW = Cfg<F>::ROW, PIECES = F / TILE;
    static constexpr int NBUF = 2;
    static constexpr bool END_BARRIER = true;  // one float bin, rewritten by every ready()
    static constexpr int ITERS = (BIN * PIECES + NT - 1) / NT;
    static constexpr int STAGE = (BIN * F * 2 + BIN * 4 + 15) / 16 * 16;  // bf16 rows, ratings
    static constexpr int BYTES = BIN * ROW * 4 + 2 * STAGE;
    float* bin;  // followed by the two staging buffers
    const int* __restrict__ idx;
    const float* __restrict__ val;
    const float* __restrict__ scale;
    const bf16* __restrict__ fixed;
    int f;
    bool vec;  // unused: bf16 rows are always copied in 16-byte pieces

    __device__ __forceinline__ void init() {}

    __device__ __forceinline__ unsigned char* staging(int buf) const {
        return reinterpret_cast<unsigned char*>(bin + BIN * ROW) + buf * STAGE;
    }

    __device__ __forceinline__ void stage(int buf, long long e0, int nk) {
        const int ld = (f + TILE - 1) / TILE * TILE;  // row stride of the fixed factor
        const unsigned dst = smem_u32(staging(buf));
        int v[ITERS];
        load_indices<ITERS, NT, PIECES>(v, idx, e0, nk);
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const int c = threadIdx.x + it * NT;
            const int k = c / PIECES, col = TILE * (c - k * PIECES);
            if (k >= nk) continue;
            if (col < f) cp_async16(dst + 2 * (k * F + col), fixed + (long long)v[it] * ld + col);
            if (col <= f && f < col + TILE) cp_async4(dst + 2 * BIN * F + 4 * k, val + e0 + k);
        }
    }

    __device__ __forceinline__ const float* ready(int buf, long long e0, int nk) {
        const unsigned char* src = staging(buf);
        const float* rating = reinterpret_cast<const float*>(src + 2 * BIN * F);
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const int c = threadIdx.x + it * NT;
            const int k = c / PIECES, col = TILE * (c - k * PIECES);
            if (k >= nk) continue;
            uint4 w = make_uint4(0, 0, 0, 0);
            if (col < f) w = *reinterpret_cast<const uint4*>(src + 2 * (k * F + col));
            const unsigned h[4] = {w.x, w.y, w.z, w.w};
            const float sv = SCALED ? __ldg(scale + e0 + k) : 1.0f;
            float g[TILE];
#pragma unroll
            for (int j = 0; j < TILE; ++j) {
                const float x = __uint_as_float(j & 1 ? h[j / 2] & 0xFFFF0000u : h[j / 2] << 16);
                g[j] = col + j < f ? x * sv : (col + j == f ? rating[k] : 0.0f);
            }
            float4* out = reinterpret_cast<float4*>(bin + k * ROW + col / TILE * CHUNK);
            out[0] = make_float4(g[0], g[1], g[2], g[3]);
            out[1] = make_float4(g[4], g[5], g[6], g[7]);
        }
        return bin;
    }
};

// acc += a b^T, a and b the 8 floats at sa and sb (16-byte aligned shared memory).
__device__ __forceinline__ void add_outer(float (&acc)[TILE][TILE], const float* sa,
                                          const float* sb) {
    const float4 a0 = *reinterpret_cast<const float4*>(sa);
    const float4 a1 = *reinterpret_cast<const float4*>(sa + 4);
    const float4 b0 = *reinterpret_cast<const float4*>(sb);
    const float4 b1 = *reinterpret_cast<const float4*>(sb + 4);
    const float a[TILE] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    const float bb[TILE] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
    for (int r = 0; r < TILE; ++r)
#pragma unroll
        for (int c = 0; c < TILE; ++c) acc[r][c] = fmaf(a[r], bb[c], acc[r][c]);
}

// hermitian_kernel's ratings loop: unrolled 4 times for float32 rows from F = 72 (about 1.5%
// faster on long rows, benchmarks/gpu_notes.md v11, in registers it has to spare), else 2
// (smaller F and bfloat16 rows would spill).
template <int F, typename T>
constexpr int HERMITIAN_UNROLL = sizeof(T) == 4 && F >= 72 ? 4 : 2;

// acc = this thread's tile (8 ib, 8 jb) of sum g_v g_v^T over ratings [lo, hi) of one row
// (plus G0's tile when SCALED and gram0 is given).
// `smem` holds Bins<F, NT, T, SCALED>::BYTES; SCALED: rows scaled by `scale` (implicit).
// Ends with a barrier, so the caller may reuse it at once.
// The copies of bin b + 1 are in flight while bin b is computed. UNROLL: of the ratings loop
// (HERMITIAN_UNROLL for hermitian_kernel, 2 for the update, whose Cholesky needs the registers).
template <int F, int NT, typename T, bool SCALED, int UNROLL = 2>
__device__ __forceinline__ void gram(float (&acc)[TILE][TILE], void* smem,
                                     const int* __restrict__ idx, const float* __restrict__ val,
                                     const float* __restrict__ scale,
                                     const T* __restrict__ fixed, int f, bool vec,
                                     long long lo, long long hi, int i0, int j0, bool active,
                                     const float* __restrict__ gram0 = nullptr) {
    using Bin = Bins<F, NT, T, SCALED>;
    constexpr int BIN = Bin::BIN, NBUF = Bin::NBUF, ROW = Cfg<F>::ROW;
    // The sum starts from G0's tile (the implicit model's Y^T Y; where i, j < f, both
    // triangles of a diagonal tile, so it stays symmetric for the CG), else from zero:
    // loaded before the loop, it costs no register the loop needs.
#pragma unroll
    for (int r = 0; r < TILE; ++r)
#pragma unroll
        for (int c = 0; c < TILE; ++c) {
            const int i = i0 + r, j = j0 + c;
            acc[r][c] = (SCALED && gram0 != nullptr && active && i < f && j < f)
                            ? __ldg(gram0 + (long long)i * f + j)
                            : 0.0f;
        }
    Bin bins{static_cast<float*>(smem), idx, val, scale, fixed, f, vec};
    bins.init();

    const int n = (int)(hi - lo);
    const int nbins = (n + BIN - 1) / BIN;
    bins.stage(0, lo, min(BIN, n));
    cp_async_commit();
    for (int b = 0, buf = 0; b < nbins; ++b) {
        const int next = (b + 1) * BIN, nbuf = buf + 1 == NBUF ? 0 : buf + 1;
        if (next < n) bins.stage(nbuf, lo + next, min(BIN, n - next));
        cp_async_commit();
        cp_async_wait_prior1();
        const int nk = min(BIN, n - b * BIN);
        const float* bin = bins.ready(buf, lo + b * BIN, nk);
        buf = nbuf;
        __syncthreads();
        if (active) {
            const float* sa = bin + (i0 / TILE) * CHUNK;
            const float* sb = bin + (j0 / TILE) * CHUNK;
#pragma unroll UNROLL
            for (int k = 0; k < nk; ++k) add_outer(acc, sa + k * ROW, sb + k * ROW);
        }
        if (Bin::END_BARRIER) __syncthreads();
    }
    if (!Bin::END_BARRIER) __syncthreads();
}

// Solve (A + reg I) x = B from the extended Gram held as register tiles (lower triangle,
// row f = B), writing x[0..f) to x_out. All threads of the block must call it.
template <int F>
__device__ __forceinline__ void chol_solve(float (&acc)[TILE][TILE], int ib, int jb, bool active,
                                           int f, float reg, CholSmem<F>& sh,
                                           float* __restrict__ x_out) {
    const int kbs = (f + TILE - 1) / TILE;  // tile columns of the f x f system
    const int i0 = ib * TILE, j0 = jb * TILE;
    if (active && ib == jb) {
#pragma unroll
        for (int r = 0; r < TILE; ++r)
            if (i0 + r < f) acc[r][r] += reg;
    }
    // Right-looking tiled Cholesky; row f of the factor becomes y = L^-1 B.
    for (int kb = 0; kb < kbs; ++kb) {
        if (active && ib == kb && jb == kb) {
#pragma unroll
            for (int c = 0; c < TILE; ++c) {
                const bool real = i0 + c < f;  // indices >= f get a unit pivot
                const float il = real ? rsqrtf(acc[c][c]) : 1.0f;
                acc[c][c] = real ? acc[c][c] * il : 1.0f;
                sh.dinv[i0 + c] = il;
#pragma unroll
                for (int r = c + 1; r < TILE; ++r) acc[r][c] *= il;
#pragma unroll
                for (int r = c + 1; r < TILE; ++r)
#pragma unroll
                    for (int s = c + 1; s <= r; ++s) acc[r][s] = fmaf(-acc[r][c], acc[s][c], acc[r][s]);
            }
#pragma unroll
            for (int r = 0; r < TILE; ++r)
#pragma unroll
                for (int c = 0; c < TILE; ++c) sh.diag[r][c] = acc[r][c];
        }
        __syncthreads();
        if (active && jb == kb && ib > kb) {  // panel: tile <- tile L_kk^-T
#pragma unroll
            for (int c = 0; c < TILE; ++c) {
                const float il = sh.dinv[kb * TILE + c];
#pragma unroll
                for (int r = 0; r < TILE; ++r) {
                    float s = acc[r][c];
#pragma unroll
                    for (int q = 0; q < c; ++q) s = fmaf(-acc[r][q], sh.diag[c][q], s);
                    acc[r][c] = s * il;
                }
            }
#pragma unroll
            for (int r = 0; r < TILE; ++r)
#pragma unroll
                for (int c = 0; c < TILE; ++c) sh.panel[ib][c * TILE + r] = acc[r][c];
        }
        __syncthreads();
        if (active && jb > kb && jb < kbs) {  // trailing update: tile -= P_ib P_jb^T
#pragma unroll
            for (int q = 0; q < TILE; ++q) {
                const float4 a0 = *reinterpret_cast<const float4*>(&sh.panel[ib][q * TILE]);
                const float4 a1 = *reinterpret_cast<const float4*>(&sh.panel[ib][q * TILE + 4]);
                const float4 b0 = *reinterpret_cast<const float4*>(&sh.panel[jb][q * TILE]);
                const float4 b1 = *reinterpret_cast<const float4*>(&sh.panel[jb][q * TILE + 4]);
                const float a[TILE] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                const float bb[TILE] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                for (int r = 0; r < TILE; ++r)
#pragma unroll
                    for (int c = 0; c < TILE; ++c) acc[r][c] = fmaf(-a[r], bb[c], acc[r][c]);
            }
        }
    }
    // y = row f of the factor.
    if (active && ib == f / TILE && jb < kbs) {
#pragma unroll
        for (int r = 0; r < TILE; ++r)
            if (i0 + r == f) {
#pragma unroll
                for (int c = 0; c < TILE; ++c)
                    if (j0 + c < f) sh.y[j0 + c] = acc[r][c];
            }
    }
    __syncthreads();
    // Backward solve L^T x = y, one tile row at a time, bottom up.
    for (int kb = kbs - 1; kb >= 0; --kb) {
        if (active && ib == kb && jb == kb) {
            float xv[TILE];
#pragma unroll
            for (int r = TILE - 1; r >= 0; --r) {
                float s = (i0 + r < f) ? sh.y[i0 + r] : 0.0f;
#pragma unroll
                for (int q = r + 1; q < TILE; ++q) s = fmaf(-acc[q][r], xv[q], s);
                xv[r] = (i0 + r < f) ? s * sh.dinv[i0 + r] : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < TILE; ++r) {
                sh.x[r] = xv[r];
                if (i0 + r < f) x_out[i0 + r] = xv[r];
            }
        }
        __syncthreads();
        if (active && ib == kb && jb < kb) {  // y_jb -= L_kb,jb^T x_kb
#pragma unroll
            for (int c = 0; c < TILE; ++c) {
                float s = sh.y[j0 + c];
#pragma unroll
                for (int r = 0; r < TILE; ++r) s = fmaf(-acc[r][c], sh.x[r], s);
                sh.y[j0 + c] = s;
            }
        }
        __syncthreads();
    }
}

#include "cg.cuh"  // the CG solver (cupy_backend splices the file in here)

// *dst = v, or += v (sum_into), or added atomically (a row split over several blocks).
__device__ __forceinline__ void gram_put(float* dst, float v, bool atomic, bool sum_into) {
    if (atomic) atomicAdd(dst, v);
    else if (sum_into) *dst += v;
    else *dst = v;
}

// Partial Gram of row segments: block (s, g) adds tiles [g NT, g NT + NT) of segment s
// (ratings [seg_lo[s], seg_hi[s]) of output row seg_out[s]) into A (rows, f, f, lower
// triangle) and B (rows, f), rows scaled by `scale` when SCALED. With `atomic`, rows split over several segments sum up in
// place (A, B zeroed by the caller); without, each row has one segment and is stored.
// With `sum_into`, A holds packed lower triangles (rows, f(f+1)/2) and every value is added
// to what is there. Segments with taken[s] != 0 (taken: null, or what tc_hermitian_kernel
// recorded) are skipped.
// MINB: minimum resident blocks per SM asked of the compiler (as for update_kernel).
template <int F, int NT, int MINB, typename T, bool SCALED>
__global__ void __launch_bounds__(NT, MINB)
    hermitian_kernel(const int* __restrict__ idx, const float* __restrict__ val,
                     const float* __restrict__ scale, const T* __restrict__ fixed, int f, int vec,
                     const int* __restrict__ taken, const int* __restrict__ seg_out,
                     const long long* __restrict__ seg_lo, const long long* __restrict__ seg_hi,
                     int atomic, float* __restrict__ A, float* __restrict__ B, int sum_into) {
    __shared__ __align__(16) unsigned char bins[Bins<F, NT, T, SCALED>::BYTES];
    const int s = blockIdx.x;
    if (taken != nullptr && taken[s]) return;  // done on the tensor cores (tensor_gram.cuh)
    const int t = blockIdx.y * NT + threadIdx.x;
    const bool active = t < Cfg<F>::NTRI;
    int ib = 0, jb = 0;
    if (active) tile_of(t, Cfg<F>::NTILE, ib, jb);
    float acc[TILE][TILE];
    gram<F, NT, T, SCALED, HERMITIAN_UNROLL<F, T>>(acc, bins, idx, val, scale, fixed, f, vec != 0,
                                                   seg_lo[s], seg_hi[s], ib * TILE, jb * TILE,
                                                   active);
    if (!active) return;
    const long long u = seg_out[s];
    float* Au = A + u * (sum_into ? f * (f + 1) / 2 : f * f);
    float* Bu = B + u * f;
    // Whole 8-float rows of off-diagonal tiles go out as two 16-byte stores.
    const bool wide = !atomic && !sum_into && vec && jb < ib && (jb + 1) * TILE <= f;
#pragma unroll
    for (int r = 0; r < TILE; ++r) {
        const int i = ib * TILE + r;
        if (wide && i < f) {
            float4* dst = reinterpret_cast<float4*>(Au + i * f + jb * TILE);
            dst[0] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
            dst[1] = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
            continue;
        }
#pragma unroll
        for (int c = 0; c < TILE; ++c) {
            const int j = jb * TILE + c;
            float* dst = nullptr;
            if (i < f && j <= i) dst = Au + (sum_into ? i * (i + 1) / 2 + j : i * f + j);
            else if (i == f && j < f) dst = Bu + j;
            if (dst != nullptr) gram_put(dst, acc[r][c], atomic, sum_into);
        }
    }
}

#include "tensor_gram.cuh"  // the Gram on the tensor cores (spliced in, as cg.cuh)

// Fused update of whole rows (p == 1): Gram in registers (IMPLICIT: rows scaled by `scale`,
// then + G0) -> Cholesky or CG -> x_u. A never leaves the chip. Block b solves row u = rows[b] (counts[u] > 0), adding
// reg = lam * counts[u] (weighted) or lam to the diagonal; CG starts from x0[u] (zeros when
// x0 is null). MINB is the minimum of resident blocks per SM asked of the compiler: it caps
// the registers.
template <int F, int NT, int MINB, typename T, bool IMPLICIT, bool CG>
__global__ void __launch_bounds__(NT, MINB)
    update_kernel(const long long* __restrict__ indptr, const int* __restrict__ idx,
                  const float* __restrict__ val, const float* __restrict__ scale,
                  const T* __restrict__ fixed, int f, int vec,
                  const long long* __restrict__ counts, float lam, int weighted,
                  const float* __restrict__ gram0, const float* __restrict__ x0, int steps,
                  const int* __restrict__ rows, float* __restrict__ X) {
    constexpr int BIN_BYTES = Bins<F, NT, T, IMPLICIT>::BYTES;
    constexpr int SOLVE_BYTES = CG ? (int)sizeof(CgSmem<F, NT>) : (int)sizeof(CholSmem<F>);
    constexpr int BYTES = BIN_BYTES > SOLVE_BYTES ? BIN_BYTES : SOLVE_BYTES;
    __shared__ __align__(16) unsigned char smem[BYTES];
    const int u = rows[blockIdx.x];
    const bool active = threadIdx.x < Cfg<F>::NTRI;
    int ib = 0, jb = 0;
    if (active) tile_of(threadIdx.x, Cfg<F>::NTILE, ib, jb);
    float acc[TILE][TILE];
    gram<F, NT, T, IMPLICIT>(acc, smem, idx, val, scale, fixed, f, vec != 0, indptr[u],
                             indptr[u + 1], ib * TILE, jb * TILE, active, gram0);
    const float reg = weighted ? lam * (float)counts[u] : lam;
    if constexpr (CG) {
        cg_solve<F, NT>(acc, ib, jb, active, f, reg, x0 == nullptr ? nullptr : x0 + (long long)u * f,
                        steps, *reinterpret_cast<CgSmem<F, NT>*>(smem), X + (long long)u * f);
    } else {
        chol_solve<F>(acc, ib, jb, active, f, reg, *reinterpret_cast<CholSmem<F>*>(smem),
                      X + (long long)u * f);
    }
}

// Batched solve of X[u] = (G0 + A[u] + reg_u I)^-1 B[u] for u < n (reg_u = lam counts[u]
// when weighted, else lam; G0 when not null), reading A's lower triangle (full or packed:
// lower_entry); zeros where counts[u] <= 0. A block solves SYS systems (several when the
// tiles of one fill less than a warp), thread group s = threadIdx.x / NTRI solving one.
template <int F, int NT, int MINB>
__global__ void __launch_bounds__(NT, MINB)
    solve_kernel(const float* __restrict__ A, int packed, const float* __restrict__ B, int f,
                 long long n, const long long* __restrict__ counts, float lam, int weighted,
                 const float* __restrict__ gram0, float* __restrict__ X) {
    constexpr int NTRI = Cfg<F>::NTRI, SYS = Cfg<F>::SYS;
    __shared__ CholSmem<F> sh[SYS];
    const int s = threadIdx.x / NTRI, t = threadIdx.x - s * NTRI;
    const long long u = (long long)blockIdx.x * SYS + s;
    const bool mine = s < SYS && u < n;  // this thread's group has a system
    const bool solve = mine && counts[u] > 0;
    if (mine && !solve)
        for (int j = t; j < f; j += NTRI) X[u * f + j] = 0.0f;
    int ib = 0, jb = 0;
    if (solve) tile_of(t, Cfg<F>::NTILE, ib, jb);
    const float* Bu = B + u * f;
    float acc[TILE][TILE];
#pragma unroll
    for (int r = 0; r < TILE; ++r) {
        const int i = ib * TILE + r;
#pragma unroll
        for (int c = 0; c < TILE; ++c) {
            const int j = jb * TILE + c;
            float v = 0.0f;
            if (solve && i < f && j <= i) {
                v = __ldg(lower_entry(A, packed, u, f, i, j));
                if (gram0 != nullptr) v += __ldg(gram0 + i * f + j);
            } else if (solve && i == f && j < f) {
                v = __ldg(Bu + j);
            }
            acc[r][c] = v;
        }
    }
    const float reg = solve ? (weighted ? lam * (float)counts[u] : lam) : 0.0f;
    chol_solve<F>(acc, ib, jb, solve, f, reg, sh[s < SYS ? s : 0], X + (solve ? u : 0) * f);
}

// ------------------------------------------------------- short rows: the push-through identity

__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Rows with n < FD ratings by the push-through identity: with G the n x f fixed rows of the
// row's ratings and r its ratings, x = (G^T G + reg I)^-1 G^T r = G^T (G G^T + reg I)^-1 r,
// an n x n system in place of f x f (the Cholesky is most of a short row's cost). Block b
// solves row u = rows[b] (counts[u] > 0), reg = lam * counts[u] (weighted) or lam. G^T goes
// to shared memory (f rows of S = FD + 4 floats: 16-byte rows; zero past n) by 4-byte
// cp.async copies, all in flight at once (the rows' indices are read first, a few per
// lane); the register tiles take the extended matrix of the Gram kernels,
// [[G G^T, .], [r^T, .]] (FD = round_up(n + 1, 8) covers it), so chol_solve gives
// y = (G G^T + reg I)^-1 r, and x = G^T y. float32 factors only. Dynamic shared memory: f * S floats, then CholSmem<FD>, then FD floats.
template <int FD, int NT, int MINB>
__global__ void __launch_bounds__(NT, MINB)
    dual_update_kernel(const long long* __restrict__ indptr, const int* __restrict__ idx,
                       const float* __restrict__ val, const float* __restrict__ fixed, int f,
                       const long long* __restrict__ counts, float lam, int weighted,
                       const int* __restrict__ rows, float* __restrict__ X) {
    constexpr int S = FD + 4, PER = (FD + 31) / 32;
    extern __shared__ __align__(16) unsigned char dual_smem[];
    float* gt = reinterpret_cast<float*>(dual_smem);
    CholSmem<FD>& sh = *reinterpret_cast<CholSmem<FD>*>(gt + f * S);
    float* y = reinterpret_cast<float*>(&sh + 1);
    const int u = rows[blockIdx.x];
    const long long lo = indptr[u];
    const int n = (int)(indptr[u + 1] - lo);
    const int lane = threadIdx.x & 31;
    int mine[PER];  // the fixed rows of ratings lane, lane + 32, ...
#pragma unroll
    for (int q = 0; q < PER; ++q) mine[q] = lane + 32 * q < n ? __ldg(idx + lo + lane + 32 * q) : 0;
    const unsigned base = smem_u32(gt);
    for (int i = threadIdx.x / 32; i < n; i += NT / 32) {  // a warp per rating, lanes over k
        int v = 0;
#pragma unroll
        for (int q = 0; q < PER; ++q) {
            const int w = __shfl_sync(0xFFFFFFFFu, mine[q], i & 31);
            if (i / 32 == q) v = w;
        }
        const float* src = fixed + (long long)v * f;
        for (int k = lane; k < f; k += 32) cp_async4(base + 4 * (k * S + i), src + k);
    }
    cp_async_commit();
    for (int k = threadIdx.x; k < f; k += NT)
        for (int i = n; i < FD; ++i) gt[k * S + i] = 0.0f;
    cp_async_wait_all();
    __syncthreads();
    const bool active = threadIdx.x < Cfg<FD>::NTRI;
    int ib = 0, jb = 0;
    if (active) tile_of(threadIdx.x, Cfg<FD>::NTILE, ib, jb);
    float acc[TILE][TILE];
#pragma unroll
    for (int r = 0; r < TILE; ++r)
#pragma unroll
        for (int c = 0; c < TILE; ++c) acc[r][c] = 0.0f;
    if (active) {
        const float* sa = gt + ib * TILE;
        const float* sb = gt + jb * TILE;
#pragma unroll 2
        for (int k = 0; k < f; ++k) add_outer(acc, sa + k * S, sb + k * S);
#pragma unroll
        for (int r = 0; r < TILE; ++r)
            if (ib * TILE + r == n) {
#pragma unroll
                for (int c = 0; c < TILE; ++c) {
                    const int j = jb * TILE + c;
                    acc[r][c] = j < n ? __ldg(val + lo + j) : 0.0f;
                }
            }
    }
    const float reg = weighted ? lam * (float)counts[u] : lam;
    chol_solve<FD>(acc, ib, jb, active, n, reg, sh, y);  // ends with a barrier: y is whole
    for (int k = threadIdx.x; k < f; k += NT) {
        float s = 0.0f;
        for (int i = 0; i < n; ++i) s = fmaf(gt[k * S + i], y[i], s);
        X[(long long)u * f + k] = s;
    }
}

// ------------------------------------------------------------------ small f, row per thread

// Row v of the fixed factor as FE floats: float32 rows of FE floats, or bfloat16 bits in rows
// padded to a multiple of 8 (bfloat16_rows), read 16 bytes at a time.
template <int FE>
__device__ __forceinline__ void fixed_row(const float* __restrict__ fixed, int v, float (&th)[FE]) {
    const float* p = fixed + (long long)v * FE;
#pragma unroll
    for (int i = 0; i < FE; ++i) th[i] = __ldg(p + i);
}

template <int FE>
__device__ __forceinline__ void fixed_row(const bf16* __restrict__ fixed, int v, float (&th)[FE]) {
    constexpr int PIECES = (FE + TILE - 1) / TILE;
    const uint4* p = reinterpret_cast<const uint4*>(fixed + (long long)v * PIECES * TILE);
#pragma unroll
    for (int q = 0; q < PIECES; ++q) {
        const uint4 w = __ldg(p + q);
        const unsigned h[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < TILE; ++j)
            if (q * TILE + j < FE)
                th[q * TILE + j] = __uint_as_float(j & 1 ? h[j / 2] & 0xFFFF0000u : h[j / 2] << 16);
    }
}

// Packed lower triangle: element (i, j), j <= i.
__device__ __forceinline__ constexpr int packed(int i, int j) { return i * (i + 1) / 2 + j; }

// a += sum s^2 theta_v theta_v^T (packed lower triangle), b += sum s t theta_v over the
// ratings [lo, hi) of one row (s = 1, t = r for explicit ratings; SCALED: s = scale[e]).
// U ratings at a time (the last group masked): their rows are loaded before any is used.
template <int FE, int U, typename T, bool SCALED>
__device__ __forceinline__ void row_gram(float (&a)[FE * (FE + 1) / 2], float (&b)[FE],
                                         const int* __restrict__ idx,
                                         const float* __restrict__ val,
                                         const float* __restrict__ scale,
                                         const T* __restrict__ fixed, long long lo, long long hi) {
    for (long long e = lo; e < hi; e += U) {
        int v[U];
        float r[U], th[U][FE];
#pragma unroll
        for (int q = 0; q < U; ++q) {
            const bool in = e + q < hi;
            v[q] = in ? __ldg(idx + e + q) : 0;
            r[q] = in ? __ldg(val + e + q) : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < U; ++q) fixed_row<FE>(fixed, v[q], th[q]);
#pragma unroll
        for (int q = 0; q < U; ++q) {
            const bool in = e + q < hi;  // a masked rating adds zeros
            const float s = !in ? 0.0f : (SCALED ? __ldg(scale + e + q) : 1.0f);
#pragma unroll
            for (int i = 0; i < FE; ++i) th[q][i] *= s;
#pragma unroll
            for (int i = 0; i < FE; ++i) {
                b[i] = fmaf(r[q], th[q][i], b[i]);
#pragma unroll
                for (int j = 0; j <= i; ++j) a[packed(i, j)] = fmaf(th[q][i], th[q][j], a[packed(i, j)]);
            }
        }
    }
}

// One thread per row u = rows[t], t < n (counts[u] > 0, ratings in [indptr[u], indptr[u+1])):
// a = G0 (IMPLICIT, when given) + row_gram, then (a + reg I) x = b by Cholesky in registers.
// Rows come longest first, so a warp's threads have about the same number of ratings.
template <int FE, int U, typename T, bool IMPLICIT>
__global__ void __launch_bounds__(128)
    row_update_kernel(const long long* __restrict__ indptr, const int* __restrict__ idx,
                      const float* __restrict__ val, const float* __restrict__ scale,
                      const T* __restrict__ fixed, const long long* __restrict__ counts,
                      float lam, int weighted, const float* __restrict__ gram0,
                      const int* __restrict__ rows, int n, float* __restrict__ X) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const int u = rows[t];
    float a[FE * (FE + 1) / 2], b[FE];
#pragma unroll
    for (int i = 0; i < FE; ++i) {
        b[i] = 0.0f;
#pragma unroll
        for (int j = 0; j <= i; ++j)
            a[packed(i, j)] = (IMPLICIT && gram0 != nullptr) ? __ldg(gram0 + i * FE + j) : 0.0f;
    }
    row_gram<FE, U, T, IMPLICIT>(a, b, idx, val, scale, fixed, indptr[u], indptr[u + 1]);
    const float reg = weighted ? lam * (float)counts[u] : lam;
    // Cholesky a = L L^T in place (left-looking), then L y = b and L^T x = y.
    float dinv[FE];
#pragma unroll
    for (int j = 0; j < FE; ++j) {
        float d = a[packed(j, j)] + reg;
#pragma unroll
        for (int k = 0; k < j; ++k) d = fmaf(-a[packed(j, k)], a[packed(j, k)], d);
        dinv[j] = rsqrtf(d);
#pragma unroll
        for (int i = j + 1; i < FE; ++i) {
            float s = a[packed(i, j)];
#pragma unroll
            for (int k = 0; k < j; ++k) s = fmaf(-a[packed(i, k)], a[packed(j, k)], s);
            a[packed(i, j)] = s * dinv[j];
        }
    }
#pragma unroll
    for (int i = 0; i < FE; ++i) {
        float s = b[i];
#pragma unroll
        for (int k = 0; k < i; ++k) s = fmaf(-a[packed(i, k)], b[k], s);
        b[i] = s * dinv[i];
    }
#pragma unroll
    for (int i = FE - 1; i >= 0; --i) {
        float s = b[i];
#pragma unroll
        for (int k = i + 1; k < FE; ++k) s = fmaf(-a[packed(k, i)], b[k], s);
        b[i] = s * dinv[i];
    }
    float* x = X + (long long)u * FE;
#pragma unroll
    for (int i = 0; i < FE; ++i) x[i] = b[i];
}

// Partial Gram of whole rows, one thread per row (small f): A[out[t]] (lower triangle) and
// B[out[t]] of the ratings [seg_lo[t], seg_hi[t]), t < n, stored (the rows are not split);
// with sum_into, added to A (packed lower triangles, as hermitian_kernel's) and B.
template <int FE, int U, typename T, bool SCALED>
__global__ void __launch_bounds__(128)
    row_hermitian_kernel(const int* __restrict__ idx, const float* __restrict__ val,
                         const float* __restrict__ scale, const T* __restrict__ fixed,
                         const int* __restrict__ out, const long long* __restrict__ seg_lo,
                         const long long* __restrict__ seg_hi, int n, float* __restrict__ A,
                         float* __restrict__ B, int sum_into) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    float a[FE * (FE + 1) / 2], b[FE];
#pragma unroll
    for (int i = 0; i < FE; ++i) {
        b[i] = 0.0f;
#pragma unroll
        for (int j = 0; j <= i; ++j) a[packed(i, j)] = 0.0f;
    }
    row_gram<FE, U, T, SCALED>(a, b, idx, val, scale, fixed, seg_lo[t], seg_hi[t]);
    const long long u = out[t];
    float* Au = A + u * (sum_into ? FE * (FE + 1) / 2 : FE * FE);
    float* Bu = B + u * FE;
#pragma unroll
    for (int i = 0; i < FE; ++i) {
        Bu[i] = sum_into ? Bu[i] + b[i] : b[i];
#pragma unroll
        for (int j = 0; j <= i; ++j) {
            float* dst = Au + (sum_into ? packed(i, j) : i * FE + j);
            *dst = sum_into ? *dst + a[packed(i, j)] : a[packed(i, j)];
        }
    }
}
