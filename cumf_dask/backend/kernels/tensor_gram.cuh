// The Gram of row segments on the tensor cores: hermitian_kernel's work for float32 fixed
// factors and explicit ratings, F <= 112 (cupy_backend picks it; benchmarks/gpu_notes.md v13).
// Spliced into mo_als.cu after hermitian_kernel (it uses that file's TILE, smem_u32 and
// cp.async helpers).
//
// Each fixed-factor row is split once per call into two float16 rows, x = hi + lo 2^-11
// (split_kernel: the lo row scaled so that it stays a normal float16), stored side by side
// (2 F halves per row: one 16-byte-aligned gather per rating). A bin holds BIN = 32
// ratings' rows in two planes (hi, lo); the kernel writes each rating, split the same way,
// into column f, so the extended rows g = [x, r, 0 ...] of mo_als.cu give A and B at once.
// Per 16 ratings, one mma.m16n8k16 (float16 products, float32 sums) per 16 x 8 output tile
// and term adds
//     big += hi^T hi,        small += hi^T lo + lo^T hi,
// and A = big + small 2^-11 (lo^T lo, 2^-22 of A, is left out). The tensor cores do not
// round their float32 sums to nearest, so `big` is added to float32 sums in shared memory
// every FLUSH bins and restarts from zero: 1.1e-6 from float64 on 4,096-rating segments,
// against 3.1e-6 for the FP32 kernels (2.1e-5 without the flush).
//
// Fragments come from the bins by ldmatrix.trans (a bin holds rating rows; the Gram wants
// G^T G). A bin row takes an odd number of 16-byte units, so the 8 rows one ldmatrix reads
// fall in 8 different bank groups. Row blocks of 16 (I) by column blocks of 8 (J) cover the
// lower triangle; warp w owns row blocks RB - 1 - w and (RB odd) w - 1 or (RB even) w, about
// F / 8 + 1 tiles, which share the B fragments of their common column blocks. Three bin
// buffers, staged one bin ahead by cp.async (warp w copies rows w, w + W, ...), one barrier
// per bin, as in mo_als.cu.
//
// float16 holds |x| < 65504: split_kernel clears *fits when a factor value is outside
// +-HALF_LIMIT, and the kernel checks its segment's ratings as it converts them (it stores
// nothing when one does not fit). A segment not stored is left to hermitian_kernel, which
// the caller launches after this one, with taken[s] = 0.

#define HALF_LIMIT 16384.0f  // |x| below this: x, its float16 hi and its scaled lo are finite
#define LO_SCALE 2048.0f     // lo = (x - hi) 2^11

__device__ __forceinline__ unsigned short to_half(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float from_half(unsigned short h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}

// out[v] = [hi(fixed[v]) (F halves), lo (F halves)], zero past column f; *fits = 0 when some
// |value| >= HALF_LIMIT (or is not finite). Two columns per thread, grid-stride.
__global__ void split_kernel(const float* __restrict__ fixed, int f, int F, long long n,
                             unsigned* __restrict__ out, int* __restrict__ fits) {
    const long long pairs = n * (F / 2);
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < pairs;
         e += (long long)gridDim.x * blockDim.x) {
        const long long v = e / (F / 2);
        const int c = 2 * (int)(e - v * (F / 2));
        unsigned short hi[2], lo[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const float x = c + k < f ? fixed[v * f + c + k] : 0.0f;
            if (!(fabsf(x) < HALF_LIMIT)) *fits = 0;
            hi[k] = to_half(x);
            lo[k] = to_half((x - from_half(hi[k])) * LO_SCALE);
        }
        out[v * F + c / 2] = hi[0] | (unsigned)hi[1] << 16;
        out[v * F + F / 2 + c / 2] = lo[0] | (unsigned)lo[1] << 16;
    }
}

