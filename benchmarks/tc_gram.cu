// Probe kernel of bench_tc_gram.py (not used by the library): the Gram of row segments on the
// tensor cores, the design candidate for the next version of mo_als.cu's Gram
// (benchmarks/gpu_notes.md, "v12").
//
// Each fixed-factor row is stored twice in float16: x = hi + lo * 2^-11 (lo scaled so that it
// stays a normal float16), rows padded to F = 104 (f = 100). Per 16 ratings, one k-step of
// mma.m16n8k16 (float32 sums) per 16 x 8 tile of the lower triangle adds
//     big += hi^T hi,        small += hi^T lo + lo^T hi,
// and A = big + small * 2^-11. The tensor cores sum in float32 without rounding to nearest,
// so `big` loses about 0.2 units in the last place per k-step; with FLUSH = n, each thread
// adds its `big` to float32 sums of its own in shared memory every n bins (rounded sums) and
// starts it again from zero. `small` is 2^11 times smaller: its error does not show.
//
// Fragments come from the bins by ldmatrix.trans (a bin holds rating rows; the Gram wants
// G^T G). A bin row is 104 halves = 208 bytes: 208 mod 128 = 80, so the 8 rows an ldmatrix
// reads fall in 8 different 16-byte bank groups. One block of 4 warps per segment, bins of
// 32 ratings (two k-steps), three buffers staged one bin ahead, one barrier per bin. The
// 55 tiles of the lower triangle (row blocks of 16, column blocks of 8) are dealt to the
// warps at compile time: warp w takes row blocks 6 - w and (w > 0) w - 1, about 14 tiles each.
// Compiled after the library's mo_als.cu (bench_tc_gram.py joins them): smem_u32,
// cp_async16 and cp_async_commit are its.
#define F 104
#define ROWB 208                 // bytes per bin row
#define BIN 32                   // ratings per bin
#define PLANE (BIN * ROWB)       // bytes of one plane (hi or lo) of a bin
#define BUF (2 * PLANE)
#define NBUF 3
#define PIECES 13                // 16-byte pieces per row and plane
#ifndef FLUSH
#define FLUSH 0
#endif

__device__ __forceinline__ void ldm_x4_t(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                    unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A fragments (hi, lo) of row block I at the k-step starting at bin row kb: matrices
// (i 0-7, k 0-7), (i 8-15, k 0-7), (i 0-7, k 8-15), (i 8-15, k 8-15).
template <int I>
__device__ __forceinline__ void a_frags(unsigned (&ah)[4], unsigned (&al)[4], unsigned bin,
                                        int kb) {
    const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    const unsigned off = (kb + r + (m >> 1) * 8) * ROWB + (16 * I + (m & 1) * 8) * 2;
    ldm_x4_t(ah, bin + off);
    ldm_x4_t(al, bin + PLANE + off);
}

// B fragments of column block J: hi (k 0-7, k 8-15), then lo (k 0-7, k 8-15).
__device__ __forceinline__ void b_frags(unsigned (&b)[4], unsigned bin, int kb, int J) {
    const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    ldm_x4_t(b, bin + (m >> 1) * PLANE + (kb + r + (m & 1) * 8) * ROWB + 16 * J);
}

// One warp's tiles: row block IA with column blocks 0..NA-1, row block IB with 0..NB-1.
template <int IA, int NA, int IB, int NB>
struct Warp {
    static constexpr int T = NA + NB;
    float big[T][4], small[T][4];

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int t = 0; t < T; ++t)
#pragma unroll
            for (int q = 0; q < 4; ++q) big[t][q] = small[t][q] = 0.0f;
    }

    __device__ __forceinline__ void step(unsigned bin, int kb) {
        unsigned ah[4], al[4], bh[4], bl[4];
        a_frags<IA>(ah, al, bin, kb);
        if constexpr (NB > 0) a_frags<IB>(bh, bl, bin, kb);
#pragma unroll
        for (int j = 0; j < NA; ++j) {
            unsigned b[4];
            b_frags(b, bin, kb, j);
            mma(big[j], ah, b[0], b[1]);
            mma(small[j], ah, b[2], b[3]);
            mma(small[j], al, b[0], b[1]);
            if constexpr (NB > 0) {
                if (j < NB) {
                    mma(big[NA + j], bh, b[0], b[1]);
                    mma(small[NA + j], bh, b[2], b[3]);
                    mma(small[NA + j], bl, b[0], b[1]);
                }
            }
        }
    }

    // sums[(t * 32 + lane) * 4 ...] += big[t] (= big[t] when first), and big starts again.
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

    // A's lower triangle (F x F, row major) from big (+ the flushed sums) and small.
    __device__ __forceinline__ void store(const float* sums, float* __restrict__ A) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const int I = t < NA ? IA : IB, J = t < NA ? t : t - NA;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = 16 * I + g + (q >> 1) * 8, j = 8 * J + 2 * t4 + (q & 1);
                const float b = FLUSH ? sums[(t * 32 + lane) * 4 + q] + big[t][q] : big[t][q];
                if (i < F && j <= i) A[i * F + j] = b + small[t][q] * (1.0f / 2048.0f);
            }
        }
    }
};

