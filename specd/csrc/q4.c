/* Batch-invariant int4-weight x int8-activation linears for CPU decoding (specd/qkernels.py).
 *
 * A weight row is stored in blocks of 32 along K: 32 unsigned 4-bit values q, a scale d and an
 * offset m (w = d * q + m, the affine form of GGUF's Q4_K sub-blocks). Each activation row is
 * quantised on its own to int8 in blocks of 32 (scale amax / 127, as llama.cpp's Q8 blocks).
 * A block's dot product is then an exact integer sum (VNNI, or maddubs + madd on plain AVX2:
 * |15 * 127 * 2| < 2^15, no saturation), scaled and accumulated in float in block order; the
 * offset term sum_b m_b * d_x,b * sum(q_x,b) is a separate dot product over blocks.
 *
 * Why it is batch-invariant: a row's result is computed by the same instructions in the same
 * order whatever other rows are in the call; rows share only the weight loads. Threads split
 * the output columns, never K. So a K+1-row verification equals K+1 one-row steps bit for bit.
 *
 * Layout: blocks go in pairs (K a multiple of 64). A pair is 32 bytes; byte j holds value j of
 * the first block in its low nibble and value j of the second in its high nibble, so one 32-byte
 * load splits into both blocks' 64 values in order.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32 /* values per block */

/* e^x for 8 floats (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n); within
 * 2 ulp of expf over [-87, 88], 0 below. Deterministic: the same inputs give the same bits. */
static inline __m256 exp8(__m256 x)
{
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* One row's K values (K a multiple of 32) -> int8 blocks: xq, the block scales xd (amax / 127) and
 * xs (the scale times the block's sum of q). `scale`/`w`, when given, multiply each value first. */
static void q8_row(const float *x, int64_t K, float scale, const float *w, int8_t *xq, float *xd, float *xs)
{
    for (int64_t b = 0; b < K / QK; b++) {
        float v[QK], amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            const int64_t k = b * QK + i;
            v[i] = w ? x[k] * scale * w[k] : x[k];
            amax = fmaxf(amax, fabsf(v[i]));
        }
        const float d = amax / 127.0f;
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int q = (int)nearbyintf(v[i] * id);
            xq[b * QK + i] = (int8_t)q;
            sum += q;
        }
        xd[b] = d;
        xs[b] = d * (float)sum;
    }
}

/* x [M, K] float -> xq [M, K] int8, xd [M, K/32] block scales, xs [M, K/32] scale * sum(q). */
void specd_q8_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs, int threads)
{
    const int64_t B = K / QK;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) q8_row(x + m * K, K, 1.0f, 0, xq + m * K, xd + m * B, xs + m * B);
}

/* RMS-normalise each row (x * rsqrt(mean(x^2) + eps) * w, as Qwen2's norm), then specd_q8_rows. */
void specd_rms_norm_q8(const float *x, const float *w, float eps, int64_t M, int64_t K, int8_t *xq, float *xd,
                       float *xs, int threads)
{
    const int64_t B = K / QK;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float squares = 0.0f;
        for (int64_t k = 0; k < K; k++) squares += row[k] * row[k];
        const float scale = 1.0f / sqrtf(squares / (float)K + eps);
        q8_row(row, K, scale, w, xq + m * K, xd + m * B, xs + m * B);
    }
}

/* gate_up [M, 2I] -> silu(gate) * up [M, I], then specd_q8_rows (the MLP's down-projection input). */
void specd_swiglu_q8(const float *gate_up, int64_t M, int64_t I, int8_t *xq, float *xd, float *xs, int threads)
{
    const int64_t B = I / QK;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * I >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *gate = gate_up + m * 2 * I, *up = gate + I;
        float h[QK];
        for (int64_t b = 0; b < B; b++) {
            for (int i = 0; i < QK; i += 8) {
                const __m256 g = _mm256_loadu_ps(gate + b * QK + i);
                const __m256 sig = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
                _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_div_ps(g, sig), _mm256_loadu_ps(up + b * QK + i)));
            }
            q8_row(h, QK, 1.0f, 0, xq + m * I + b * QK, xd + m * B + b, xs + m * B + b);
        }
    }
}

static inline float hsum256(__m256 v)
{
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* sum_b m[b] * xs[b] over B blocks (m float16), eight lanes in a fixed order. */
static inline float offset_dot(const uint16_t *m, const float *xs, int64_t B)
{
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= B; b += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b))), _mm256_loadu_ps(xs + b), acc);
    float tail = 0.0f;
    for (; b < B; b++) tail += _cvtsh_ss(m[b]) * xs[b];
    return hsum256(acc) + tail;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define NC 4 /* output columns that share one activation load */

