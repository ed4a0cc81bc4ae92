// Weight-only int4 products for a CPU decode step, on the weight as torch packs it for _weight_int4pack_mm_for_cpu:
// y[m, n] = sum_k x[m, k] * ((q[n, k] - 8) * s[k / G, n] + z[k / G, n]).
//
// Built with w8a16_cpu.cpp into one library by rollout/quantization/cpu_native.py. torch's CPU packing ("lanes", the layout of
// AVX2 and AVX-512 builds) stores each block of BW = 32 or 64 output rows as [K, BW / 2] bytes, the low nibble of byte
// j holding row j and the high nibble row j + BW / 2; the (scale, zero) pairs are bf16 [K / G, N, 2]. torch's kernel
// decodes the weight again for every block of 4 activation rows. This one decodes a chunk of inputs of one block of
// output rows once, into int16 pairs (q[n, k], q[n, k + 1]) in a panel that stays in L1, and multiplies every row of
// the call with it.
//
// The activations enter as int16 with one float scale per row and group (max |x| / 32767, rounded to nearest), so the
// products are integer multiply-adds (vpmaddwd on AVX2, vpdpwssd on AVX-512 VNNI) summed exactly in int32 within a
// group; then y += xscale * (s * sum(q * xq) + (z - 8 s) * sum(xq)) in float32: the product of the rounded
// activations with the weight, as torch's kernel decodes it.
// int32 cannot overflow: a group sums G <= 256 products of q <= 15 and |xq| <= 32767, 256 * 15 * 32767 < 2^31.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define W4_KC 256       // inputs decoded into the panel at a time (a 64-row block: 32 KiB of int16 pairs)
#define W4_ACC_ROWS 64  // activation rows per pass over the weight (their float sums stay on the stack)
#define W4_PREFETCH 1024  // bytes ahead of the pair of inputs being decoded that are asked for
#define W4_MB 4         // activation rows a tile multiplies with the panel at a time

// The (scale, zero) bf16 pairs of BW output rows of one group, as float scales and zero terms z - 8 s.
template <int BW>
__attribute__((target("avx2,fma"))) static inline void w4_scales(const uint16_t* pairs, float* sc, float* zc) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int c = 0; c < BW; c += 8) {  // a 32-bit lane holds one row's pair: scale in the low half, zero in the high
        const __m256i v = _mm256_loadu_si256((const __m256i*)(pairs + 2 * c));
        const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        _mm256_storeu_ps(sc + c, s);
        _mm256_storeu_ps(zc + c, _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, z));
    }
}

// One row's activations as int16 codes, a scale and the sum of the codes per group (exact in float: at most
// 256 * 32767 < 2^24).
__attribute__((target("avx2,fma"))) static void w4_quantize_row(const float* x, int64_t K, int64_t G, int16_t* xq,
                                                                 float* xs, float* xsum) {
    for (int64_t g = 0; g < K / G; g++) {
        const float* xg = x + g * G;
        float m = 0.f;
        for (int64_t k = 0; k < G; k++) m = fabsf(xg[k]) > m ? fabsf(xg[k]) : m;
        const float inv = m > 0.f ? 32767.f / m : 0.f;
        xs[g] = m / 32767.f;
        const __m256 vinv = _mm256_set1_ps(inv);
        int64_t k = 0;
        for (; k + 16 <= G; k += 16) {
            __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + k), vinv));  // to nearest even
            __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + k + 8), vinv));
            _mm256_storeu_si256((__m256i*)(xq + g * G + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
        }
        for (; k < G; k++) xq[g * G + k] = (int16_t)nearbyintf(xg[k] * inv);
        int32_t sum = 0;
        for (k = 0; k < G; k++) sum += xq[g * G + k];
        xsum[g] = (float)sum;
    }
}

