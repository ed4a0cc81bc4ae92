// Weight-only int8 products for a CPU decode step: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
//
// Built by rollout/quantization/cpu_native.py with the system C++ compiler at first use (no torch headers: a second to build) and
// called through ctypes on float32 tensors. Each weight byte is read from memory once per call, for all of the call's
// rows: a block of NB output rows is multiplied with MB activation rows at a time while it sits in L1.
//
// A tile reads its NB weight rows side by side, NB streams of K bytes (1,536 at Qwen2.5-1.5B's q/k/v/gate/up), each
// too short for the hardware prefetcher to reach full speed before it ends. So every step asks for the bytes
// `prefetch` ahead of each row it reads, running on into the rows of the thread's next tile past a row's end. On a
// 2-core AVX2-only EPYC at Qwen2.5-1.5B's shape the int8 generator decoded 1.28x faster at 1 row and 1.19x at 2 for
// it (bench/model_ladder.py's int8/noprefetch variant keeps the kernel without it, to compare).
//
// The activations enter as int16 with one float scale per row and block of BLK inputs (max |x| / 32767, rounded to
// nearest), so that the products are integer multiply-adds (vpmaddwd on AVX2; vpdpwssd on AVX-512 VNNI: 32 products
// an instruction where a float FMA does 16) summed exactly in int32 within a block, then scaled into float32.
// The rounding of the activations is at most 1/65534 of the block's largest |x|, far below the bf16 rounding that
// torch's int8 kernel applies to every activation (its inputs are bf16): see tests/test_cpu_native.py.
// int32 cannot overflow: a block sums BLK products of |q| <= 128 and |x| <= 32767, 256 * 128 * 32767 < 2^31.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define BLK 256
#define KC_BLOCKS 8  // inputs per chunk, in blocks: 4 rows of 2048 int16 codes are 16 KiB, in L1 beside the weights
#define ACC_ROWS 64  // activation rows per pass over the weight (their float sums stay on the stack)

static inline int64_t nblocks(int64_t K) { return (K + BLK - 1) / BLK; }

// Where a tile's float sums go: the first chunk of inputs starts them at zero, a middle one keeps them in acc (one
// vector per output row i and activation row j, at acc + (i * ACC_ROWS + j) * lanes), the last sums each vector and
// writes out[(m0 + j) * N + n] times the weight row's scale.
struct Sums {
    float* acc;
    float* out;
    const float* scale;
    int64_t N, m0;
    bool first, last;
    int64_t prefetch;  // bytes ahead of each weight row read that a step asks for (0: none)
};

// Ask for the byte `prefetch` ahead of (row n + i, input k) of a tile of NB rows: past the row's end, the same place in
// the row NB further on (the next tile of this thread, whose rows follow); nothing past that row or the weight's end.
template <int NB>
static inline void ask_ahead(const int8_t* q, int64_t n, int i, int64_t k, int64_t K, const Sums& to) {
    const int64_t kp = k + to.prefetch;
    if (kp < K)
        _mm_prefetch((const char*)(q + (n + i) * K + kp), _MM_HINT_T0);
    else if (kp < 2 * K && n + NB + i < to.N)
        _mm_prefetch((const char*)(q + (n + NB + i) * K + (kp - K)), _MM_HINT_T0);
}

// One row's activations as int16 codes and per-block scales.
__attribute__((target("avx2,fma"))) static void quantize_row(const float* x, int64_t K, int16_t* xq, float* xs) {
    for (int64_t b = 0; b < nblocks(K); b++) {
        int64_t k0 = b * BLK, k1 = k0 + BLK < K ? k0 + BLK : K;
        __m256 mx = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        int64_t k = k0;
        for (; k + 8 <= k1; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        float m = 0.f;
        for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
        for (; k < k1; k++) m = fabsf(x[k]) > m ? fabsf(x[k]) : m;
        float inv = m > 0.f ? 32767.f / m : 0.f;
        xs[b] = m / 32767.f;
        const __m256 vinv = _mm256_set1_ps(inv);
        for (k = k0; k + 16 <= k1; k += 16) {
            __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));  // rounds to nearest even
            __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vinv));
            __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);  // saturating, in order
            _mm256_storeu_si256((__m256i*)(xq + k), packed);
        }
        for (; k < k1; k++) xq[k] = (int16_t)nearbyintf(x[k] * inv);
    }
}