static inline float hsum512(__m512 v)
{
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* Two consecutive floats p[0], p[1] as [p0 x 8 | p1 x 8]: a block pair's scales, lane by lane. */
static inline __m512 pair_scales(__m128 two)
{
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(two));
}

static inline __m512 half_pair(const uint16_t *h)
{
    int32_t bits;
    memcpy(&bits, h, sizeof bits);
    return pair_scales(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
}

static inline __m512i unpack_pair(const uint8_t *w)
{
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low)),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), low), 1);
}

/* One step of one (row, column): the block pair's exact integer dot, scaled, accumulated. Every
 * output element takes exactly these steps in block order, whichever tile computes it. */
static inline __m512 step(__m512 acc, __m512i w, __m512 d, __m512i x, __m512 e)
{
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x)), _mm512_mul_ps(d, e), acc);
}

/* ROWS rows x NC columns (n0 ..), ROWS fixed at compile time so the accumulators stay in registers. */
#define TILE(ROWS)                                                                                              \
    static void tile_##ROWS(const int8_t *xq, const float *xd, const float *xs, int64_t K, int64_t m0,          \
                            const uint8_t *w, const uint16_t *wd, const uint16_t *wm, const float *bias,       \
                            int64_t N, int64_t n0, float *y)                                                   \
    {                                                                                                          \
        const int64_t B = K / QK;                                                                              \
        __m512 acc[NC][ROWS];                                                                                  \
        for (int c = 0; c < NC; c++)                                                                           \
            for (int r = 0; r < ROWS; r++) acc[c][r] = _mm512_setzero_ps();                                    \
        for (int64_t b = 0; b < B; b += 2) {                                                                   \
            __m512i wv[NC];                                                                                    \
            __m512 dv[NC];                                                                                     \
            for (int c = 0; c < NC; c++) {                                                                     \
                wv[c] = unpack_pair(w + ((n0 + c) * B + b) * (QK / 2));                                        \
                dv[c] = half_pair(wd + (n0 + c) * B + b);                                                      \
            }                                                                                                  \
            for (int r = 0; r < ROWS; r++) {                                                                   \
                const int64_t row = m0 + r;                                                                    \
                const __m512i xv = _mm512_loadu_si512((const void *)(xq + row * K + b * QK));                 \
                const __m512 e = pair_scales(_mm_castpd_ps(_mm_load_sd((const double *)(xd + row * B + b)))); \
                for (int c = 0; c < NC; c++) acc[c][r] = step(acc[c][r], wv[c], dv[c], xv, e);                \
            }                                                                                                  \
        }                                                                                                      \
        for (int c = 0; c < NC; c++)                                                                           \
            for (int r = 0; r < ROWS; r++) {                                                                   \
                const int64_t n = n0 + c;                                                                      \
                const float v = hsum512(acc[c][r]) + offset_dot(wm + n * B, xs + (m0 + r) * B, B);             \
                y[(m0 + r) * N + n] = bias ? v + bias[n] : v;                                                  \
            }                                                                                                  \
    }
TILE(1)
TILE(2)
TILE(3)
TILE(4)
#define RT 4

/* The columns past the last whole group of NC, one at a time, with the same steps. */
static void single(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const uint8_t *w,
                   const uint16_t *wd, const uint16_t *wm, const float *bias, int64_t N, int64_t n, float *y)
{
    const int64_t B = K / QK;
    for (int64_t row = 0; row < M; row++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t b = 0; b < B; b += 2) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + row * K + b * QK));
            const __m512 e = pair_scales(_mm_castpd_ps(_mm_load_sd((const double *)(xd + row * B + b))));
            acc = step(acc, unpack_pair(w + (n * B + b) * (QK / 2)), half_pair(wd + n * B + b), xv, e);
        }
        const float v = hsum512(acc) + offset_dot(wm + n * B, xs + row * B, B);
        y[row * N + n] = bias ? v + bias[n] : v;
    }
}

static void group(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const uint8_t *w,
                  const uint16_t *wd, const uint16_t *wm, const float *bias, int64_t N, int64_t n0, float *y)
{
    for (int64_t m0 = 0; m0 < M; m0 += RT) {
        switch (M - m0 < RT ? M - m0 : RT) {
        case 1: tile_1(xq, xd, xs, K, m0, w, wd, wm, bias, N, n0, y); break;
        case 2: tile_2(xq, xd, xs, K, m0, w, wd, wm, bias, N, n0, y); break;
        case 3: tile_3(xq, xd, xs, K, m0, w, wd, wm, bias, N, n0, y); break;
        default: tile_4(xq, xd, xs, K, m0, w, wd, wm, bias, N, n0, y); break;
        }
    }
}