// Inputs [k0, k0 + kc) of the block of BW output rows whose bytes start at `qb` ([K, BW / 2]) into `panel`: for each
// pair of inputs p, BW int32 lanes in row order, lane c = (q[c, k0 + 2p], q[c, k0 + 2p + 1]) as two int16.
template <int BW>
__attribute__((target("avx2,fma"))) static void w4_decode(const uint8_t* qb, int64_t k0, int64_t kc, int32_t* panel) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t p = 0; p < kc / 2; p++) {
        const uint8_t* a = qb + (k0 + 2 * p) * (BW / 2);
        _mm_prefetch((const char*)(a + W4_PREFETCH), _MM_HINT_T0);
        int32_t* dst = panel + p * BW;
        for (int s = 0; s < BW / 32; s++) {  // 16 bytes: rows 16 s .. 16 s + 15 and BW / 2 above them
            const __m128i va = _mm_loadu_si128((const __m128i*)(a + 16 * s));
            const __m128i vb = _mm_loadu_si128((const __m128i*)(a + BW / 2 + 16 * s));
            const __m256i pairs = _mm256_set_m128i(_mm_unpackhi_epi8(va, vb), _mm_unpacklo_epi8(va, vb));
            const __m256i lo = _mm256_and_si256(pairs, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(pairs, 4), low);
            _mm256_storeu_si256((__m256i*)(dst + 16 * s), _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)));
            _mm256_storeu_si256((__m256i*)(dst + 16 * s + 8), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)));
            _mm256_storeu_si256((__m256i*)(dst + BW / 2 + 16 * s), _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)));
            _mm256_storeu_si256((__m256i*)(dst + BW / 2 + 16 * s + 8),
                                _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1)));
        }
    }
}

// What a tile needs: the panel of inputs [k0, k0 + kc), the groups' scales for the block's rows (sc[g * BW + c],
// zc = z - 8 s), the activations (codes, scales and sums of codes, from the pass's first row) and the float sums
// acc[m][BW].
struct W4Tile {
    const int32_t* panel;
    const float *sc, *zc;
    const int16_t* xq;
    const float *xs, *xsum;
    float* acc;
    int64_t K, G, k0, kc;
};

// Activation rows [m, m + MB) times the panel's columns [c0, c0 + V * 8), AVX2: vpmaddwd then vpaddd.
template <int BW, int V, int MB>
__attribute__((target("avx2,fma"))) static inline void w4_tile_avx2(const W4Tile& t, int64_t m, int c0) {
    const int64_t ng = t.K / t.G;
    for (int64_t g0 = t.k0; g0 < t.k0 + t.kc; g0 += t.G) {
        __m256i acc[MB][V];
        for (int j = 0; j < MB; j++)
            for (int v = 0; v < V; v++) acc[j][v] = _mm256_setzero_si256();
        for (int64_t k = g0; k < g0 + t.G; k += 2) {
            const int32_t* w = t.panel + (k - t.k0) / 2 * BW + c0;
            __m256i wv[V];
            for (int v = 0; v < V; v++) wv[v] = _mm256_loadu_si256((const __m256i*)(w + 8 * v));
            for (int j = 0; j < MB; j++) {
                int32_t pair;
                memcpy(&pair, t.xq + (m + j) * t.K + k, 4);
                const __m256i xv = _mm256_set1_epi32(pair);
                for (int v = 0; v < V; v++) acc[j][v] = _mm256_add_epi32(acc[j][v], _mm256_madd_epi16(wv[v], xv));
            }
        }
        const int64_t g = g0 / t.G, gi = (g0 - t.k0) / t.G;
        for (int j = 0; j < MB; j++) {
            const __m256 xs = _mm256_set1_ps(t.xs[(m + j) * ng + g]);
            const __m256 xsum = _mm256_set1_ps(t.xsum[(m + j) * ng + g]);
            for (int v = 0; v < V; v++) {
                const int c = c0 + 8 * v;
                float* out = t.acc + (m + j) * BW + c;
                const __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j][v]), _mm256_loadu_ps(t.sc + gi * BW + c),
                                                 _mm256_mul_ps(_mm256_loadu_ps(t.zc + gi * BW + c), xsum));
                _mm256_storeu_ps(out, _mm256_fmadd_ps(y, xs, _mm256_loadu_ps(out)));
            }
        }
    }
}