template <int F>
struct Tc {
    static constexpr int UNITS = F / TILE;           // 16-byte units of a row and plane
    static constexpr int ROWB = 16 * (UNITS | 1);     // bytes per bin row: an odd number of units
    static constexpr int RB = (F + 15) / 16;          // row blocks
    static constexpr int WARPS = (RB + 1) / 2;
    static constexpr int NT = 32 * WARPS;
    static constexpr int BIN = 32, NBUF = 3, FLUSH = 8;
    static constexpr int PLANE = BIN * ROWB, BUF = 2 * PLANE;
    static constexpr int PASSES = (BIN + WARPS - 1) / WARPS;  // bin rows a warp copies
    // Tiles (column blocks) of row block I; warp w's row blocks (second < 0: none).
    __host__ __device__ static constexpr int tiles(int I) { return 2 * I + 2 < UNITS ? 2 * I + 2 : UNITS; }
    __host__ __device__ static constexpr int first(int w) { return RB - 1 - w; }
    __host__ __device__ static constexpr int second(int w) { return RB % 2 ? w - 1 : w; }
    __host__ __device__ static constexpr int warp_tiles(int w) {
        return tiles(first(w)) + (second(w) >= 0 ? tiles(second(w)) : 0);
    }
    __host__ __device__ static constexpr int tiles_before(int w) {
        int s = 0;
        for (int k = 0; k < w; ++k) s += warp_tiles(k);
        return s;
    }
    // Dynamic shared memory: the bins, 16 bytes that the last row block may read past them
    // (its rows >= F are discarded), the bins' ratings (BIN floats per buffer), then the
    // flushed sums (a 16 x 8 tile per 32 lanes x 4).
    static constexpr int RATINGS = NBUF * BUF + 16;
    static constexpr int SUMS = RATINGS + NBUF * BIN * 4;
    static constexpr int BYTES = SUMS + tiles_before(WARPS) * 128 * 4;
};

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// c += a b (m16n8k16, float16 in, float32 sums).
__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Warp W's tiles: row block IA with column blocks 0 .. NA - 1, row block IB with 0 .. NB - 1.
template <int F, int W>
struct TcWarp {
    using C = Tc<F>;
    static constexpr int IA = C::first(W), IB = C::second(W);
    static constexpr int NA = C::tiles(IA), NB = IB >= 0 ? C::tiles(IB) : 0, T = NA + NB;
    float big[T][4], small[T][4];

    // A fragments (hi, lo) of row block I at the k-step from bin row kb: matrices
    // (i 0-7, k 0-7), (i 8-15, k 0-7), (i 0-7, k 8-15), (i 8-15, k 8-15).
    __device__ __forceinline__ static void a_frags(unsigned (&h)[4], unsigned (&l)[4],
                                                   unsigned bin, int kb, int I) {
        const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
        const unsigned off = (kb + r + (m >> 1) * 8) * C::ROWB + (16 * I + (m & 1) * 8) * 2;
        ldmatrix_x4_trans(h, bin + off);
        ldmatrix_x4_trans(l, bin + C::PLANE + off);
    }

    // B fragments of column block J: hi (k 0-7, k 8-15), then lo (k 0-7, k 8-15).
    __device__ __forceinline__ static void b_frags(unsigned (&b)[4], unsigned bin, int kb, int J) {
        const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
        ldmatrix_x4_trans(b, bin + (m >> 1) * C::PLANE + (kb + r + (m & 1) * 8) * C::ROWB + 16 * J);
    }

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int t = 0; t < T; ++t)
#pragma unroll
            for (int q = 0; q < 4; ++q) big[t][q] = small[t][q] = 0.0f;
    }

    __device__ __forceinline__ void step(unsigned bin, int kb) {
        unsigned ah[4], al[4], bh[4], bl[4];
        a_frags(ah, al, bin, kb, IA);
        if constexpr (NB > 0) a_frags(bh, bl, bin, kb, IB);
#pragma unroll
        for (int j = 0; j < NA; ++j) {
            unsigned b[4];
            b_frags(b, bin, kb, j);
            mma16816(big[j], ah, b[0], b[1]);
            mma16816(small[j], ah, b[2], b[3]);
            mma16816(small[j], al, b[0], b[1]);
            if constexpr (NB > 0) {
                if (j < NB) {
                    mma16816(big[NA + j], bh, b[0], b[1]);
                    mma16816(small[NA + j], bh, b[2], b[3]);
                    mma16816(small[NA + j], bl, b[0], b[1]);
                }
            }
        }
    }

    // sums (this warp's) += big (= big when first); big restarts from zero.
    __device__ __forceinline__ void flush(float* sums, bool first) {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int t = 0; t < T; ++t) {
            float4* p = reinterpret_cast<float4*>(sums + (t * 32 + lane) * 4);
            float4 v = first ? make_float4(0.f, 0.f, 0.f, 0.f) : *p;
            v.x += big[t][0];
            v.y += big[t][1];
            v.z += big[t][2];
            v.w += big[t][3];
            *p = v;
            big[t][0] = big[t][1] = big[t][2] = big[t][3] = 0.0f;
        }
    }

    // The tiles' sums, packed by rows into S (the lower triangle of the F x F extended Gram).
    __device__ __forceinline__ void to_smem(const float* sums, bool flushed, float* S) const {
        const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const int I = t < NA ? IA : IB, J = t < NA ? t : t - NA;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = 16 * I + g + (q >> 1) * 8, j = 8 * J + 2 * t4 + (q & 1);
                const float hi = flushed ? sums[(t * 32 + lane) * 4 + q] + big[t][q] : big[t][q];
                if (i < F && j <= i) S[i * (i + 1) / 2 + j] = hi + small[t][q] * (1.0f / LO_SCALE);
            }
        }
    }
};