#else
#define NC 1

/* 8 int32 lanes whose sum is the exact dot product of 32 unsigned w and 32 signed x. */
static inline __m256i dot(__m256i w, __m256i x)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

static inline __m256 step(__m256 acc, __m256i w, float d, const int8_t *x, float e)
{
    const __m256i isum = dot(w, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_set1_ps(d), _mm256_set1_ps(e)), acc);
}

/* One output column, every row: two blocks per step, 256-bit lanes. */
static void group(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const uint8_t *w,
                  const uint16_t *wd, const uint16_t *wm, const float *bias, int64_t N, int64_t n, float *y)
{
    const int64_t B = K / QK;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const uint8_t *wn = w + n * B * (QK / 2);
    for (int64_t row = 0; row < M; row++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < B; b += 2) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wn + b * (QK / 2)));
            const int8_t *x = xq + row * K + b * QK;
            acc = step(acc, _mm256_and_si256(v, low), _cvtsh_ss(wd[n * B + b]), x, xd[row * B + b]);
            acc = step(acc, _mm256_and_si256(_mm256_srli_epi16(v, 4), low), _cvtsh_ss(wd[n * B + b + 1]), x + QK,
                       xd[row * B + b + 1]);
        }
        const float v = hsum256(acc) + offset_dot(wm + n * B, xs + row * B, B);
        y[row * N + n] = bias ? v + bias[n] : v;
    }
}
#define single group

#endif

/* y [M, N] = x @ W.T (+ bias) from the quantised rows of x (specd_q8_rows) and W as
 * w [N, K/64, 32] packed block pairs, wd / wm [N, K/32] float16 block scales and offsets. */
void specd_q4_matmul(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                     const uint8_t *w, const uint16_t *wd, const uint16_t *wm, const float *bias, int64_t N,
                     float *y, int threads)
{
    const int64_t groups = N / NC;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) group(xq, xd, xs, M, K, w, wd, wm, bias, N, g * NC, y);
    for (int64_t n = groups * NC; n < N; n++) single(xq, xd, xs, M, K, w, wd, wm, bias, N, n, y);
}

/* Attention of R query rows, each on its own: row r's head h attends to the first len[r] keys and
 * values at kbase[r] / vbase[r] (laid out [kv_heads, stride[r], dim]), with kv head h / (heads /
 * kv_heads). q and out: [R, heads, dim]. Each (row, head) is computed alone in a fixed order, so a
 * row's result does not depend on the other rows (threads split the (row, head) pairs). */
void specd_attend_rows(const float *q, const int64_t *kbase, const int64_t *vbase, const int64_t *stride,
                       const int64_t *len, int64_t R, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                       float *out, int threads)
{
    const int64_t group = heads / kv_heads;
#pragma omp parallel num_threads(threads)
    {
        float *p = 0;
        int64_t capacity = 0;
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < R * heads; rh++) {
            const int64_t r = rh / heads, h = rh % heads, L = len[r];
            const float *qh = q + rh * dim;
            const float *k = (const float *)kbase[r] + (h / group) * stride[r] * dim;
            const float *v = (const float *)vbase[r] + (h / group) * stride[r] * dim;
            if (L > capacity) {
                free(p);
                capacity = L;
                p = (float *)malloc(sizeof(float) * capacity);
            }
            float top = -INFINITY;
            for (int64_t j = 0; j < L; j++) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t i = 0; i < dim; i += 8)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(k + j * dim + i), acc);
                p[j] = hsum256(acc) * scale;
                top = fmaxf(top, p[j]);
            }
            float total = 0.0f;
            int64_t j = 0;
            for (; j + 8 <= L; j += 8)
                _mm256_storeu_ps(p + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(top))));
            for (; j < L; j++) p[j] = expf(p[j] - top);
            for (j = 0; j < L; j++) total += p[j];
            float *o = out + rh * dim;
            for (int64_t i = 0; i < dim; i += 8) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t j = 0; j < L; j++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + j * dim + i), acc);
                _mm256_storeu_ps(o + i, _mm256_div_ps(acc, _mm256_set1_ps(total)));
            }
        }
        free(p);
    }
}