// The same on AVX-512 VNNI: vpdpwssd, 16 columns a vector.
template <int BW, int V, int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static inline void w4_tile_vnni(const W4Tile& t, int64_t m,
                                                                                     int c0) {
    const int64_t ng = t.K / t.G;
    for (int64_t g0 = t.k0; g0 < t.k0 + t.kc; g0 += t.G) {
        __m512i acc[MB][V];
        for (int j = 0; j < MB; j++)
            for (int v = 0; v < V; v++) acc[j][v] = _mm512_setzero_si512();
        for (int64_t k = g0; k < g0 + t.G; k += 2) {
            const int32_t* w = t.panel + (k - t.k0) / 2 * BW + c0;
            __m512i wv[V];
            for (int v = 0; v < V; v++) wv[v] = _mm512_loadu_si512((const void*)(w + 16 * v));
            for (int j = 0; j < MB; j++) {
                int32_t pair;
                memcpy(&pair, t.xq + (m + j) * t.K + k, 4);
                const __m512i xv = _mm512_set1_epi32(pair);
                for (int v = 0; v < V; v++) acc[j][v] = _mm512_dpwssd_epi32(acc[j][v], wv[v], xv);
            }
        }
        const int64_t g = g0 / t.G, gi = (g0 - t.k0) / t.G;
        for (int j = 0; j < MB; j++) {
            const __m512 xs = _mm512_set1_ps(t.xs[(m + j) * ng + g]);
            const __m512 xsum = _mm512_set1_ps(t.xsum[(m + j) * ng + g]);
            for (int v = 0; v < V; v++) {
                const int c = c0 + 16 * v;
                float* out = t.acc + (m + j) * BW + c;
                const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][v]), _mm512_loadu_ps(t.sc + gi * BW + c),
                                                 _mm512_mul_ps(_mm512_loadu_ps(t.zc + gi * BW + c), xsum));
                _mm512_storeu_ps(out, _mm512_fmadd_ps(y, xs, _mm512_loadu_ps(out)));
            }
        }
    }
}

// A call of at most W4_MB rows (a decode step of few sequences), AVX-512 VNNI: each pair of inputs decoded into
// registers and multiplied at once, without the panel's stores and loads (a third fewer instructions at 1 row).
template <int BW, int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void w4_direct_vnni(const uint8_t* qb, const float* sc,
                                                                                 const float* zc, const int16_t* xq,
                                                                                 const float* xs, const float* xsum,
                                                                                 float* acc, int64_t K, int64_t G,
                                                                                 int64_t k0, int64_t kc) {
    constexpr int V = BW / 16;
    const int64_t ng = K / G;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t g0 = k0; g0 < k0 + kc; g0 += G) {
        __m512i a[MB][V];
        for (int j = 0; j < MB; j++)
            for (int v = 0; v < V; v++) a[j][v] = _mm512_setzero_si512();
        for (int64_t k = g0; k < g0 + G; k += 2) {
            const uint8_t* row = qb + k * (BW / 2);
            _mm_prefetch((const char*)(row + W4_PREFETCH), _MM_HINT_T0);
            __m512i wv[V];  // wv[v]: rows 16 v .. 16 v + 15, each (q[., k], q[., k + 1])
            for (int s = 0; s < BW / 32; s++) {
                const __m128i va = _mm_loadu_si128((const __m128i*)(row + 16 * s));
                const __m128i vb = _mm_loadu_si128((const __m128i*)(row + BW / 2 + 16 * s));
                const __m256i pairs = _mm256_set_m128i(_mm_unpackhi_epi8(va, vb), _mm_unpacklo_epi8(va, vb));
                wv[s] = _mm512_cvtepu8_epi16(_mm256_and_si256(pairs, low));
                wv[BW / 32 + s] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(pairs, 4), low));
            }
            for (int j = 0; j < MB; j++) {
                int32_t pair;
                memcpy(&pair, xq + j * K + k, 4);
                const __m512i xv = _mm512_set1_epi32(pair);
                for (int v = 0; v < V; v++) a[j][v] = _mm512_dpwssd_epi32(a[j][v], wv[v], xv);
            }
        }
        const int64_t g = g0 / G, gi = (g0 - k0) / G;
        for (int j = 0; j < MB; j++) {
            const __m512 s = _mm512_set1_ps(xs[j * ng + g]), t = _mm512_set1_ps(xsum[j * ng + g]);
            for (int v = 0; v < V; v++) {
                float* out = acc + j * BW + 16 * v;
                const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[j][v]), _mm512_loadu_ps(sc + gi * BW + 16 * v),
                                                 _mm512_mul_ps(_mm512_loadu_ps(zc + gi * BW + 16 * v), t));
                _mm512_storeu_ps(out, _mm512_fmadd_ps(y, s, _mm512_loadu_ps(out)));
            }
        }
    }
}