// One tile: output rows [n, n + NB) against activation rows [m, m + MB) (from the pass's first) over the blocks
// [b0, b1) of the inputs, its sums where `to` says.
template <int NB, int MB>
__attribute__((target("avx2,fma"))) static inline void tile_avx2(const int16_t* xq, const float* xs, int64_t K,
                                                                const int8_t* q, int64_t n, int64_t m, int64_t b0,
                                                                int64_t b1, const Sums& to) {
    const int64_t nb = nblocks(K);
    __m256 accf[NB][MB];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++)
            accf[i][j] = to.first ? _mm256_setzero_ps() : _mm256_loadu_ps(to.acc + (i * ACC_ROWS + m + j) * 8);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t k0 = b * BLK, k1 = k0 + BLK < K ? k0 + BLK : K;
        __m256i acc[NB][MB];
        for (int i = 0; i < NB; i++)
            for (int j = 0; j < MB; j++) acc[i][j] = _mm256_setzero_si256();
        for (int64_t k = k0; k < k1; k += 32) {
            __m256i wl[NB], wh[NB];
            for (int i = 0; i < NB; i++) {
                if (to.prefetch) ask_ahead<NB>(q, n, i, k, K, to);
                wl[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + (n + i) * K + k)));
                wh[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + (n + i) * K + k + 16)));
            }
            for (int j = 0; j < MB; j++) {
                const __m256i al = _mm256_loadu_si256((const __m256i*)(xq + (m + j) * K + k));
                const __m256i ah = _mm256_loadu_si256((const __m256i*)(xq + (m + j) * K + k + 16));
                for (int i = 0; i < NB; i++)
                    acc[i][j] = _mm256_add_epi32(
                        acc[i][j], _mm256_add_epi32(_mm256_madd_epi16(wl[i], al), _mm256_madd_epi16(wh[i], ah)));
            }
        }
        for (int j = 0; j < MB; j++) {
            const __m256 s = _mm256_set1_ps(xs[(m + j) * nb + b]);
            for (int i = 0; i < NB; i++) accf[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][j]), s, accf[i][j]);
        }
    }
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) {
            if (!to.last) {
                _mm256_storeu_ps(to.acc + (i * ACC_ROWS + m + j) * 8, accf[i][j]);
                continue;
            }
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(accf[i][j]), _mm256_extractf128_ps(accf[i][j], 1));
            v = _mm_hadd_ps(v, v);
            v = _mm_hadd_ps(v, v);
            to.out[(to.m0 + m + j) * to.N + n + i] = _mm_cvtss_f32(v) * to.scale[n + i];
        }
}

template <int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static inline void tile_vnni(const int16_t* xq, const float* xs,
                                                                                  int64_t K, const int8_t* q,
                                                                                  int64_t n, int64_t m, int64_t b0,
                                                                                  int64_t b1, const Sums& to) {
    const int64_t nb = nblocks(K);
    __m512 accf[NB][MB];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++)
            accf[i][j] = to.first ? _mm512_setzero_ps() : _mm512_loadu_ps(to.acc + (i * ACC_ROWS + m + j) * 16);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t k0 = b * BLK, k1 = k0 + BLK < K ? k0 + BLK : K;
        __m512i acc[NB][MB];
        for (int i = 0; i < NB; i++)
            for (int j = 0; j < MB; j++) acc[i][j] = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k += 32) {
            __m512i w[NB];
            for (int i = 0; i < NB; i++) {
                if (to.prefetch) ask_ahead<NB>(q, n, i, k, K, to);
                w[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + (n + i) * K + k)));
            }
            for (int j = 0; j < MB; j++) {
                const __m512i a = _mm512_loadu_si512((const void*)(xq + (m + j) * K + k));
                for (int i = 0; i < NB; i++) acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], w[i], a);
            }
        }
        for (int j = 0; j < MB; j++) {
            const __m512 s = _mm512_set1_ps(xs[(m + j) * nb + b]);
            for (int i = 0; i < NB; i++) accf[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), s, accf[i][j]);
        }
    }
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) {
            if (to.last)
                to.out[(to.m0 + m + j) * to.N + n + i] = _mm512_reduce_add_ps(accf[i][j]) * to.scale[n + i];
            else
                _mm512_storeu_ps(to.acc + (i * ACC_ROWS + m + j) * 16, accf[i][j]);
        }
}