// A (i < f, j <= i) and B (row f) of output row u from S, as hermitian_kernel writes them
// (gram_put): warp w the rows w, w + W, ..., lanes along a row.
template <int F>
__device__ __forceinline__ void tc_store(const float* S, int f, long long u, bool atomic,
                                         bool sum_into, float* __restrict__ A,
                                         float* __restrict__ B) {
    for (int i = threadIdx.x / 32; i <= f; i += Tc<F>::WARPS) {
        const float* src = S + i * (i + 1) / 2;
        float* dst = i < f ? A + u * (sum_into ? f * (f + 1) / 2 : f * f)
                                 + (sum_into ? i * (i + 1) / 2 : i * f)
                           : B + u * f;
        for (int j = threadIdx.x % 32; j < (i < f ? i + 1 : f); j += 32)
            gram_put(dst + j, src[j], atomic, sum_into);
    }
}

// Issue the copies of ratings [e0, e0 + nk) into buffer `buf`: warp w copies bin rows
// k = w + W it (pass it; lane it reads the row's index, the others take it by a shuffle),
// lane l the 16-byte unit s = (l - it) mod 32 of the 2 UNITS of the
// split row (the units rotate over the lanes from pass to pass, so that the units holding
// column f of the 8 passes fall on 8 different lanes). The lane with s = f / 8 copies both
// units that hold column f, and the rating, which it writes there in tc_ratings. A partial
// bin's rows up to its last k-step are zeroed.
template <int F>
__device__ __forceinline__ void tc_stage(unsigned char* bins, int buf,
                                         const int* __restrict__ idx,
                                         const float* __restrict__ val,
                                         const unsigned* __restrict__ split, int f,
                                         long long e0, int nk) {
    using C = Tc<F>;
    unsigned char* base = bins + buf * C::BUF;
    const unsigned dst = smem_u32(base);
    const unsigned rating = smem_u32(bins + C::RATINGS) + 4 * buf * C::BIN;
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, fcol = f / TILE;
    const int mine = lane < C::PASSES && w + C::WARPS * lane < nk
                         ? __ldg(idx + e0 + w + C::WARPS * lane) : 0;  // pass `lane`'s row
#pragma unroll 1  // unrolled, its addresses of all passes would take registers the mma need
    for (int it = 0; it < C::PASSES; ++it) {
        const int k = w + C::WARPS * it, v = __shfl_sync(0xFFFFFFFFu, mine, it);
        if (k >= nk) continue;  // the same for the whole warp
        const unsigned* src = split + (long long)v * F;
        const unsigned row = dst + k * C::ROWB;
        const int s = (lane - it) & 31, plane = s >= C::UNITS;
        if (s < 2 * C::UNITS && s != C::UNITS + fcol)
            cp_async16(row + plane * C::PLANE + 16 * (s - plane * C::UNITS), src + 4 * s);
        if (s == fcol) {
            cp_async16(row + C::PLANE + 16 * fcol, src + 4 * (C::UNITS + fcol));
            cp_async4(rating + 4 * k, val + e0 + k);
        }
    }
    constexpr int WORDS = C::ROWB / 4;
    const int kend = (nk + 15) / 16 * 16;
    for (int c = threadIdx.x; c < (kend - nk) * 2 * WORDS; c += C::NT) {
        const int k = nk + c / (2 * WORDS), p = c % (2 * WORDS);
        reinterpret_cast<unsigned*>(base + (p >= WORDS) * C::PLANE + k * C::ROWB)[p % WORDS] = 0u;
    }
}

// After this thread's copies of `buf` landed: the lane that took column f in some pass
// writes that row's rating, split, into column f of both planes. Returns false when the
// rating does not fit float16.
template <int F>
__device__ __forceinline__ bool tc_ratings(unsigned char* bins, int buf, int nk, int f) {
    using C = Tc<F>;
    const int it = (threadIdx.x % 32 - f / TILE) & 31;  // the pass in which this lane did
    const int k = threadIdx.x / 32 + C::WARPS * it;
    if (it >= C::PASSES || k >= nk) return true;
    const float r = reinterpret_cast<const float*>(bins + C::RATINGS)[buf * C::BIN + k];
    unsigned char* col = bins + buf * C::BUF + k * C::ROWB + 2 * f;
    const unsigned short hi = to_half(r);
    *reinterpret_cast<unsigned short*>(col) = hi;
    *reinterpret_cast<unsigned short*>(col + C::PLANE) = to_half((r - from_half(hi)) * LO_SCALE);
    return fabsf(r) < HALF_LIMIT;
}