// The same on AVX2 for 1 row (and 2 in blocks of 32 output rows): the block's BW / 8 int32 accumulators a row stay in
// the 16 vector registers beside the decoded weights, which 3 or more rows would spill.
template <int BW, int MB>
__attribute__((target("avx2,fma"))) static void w4_direct_avx2(const uint8_t* qb, const float* sc, const float* zc,
                                                                const int16_t* xq, const float* xs, const float* xsum,
                                                                float* acc, int64_t K, int64_t G, int64_t k0,
                                                                int64_t kc) {
    constexpr int V = BW / 8;
    static_assert(MB * V <= 8, "the accumulators would not fit in registers");
    const int64_t ng = K / G;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t g0 = k0; g0 < k0 + kc; g0 += G) {
        __m256i a[MB][V];
        for (int j = 0; j < MB; j++)
            for (int v = 0; v < V; v++) a[j][v] = _mm256_setzero_si256();
        for (int64_t k = g0; k < g0 + G; k += 2) {
            const uint8_t* row = qb + k * (BW / 2);
            _mm_prefetch((const char*)(row + W4_PREFETCH), _MM_HINT_T0);
            __m256i xv[MB];
            for (int j = 0; j < MB; j++) {
                int32_t pair;
                memcpy(&pair, xq + j * K + k, 4);
                xv[j] = _mm256_set1_epi32(pair);
            }
            for (int s = 0; s < BW / 32; s++) {  // rows 16 s .. 16 s + 15 (low nibbles) and BW / 2 above them (high)
                const __m128i va = _mm_loadu_si128((const __m128i*)(row + 16 * s));
                const __m128i vb = _mm_loadu_si128((const __m128i*)(row + BW / 2 + 16 * s));
                const __m256i pairs = _mm256_set_m128i(_mm_unpackhi_epi8(va, vb), _mm_unpacklo_epi8(va, vb));
                const __m256i lo = _mm256_and_si256(pairs, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(pairs, 4), low);
                const __m256i w[4] = {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)),
                                      _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)),
                                      _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)),
                                      _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1))};
                const int at[4] = {2 * s, 2 * s + 1, BW / 16 + 2 * s, BW / 16 + 2 * s + 1};  // in vectors of 8 rows
                for (int j = 0; j < MB; j++)
                    for (int i = 0; i < 4; i++) a[j][at[i]] = _mm256_add_epi32(a[j][at[i]], _mm256_madd_epi16(w[i], xv[j]));
            }
        }
        const int64_t g = g0 / G, gi = (g0 - k0) / G;
        for (int j = 0; j < MB; j++) {
            const __m256 s = _mm256_set1_ps(xs[j * ng + g]), t = _mm256_set1_ps(xsum[j * ng + g]);
            for (int v = 0; v < V; v++) {
                float* out = acc + j * BW + 8 * v;
                const __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[j][v]), _mm256_loadu_ps(sc + gi * BW + 8 * v),
                                                 _mm256_mul_ps(_mm256_loadu_ps(zc + gi * BW + 8 * v), t));
                _mm256_storeu_ps(out, _mm256_fmadd_ps(y, s, _mm256_loadu_ps(out)));
            }
        }
    }
}

// Rows [m, m + MB) against all BW columns of the panel.
template <int BW, int MB, bool VNNI>
static inline void w4_rows(const W4Tile& t, int64_t m) {
    if (VNNI) {
        for (int c0 = 0; c0 < BW; c0 += 64 < BW ? 64 : BW) w4_tile_vnni<BW, (BW < 64 ? BW : 64) / 16, MB>(t, m, c0);
    } else {
        for (int c0 = 0; c0 < BW; c0 += 16) w4_tile_avx2<BW, 2, MB>(t, m, c0);
    }
}