// Issue the copies of bin b (ratings e0 + b BIN ...) into its buffer; a partial bin's rows up
// to the next k-step are zeroed.
__device__ __forceinline__ void stage(unsigned char* bins, int b, const int* __restrict__ idx,
                                      const unsigned short* __restrict__ hi,
                                      const unsigned short* __restrict__ lo, long long e0,
                                      int n) {
    unsigned char* buf = bins + (b % NBUF) * BUF;
    const long long e = e0 + (long long)b * BIN;
    const int nk = min(BIN, n - b * BIN);
    const unsigned dst = smem_u32(buf);
    for (int c = threadIdx.x; c < nk * 2 * PIECES; c += blockDim.x) {
        const int k = c / (2 * PIECES), p = c - k * 2 * PIECES;
        const int plane = p >= PIECES, piece = p - plane * PIECES;
        const unsigned short* src = (plane ? lo : hi) + (long long)__ldg(idx + e + k) * F;
        cp_async16(dst + plane * PLANE + k * ROWB + piece * 16, src + piece * 8);
    }
    constexpr int WORDS = ROWB / 4;
    const int kend = (nk + 15) / 16 * 16;
    for (int c = threadIdx.x; c < (kend - nk) * 2 * WORDS; c += blockDim.x) {
        const int k = nk + c / (2 * WORDS), p = c % (2 * WORDS);
        reinterpret_cast<unsigned*>(buf + (p >= WORDS) * PLANE + k * ROWB)[p % WORDS] = 0u;
    }
    cp_async_commit();
}

template <typename W>
__device__ __forceinline__ void gram(W& w, unsigned char* bins, float* sums,
                                     const int* __restrict__ idx,
                                     const unsigned short* __restrict__ hi,
                                     const unsigned short* __restrict__ lo, long long e0, int n,
                                     float* __restrict__ A) {
    w.zero();
    if (FLUSH) w.flush(sums, true);
    const int nbins = (n + BIN - 1) / BIN;
    stage(bins, 0, idx, hi, lo, e0, n);
    for (int b = 0; b < nbins; ++b) {
        if (b + 1 < nbins) stage(bins, b + 1, idx, hi, lo, e0, n);
        else cp_async_commit();
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        __syncthreads();  // every warp reaches it once per bin (from its own instance of gram)
        const unsigned bin = smem_u32(bins + (b % NBUF) * BUF);
        w.step(bin, 0);
        if (n - b * BIN > 16) w.step(bin, 16);
        if (FLUSH && (b + 1) % (FLUSH > 0 ? FLUSH : 1) == 0) w.flush(sums, false);
    }
    w.store(sums, A);
}

// Block s: A[s] (F x F, lower triangle written) of ratings [seg_lo[s], seg_hi[s]).
// Dynamic shared memory: NBUF * BUF + 64 bytes, then 55 * 128 floats when FLUSH.
extern "C" __global__ void __launch_bounds__(128, 3)
    gram_tc(const int* __restrict__ idx, const unsigned short* __restrict__ hi,
            const unsigned short* __restrict__ lo, const long long* __restrict__ seg_lo,
            const long long* __restrict__ seg_hi, float* __restrict__ A) {
    extern __shared__ __align__(128) unsigned char bins[];
    float* sums = reinterpret_cast<float*>(bins + NBUF * BUF + 64);
    const long long e0 = seg_lo[blockIdx.x];
    const int n = (int)(seg_hi[blockIdx.x] - e0);
    float* As = A + (long long)blockIdx.x * F * F;
    switch (threadIdx.x >> 5) {
    case 0: { Warp<6, 13, 0, 0> w; gram(w, bins, sums, idx, hi, lo, e0, n, As); break; }
    case 1: { Warp<5, 12, 0, 2> w; gram(w, bins, sums + 13 * 128, idx, hi, lo, e0, n, As); break; }
    case 2: { Warp<4, 10, 1, 4> w; gram(w, bins, sums + 27 * 128, idx, hi, lo, e0, n, As); break; }
    default: { Warp<3, 8, 2, 6> w; gram(w, bins, sums + 41 * 128, idx, hi, lo, e0, n, As); }
    }
}