// Warp W's part of the segment's Gram, then (when every rating fit float16) its stores.
// Every warp passes the same barriers. Returns whether it stored.
template <int F, int W>
__device__ __forceinline__ bool tc_gram(unsigned char* smem, const int* __restrict__ idx,
                                        const float* __restrict__ val,
                                        const unsigned* __restrict__ split, int f, long long lo,
                                        long long hi, long long u, bool atomic, bool sum_into,
                                        float* __restrict__ A, float* __restrict__ B) {
    using C = Tc<F>;
    TcWarp<F, W> w;
    float* sums = reinterpret_cast<float*>(smem + C::SUMS) + C::tiles_before(W) * 128;
    w.zero();
    const int n = (int)(hi - lo), nbins = (n + C::BIN - 1) / C::BIN;
    tc_stage<F>(smem, 0, idx, val, split, f, lo, min(C::BIN, n));
    cp_async_commit();
    bool fit = true;
    for (int b = 0, buf = 0; b < nbins; ++b) {
        const int next = (b + 1) * C::BIN, nbuf = buf + 1 == C::NBUF ? 0 : buf + 1;
        if (next < n) tc_stage<F>(smem, nbuf, idx, val, split, f, lo + next, min(C::BIN, n - next));
        cp_async_commit();
        cp_async_wait_prior1();
        const int nk = min(C::BIN, n - b * C::BIN);
        fit &= tc_ratings<F>(smem, buf, nk, f);
        __syncthreads();
        const unsigned bin = smem_u32(smem + buf * C::BUF);
        buf = nbuf;
        w.step(bin, 0);
        if (nk > 16) w.step(bin, 16);
        if ((b + 1) % C::FLUSH == 0) w.flush(sums, b + 1 == C::FLUSH);
    }
    if (!__syncthreads_and(fit)) return false;  // and the bins are free: S takes them
    float* S = reinterpret_cast<float*>(smem);
    w.to_smem(sums, nbins >= C::FLUSH, S);
    __syncthreads();
    tc_store<F>(S, f, u, atomic, sum_into, A, B);
    return true;
}

template <int F, int W = 0>
__device__ __forceinline__ bool tc_warp(int w, unsigned char* smem, const int* __restrict__ idx,
                                        const float* __restrict__ val,
                                        const unsigned* __restrict__ split, int f, long long lo,
                                        long long hi, long long u, bool atomic, bool sum_into,
                                        float* __restrict__ A, float* __restrict__ B) {
    if constexpr (W + 1 < Tc<F>::WARPS) {
        if (w != W)
            return tc_warp<F, W + 1>(w, smem, idx, val, split, f, lo, hi, u, atomic, sum_into, A, B);
    }
    return tc_gram<F, W>(smem, idx, val, split, f, lo, hi, u, atomic, sum_into, A, B);
}

// hermitian_kernel's A, B (same arguments and outputs) on the tensor cores, from the split
// factor. Block s stores segment s when *fits and its ratings fit float16, and records
// whether in taken[s] (hermitian_kernel, launched next, computes the others). Dynamic shared
// memory: Tc<F>::BYTES.
template <int F>
__global__ void __launch_bounds__(Tc<F>::NT, 3)
    tc_hermitian_kernel(const int* __restrict__ idx, const float* __restrict__ val,
                        const unsigned* __restrict__ split, int f, const int* __restrict__ fits,
                        int* __restrict__ taken, const int* __restrict__ seg_out,
                        const long long* __restrict__ seg_lo,
                        const long long* __restrict__ seg_hi, int atomic,
                        float* __restrict__ A, float* __restrict__ B, int sum_into) {
    extern __shared__ __align__(128) unsigned char tc_smem[];
    const int s = blockIdx.x;
    bool stored = false;
    if (*fits)  // the same for every thread
        stored = tc_warp<F>(threadIdx.x / 32, tc_smem, idx, val, split, f, seg_lo[s], seg_hi[s],
                            seg_out[s], atomic != 0, sum_into != 0, A, B);
    if (threadIdx.x == 0) taken[s] = stored;
}