// One block of BW output rows (bytes at qb, scale/zero pairs of rows [n0, n0 + BW)) against activation rows
// [m0, m0 + rows) (rows <= W4_ACC_ROWS), written to out[m][n0 + c].
template <int BW, bool VNNI>
static void w4_block(const uint8_t* qb, const uint16_t* sz, int64_t N, int64_t n0, const int16_t* xq,
                     const float* xs, const float* xsum, int64_t rows, int64_t K, int64_t G, float* out, int64_t m0) {
    alignas(64) int32_t panel[W4_KC / 2 * BW];
    alignas(64) float acc[W4_ACC_ROWS * BW];
    const int64_t kc_max = W4_KC >= G ? W4_KC / G * G : G;  // whole groups a chunk (G <= W4_KC)
    float sc[W4_KC / 32 * BW], zc[W4_KC / 32 * BW];         // G >= 32: at most W4_KC / 32 groups a chunk
    memset(acc, 0, sizeof(float) * rows * BW);
    for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
        const int64_t kc = k0 + kc_max < K ? kc_max : K - k0;
        const bool direct = rows <= (VNNI ? W4_MB : BW == 32 ? 2 : 1);  // few rows: no panel
        if (!direct) w4_decode<BW>(qb, k0, kc, panel);
        for (int64_t gi = 0; gi < kc / G; gi++) w4_scales<BW>(sz + ((k0 / G + gi) * N + n0) * 2, sc + gi * BW, zc + gi * BW);
        if (direct && VNNI) {
            switch (rows) {
                case 1: w4_direct_vnni<BW, 1>(qb, sc, zc, xq, xs, xsum, acc, K, G, k0, kc); break;
                case 2: w4_direct_vnni<BW, 2>(qb, sc, zc, xq, xs, xsum, acc, K, G, k0, kc); break;
                case 3: w4_direct_vnni<BW, 3>(qb, sc, zc, xq, xs, xsum, acc, K, G, k0, kc); break;
                default: w4_direct_vnni<BW, 4>(qb, sc, zc, xq, xs, xsum, acc, K, G, k0, kc); break;
            }
            continue;
        }
        if (direct) {
            if (rows == 1)
                w4_direct_avx2<BW, 1>(qb, sc, zc, xq, xs, xsum, acc, K, G, k0, kc);
            else
                w4_direct_avx2<32, 2>(qb, sc, zc, xq, xs, xsum, acc, K, G, k0, kc);  // BW == 32 here
            continue;
        }
        const W4Tile t{panel, sc, zc, xq, xs, xsum, acc, K, G, k0, kc};
        int64_t m = 0;
        for (; m + W4_MB <= rows; m += W4_MB) w4_rows<BW, W4_MB, VNNI>(t, m);
        for (; m < rows; m++) w4_rows<BW, 1, VNNI>(t, m);
    }
    for (int64_t m = 0; m < rows; m++) memcpy(out + (m0 + m) * N + n0, acc + m * BW, sizeof(float) * BW);
}

template <int BW, bool VNNI>
static void w4_product(const int16_t* xq, const float* xs, const float* xsum, int64_t M, int64_t K, int64_t G,
                       const uint8_t* q, const uint16_t* sz, int64_t N, float* out, int threads) {
    const int64_t ng = K / G, blocks = N / BW;
    for (int64_t m0 = 0; m0 < M; m0 += W4_ACC_ROWS) {
        const int64_t rows = m0 + W4_ACC_ROWS < M ? W4_ACC_ROWS : M - m0;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            w4_block<BW, VNNI>(q + b * BW * K / 2, sz, N, b * BW, xq + m0 * K, xs + m0 * ng, xsum + m0 * ng, rows, K,
                               G, out, m0);
    }
}

extern "C" {

// Bytes of work space a call of M rows, K inputs and groups of G needs (the int16 codes, scales and sums of codes).
int64_t qg_w4a16_workspace(int64_t M, int64_t K, int64_t G) { return M * K * 2 + 2 * M * (K / G) * 4 + 64; }

// x [M, K] float32 times the int4 weight [N, K] packed by torch for _weight_int4pack_mm_for_cpu in blocks of BW rows
// ("lanes"), (scale, zero) bf16 pairs [K / G, N, 2], into out [M, N] float32. isa: 2 = AVX2 + FMA, 5 = AVX-512 VNNI.
// Returns 0; -1 for an isa it does not know, -2 for a BW other than 32 or 64, -3 for N % BW != 0, -4 for a group
// other than 32, 64, 128 or 256, -5 for K % G != 0.
int qg_w4a16_mm(const float* x, int64_t M, int64_t K, const uint8_t* q, const uint16_t* sz, int64_t N, int64_t G,
                int64_t BW, float* out, void* work, int isa, int threads) {
    if (isa != 2 && isa != 5) return -1;
    if (BW != 32 && BW != 64) return -2;
    if (N % BW != 0) return -3;
    if (G != 32 && G != 64 && G != 128 && G != 256) return -4;
    if (K % G != 0) return -5;
    const int64_t ng = K / G;
    int16_t* xq = (int16_t*)work;
    float* xs = (float*)(((uintptr_t)(xq + M * K) + 63) & ~(uintptr_t)63);
    float* xsum = xs + M * ng;
    for (int64_t m = 0; m < M; m++) w4_quantize_row(x + m * K, K, G, xq + m * K, xs + m * ng, xsum + m * ng);
    if (isa == 5) {
        if (BW == 64)
            w4_product<64, true>(xq, xs, xsum, M, K, G, q, sz, N, out, threads);
        else
            w4_product<32, true>(xq, xs, xsum, M, K, G, q, sz, N, out, threads);
    } else {
        if (BW == 64)
            w4_product<64, false>(xq, xs, xsum, M, K, G, q, sz, N, out, threads);
        else
            w4_product<32, false>(xq, xs, xsum, M, K, G, q, sz, N, out, threads);
    }
    return 0;
}
}