template <int NB, int MB, bool VNNI>
static inline void tile(const int16_t* xq, const float* xs, int64_t K, const int8_t* q, int64_t n, int64_t m,
                        int64_t b0, int64_t b1, const Sums& to) {
    if (VNNI)
        tile_vnni<NB, MB>(xq, xs, K, q, n, m, b0, b1, to);
    else
        tile_avx2<NB, MB>(xq, xs, K, q, n, m, b0, b1, to);
}

// Output rows [n, n + NB) against activation rows [m0, m1) (at most ACC_ROWS): the inputs a chunk of KC_BLOCKS
// blocks at a time, so that the chunk's activations stay in L1 while the tiles of MB rows take their turns; the last
// chunk writes the outputs.
template <int NB, int MB, bool VNNI>
static inline void rows(const int16_t* xq, const float* xs, int64_t m0, int64_t m1, int64_t K, const int8_t* q,
                        const float* s, int64_t N, float* out, int64_t n, int64_t prefetch) {
    alignas(64) float acc[NB * ACC_ROWS * 16];  // only touched when the inputs take more than one chunk
    const int64_t nb = nblocks(K);
    for (int64_t b0 = 0; b0 < nb; b0 += KC_BLOCKS) {
        const int64_t b1 = b0 + KC_BLOCKS < nb ? b0 + KC_BLOCKS : nb;
        const Sums to{acc, out, s, N, m0, b0 == 0, b1 == nb, prefetch};
        const int64_t rows = m1 - m0;
        int64_t m = 0;
        for (; m + MB <= rows; m += MB) tile<NB, MB, VNNI>(xq, xs, K, q, n, m, b0, b1, to);
        switch (rows - m) {
            case 1: tile<NB, 1, VNNI>(xq, xs, K, q, n, m, b0, b1, to); break;
            case 2: tile<NB, (2 < MB ? 2 : 1), VNNI>(xq, xs, K, q, n, m, b0, b1, to); break;
            case 3: tile<NB, (3 < MB ? 3 : 1), VNNI>(xq, xs, K, q, n, m, b0, b1, to); break;
            default: break;  // MB <= 4: nothing else is left
        }
    }
}

template <int NB, int MB, bool VNNI>
static void product(const int16_t* xq, const float* xs, int64_t M, int64_t K, const int8_t* q, const float* s,
                    int64_t N, float* out, int threads, int64_t prefetch) {
    const int64_t blocks = N / NB;
    for (int64_t m0 = 0; m0 < M; m0 += ACC_ROWS) {
        const int64_t m1 = m0 + ACC_ROWS < M ? m0 + ACC_ROWS : M;
        // the tiles index activations from m0: shift the codes and scales there
        const int16_t* xq0 = xq + m0 * K;
        const float* xs0 = xs + m0 * nblocks(K);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; b++) rows<NB, MB, VNNI>(xq0, xs0, m0, m1, K, q, s, N, out, b * NB, prefetch);
        for (int64_t n = blocks * NB; n < N; n++) rows<1, MB, VNNI>(xq0, xs0, m0, m1, K, q, s, N, out, n, prefetch);
    }
}

extern "C" {

// Bytes of work space a call of M rows and K inputs needs (the int16 codes and the block scales).
int64_t qg_w8a16_workspace(int64_t M, int64_t K) { return M * K * 2 + M * nblocks(K) * 4 + 64; }

// isa: 2 = AVX2 + FMA, 5 = AVX-512 with VNNI; prefetch: bytes ahead of each weight row read that are asked for (0:
// none). Returns 0, or -1 for an isa it does not know, -2 for K % 32 != 0, -3 for a negative prefetch.
int qg_w8a16_mm(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, int64_t N, float* out,
                void* work, int isa, int threads, int64_t prefetch) {
    if (K % 32 != 0) return -2;
    if (prefetch < 0) return -3;
    if (isa != 2 && isa != 5) return -1;
    int16_t* xq = (int16_t*)work;
    float* xs = (float*)(((uintptr_t)(xq + M * K) + 63) & ~(uintptr_t)63);
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * K, xs + m * nblocks(K));
    if (isa == 5) {
        if (M == 1)
            product<4, 1, true>(xq, xs, M, K, q, scale, N, out, threads, prefetch);
        else
            product<4, 4, true>(xq, xs, M, K, q, scale, N, out, threads, prefetch);
    } else {
        if (M == 1)
            product<4, 1, false>(xq, xs, M, K, q, scale, N, out, threads, prefetch);
        else
            product<2, 4, false>(xq, xs, M, K, q, scale, N, out, threads, prefetch);
    }
    return 0;
}
}
