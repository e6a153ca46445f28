/* Batch-invariant int4-weight x int8-activation linears for CPU decoding (specd/qkernels.py).
 *
 * A weight row is stored in blocks of 32 along K: 32 unsigned 4-bit values q, a scale d and an
 * offset m (w = d * q + m, the affine form of GGUF's Q4_K sub-blocks). Each activation row is
 * quantised on its own to int8 in blocks of 32 (scale amax / 127, as llama.cpp's Q8 blocks).
 * A block's dot product is then an exact integer sum (VNNI, or maddubs + madd on plain AVX2:
 * |15 * 127 * 2| < 2^15, no saturation) in one int32 lane per output column, then in float, block
 * after block: acc += dot * (d_w * d_x) + m_w * d_x * sum(q_x).
 *
 * Why it is batch-invariant: a row's result is computed by the same instructions in the same
 * order whatever other rows are in the call; rows share only the weight loads. Threads split
 * the output columns, never K. So a K+1-row verification equals K+1 one-row steps bit for bit.
 *
 * specd_q4_layers runs a Qwen2 model's decoder layers in one call per pass (no Python between
 * the steps of a layer: for a 0.5B draft that overhead was as large as the kernels).
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

/* Layout: output columns go in panels of 16 (one 32-bit lane per column); K in blocks of 32.
 * A panel's block is 4 chunks of 64 bytes; in chunk c, byte 4 * j + i holds column j's value
 * 4 * c + i of the block in its low nibble and value 4 * (c + 4) + i in its high nibble. The
 * block's float16 scales and offsets are 16 consecutive values per panel. So one 64-byte load
 * gives two groups of 4 values for 16 columns, each multiplied by 4 activation bytes broadcast to
 * every lane: a column's block dot product accumulates in its own lane, exactly, in int32. */
#define PW 16 /* columns per panel */

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define PANELS 2 /* panels that share one activation broadcast */
#define RT 6     /* rows that share one weight unpack, at most */

static inline __m512i x4(const int8_t *x)
{
    int32_t v;
    memcpy(&v, x, sizeof v);
    return _mm512_set1_epi32(v);
}

/* ROWS rows x P panels: per block, the exact int32 dot of every (row, column), then
 * acc += dot * (d_w * d_x) + m_w * s_x in float, block after block: the same steps for a
 * (row, column) whichever tile computes it. */
#define TILE(ROWS, P)                                                                                           \
    static void tile_##ROWS##_##P(const int8_t *xq, const float *xd, const float *xs, int64_t K, int64_t m0,    \
                                  const uint8_t *w, const uint16_t *wd, const uint16_t *wm, const float *bias,   \
                                  int64_t N, int64_t p0, float *y)                                             \
    {                                                                                                          \
        const int64_t B = K / QK;                                                                              \
        const __m512i low = _mm512_set1_epi8(0x0F);                                                            \
        __m512 acc[ROWS][P];                                                                                   \
        for (int r = 0; r < ROWS; r++)                                                                         \
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();                                       \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            __m512i dot[ROWS][P];                                                                              \
            for (int r = 0; r < ROWS; r++)                                                                     \
                for (int p = 0; p < P; p++) dot[r][p] = _mm512_setzero_si512();                                \
            for (int c = 0; c < 4; c++) {                                                                      \
                __m512i lo[P], hi[P];                                                                          \
                for (int p = 0; p < P; p++) {                                                                  \
                    const __m512i v = _mm512_loadu_si512((const void *)(w + (((p0 + p) * B + b) * 4 + c) * 64)); \
                    lo[p] = _mm512_and_si512(v, low);                                                          \
                    hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);                                    \
                }                                                                                              \
                for (int r = 0; r < ROWS; r++) {                                                               \
                    const int8_t *x = xq + (m0 + r) * K + b * QK + 4 * c;                                      \
                    const __m512i xa = x4(x), xb = x4(x + 16);                                                 \
                    for (int p = 0; p < P; p++)                                                                \
                        dot[r][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][p], lo[p], xa), hi[p], xb); \
                }                                                                                              \
            }                                                                                                  \
            for (int p = 0; p < P; p++) {                                                                      \
                const int64_t s = ((p0 + p) * B + b) * PW;                                                     \
                const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wd + s)));              \
                const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wm + s)));              \
                for (int r = 0; r < ROWS; r++) {                                                               \
                    const int64_t row = (m0 + r) * B + b;                                                      \
                    acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][p]),                                 \
                                                _mm512_mul_ps(dw, _mm512_set1_ps(xd[row])), acc[r][p]);        \
                    acc[r][p] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[row]), acc[r][p]);                       \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < ROWS; r++)                                                                         \
            for (int p = 0; p < P; p++) {                                                                      \
                const int64_t n = (p0 + p) * PW;                                                               \
                const __mmask16 keep = N - n >= PW ? 0xFFFF : (1u << (N - n)) - 1;                             \
                __m512 v = acc[r][p];                                                                          \
                if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + n));                         \
                _mm512_mask_storeu_ps(y + (m0 + r) * N + n, keep, v);                                          \
            }                                                                                                  \
    }
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1)
TILE(1, 2) TILE(2, 2) TILE(3, 2) TILE(4, 2) TILE(5, 2) TILE(6, 2)

/* P panels from p0, every row, in as few tiles of at most RT rows as can be, of even sizes
 * (9 rows: 5 + 4): each tile unpacks the weights once. */
static void panels(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const uint8_t *w,
                   const uint16_t *wd, const uint16_t *wm, const float *bias, int64_t N, int64_t p0, int P, float *y)
{
    const int64_t tiles = (M + RT - 1) / RT;
    for (int64_t t = 0, m0 = 0; t < tiles; t++) {
        const int64_t rows = M / tiles + (t < M % tiles);
#define CALL(R) (P == 2 ? tile_##R##_2 : tile_##R##_1)(xq, xd, xs, K, m0, w, wd, wm, bias, N, p0, y)
        switch (rows) {
        case 1: CALL(1); break;
        case 2: CALL(2); break;
        case 3: CALL(3); break;
        case 4: CALL(4); break;
        case 5: CALL(5); break;
        default: CALL(6); break;
        }
        m0 += rows;
#undef CALL
    }
}

#else
#define PANELS 1
#define RT 4

static inline __m256i x4(const int8_t *x)
{
    int32_t v;
    memcpy(&v, x, sizeof v);
    return _mm256_set1_epi32(v);
}

/* 8 int32 lanes: lane j gets the dot of w's 4 unsigned bytes j with x's 4 signed bytes, added to acc. */
static inline __m256i dot4(__m256i acc, __m256i w, __m256i x)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

/* ROWS rows x one half panel (8 columns): the same steps as the AVX-512 tiles, 8 lanes at a time. */
#define TILE(ROWS)                                                                                              \
    static void tile_##ROWS(const int8_t *xq, const float *xd, const float *xs, int64_t K, int64_t m0,          \
                            const uint8_t *w, const uint16_t *wd, const uint16_t *wm, const float *bias,       \
                            int64_t N, int64_t p, int half, float *y)                                          \
    {                                                                                                          \
        const int64_t B = K / QK;                                                                              \
        const __m256i low = _mm256_set1_epi8(0x0F);                                                            \
        __m256 acc[ROWS];                                                                                      \
        for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();                                           \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            __m256i dot[ROWS];                                                                                 \
            for (int r = 0; r < ROWS; r++) dot[r] = _mm256_setzero_si256();                                    \
            for (int c = 0; c < 4; c++) {                                                                      \
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + ((p * B + b) * 4 + c) * 64 + 32 * half)); \
                const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low); \
                for (int r = 0; r < ROWS; r++) {                                                               \
                    const int8_t *x = xq + (m0 + r) * K + b * QK + 4 * c;                                      \
                    dot[r] = dot4(dot4(dot[r], lo, x4(x)), hi, x4(x + 16));                                    \
                }                                                                                              \
            }                                                                                                  \
            const int64_t s = (p * B + b) * PW + 8 * half;                                                     \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + s)));                     \
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + s)));                     \
            for (int r = 0; r < ROWS; r++) {                                                                   \
                const int64_t row = (m0 + r) * B + b;                                                          \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(dw, _mm256_set1_ps(xd[row])), acc[r]); \
                acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[row]), acc[r]);                                 \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < ROWS; r++) {                                                                       \
            const int64_t n = p * PW + 8 * half;                                                               \
            float out[8];                                                                                      \
            _mm256_storeu_ps(out, acc[r]);                                                                     \
            for (int i = 0; i < 8 && n + i < N; i++) y[(m0 + r) * N + n + i] = bias ? out[i] + bias[n + i] : out[i]; \
        }                                                                                                      \
    }
TILE(1) TILE(2) TILE(3) TILE(4)

static void panels(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K, const uint8_t *w,
                   const uint16_t *wd, const uint16_t *wm, const float *bias, int64_t N, int64_t p, int P, float *y)
{
    (void)P;
    for (int half = 0; half < 2; half++)
        for (int64_t m0 = 0; m0 < M; m0 += RT) {
            switch (M - m0 < RT ? M - m0 : RT) {
            case 1: tile_1(xq, xd, xs, K, m0, w, wd, wm, bias, N, p, half, y); break;
            case 2: tile_2(xq, xd, xs, K, m0, w, wd, wm, bias, N, p, half, y); break;
            case 3: tile_3(xq, xd, xs, K, m0, w, wd, wm, bias, N, p, half, y); break;
            default: tile_4(xq, xd, xs, K, m0, w, wd, wm, bias, N, p, half, y); break;
            }
        }
}

#endif

/* y [M, N] = x @ W.T (+ bias) from the quantised rows of x (specd_q8_rows) and W as w [P, K/32, 4,
 * 64] packed panels, wd / wm [P, K/32, 16] float16 block scales and offsets and bias [N], with
 * P = ceil(N / 16) (the last panel zero-padded). Threads split the panels, never K. */
void specd_q4_matmul(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                     const uint8_t *w, const uint16_t *wd, const uint16_t *wm, const float *bias, int64_t N,
                     float *y, int threads)
{
    const int64_t P = (N + PW - 1) / PW, groups = P / PANELS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) panels(xq, xd, xs, M, K, w, wd, wm, bias, N, g * PANELS, PANELS, y);
    for (int64_t p = groups * PANELS; p < P; p++) panels(xq, xd, xs, M, K, w, wd, wm, bias, N, p, 1, y);
}

/* One query head against the first L cached keys and values ([L, dim] each), its own last: exactly
 * the keys a one-row step at this position sees. */
static void attend(const float *q, const float *k, const float *v, int64_t L, int64_t dim, float scale, float *p,
                   float *out)
{
    float top = -INFINITY;
    for (int64_t j = 0; j < L; j++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + j * dim + i), acc);
        p[j] = hsum256(acc) * scale;
        top = fmaxf(top, p[j]);
    }
    float total = 0.0f;
    int64_t j = 0;
    for (; j + 8 <= L; j += 8)
        _mm256_storeu_ps(p + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(top))));
    for (; j < L; j++) p[j] = expf(p[j] - top);
    for (j = 0; j < L; j++) total += p[j];
    for (int64_t i = 0; i < dim; i += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (j = 0; j < L; j++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + j * dim + i), acc);
        _mm256_storeu_ps(out + i, _mm256_div_ps(acc, _mm256_set1_ps(total)));
    }
}

/* A quantised linear as the layer forward passes it (the layout of specd_q4_matmul). */
typedef struct {
    const uint8_t *w;
    const uint16_t *d, *m;
    const float *bias;
    int64_t N;
} q4_linear;

typedef struct {
    const float *input_norm, *post_norm;
    q4_linear qkv, o, gate_up, down;
} q4_layer;

/* Where each row's session keeps its keys and values: [layers, kv_heads, capacity, dim] float32. */
typedef struct {
    float *keys, *values;
    int64_t capacity;
    int64_t position; /* keys before this row: its rotary position, where its own key and value go */
} q4_row;

/* x = x * cos + rotate_half(x) * sin over one head (as transformers' apply_rotary_pos_emb). */
static void rotate(float *x, const float *cos, const float *sin, int64_t dim)
{
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + -b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* Qwen2's decoder layers over R rows, hidden [R, H] updated in place: per layer RMS norm, fused
 * q/k/v (with biases), rotary, the new keys and values into each row's cache, per-row attention to
 * the keys before the row and its own, o projection, residual, RMS norm, fused gate/up, SwiGLU,
 * down projection, residual. Every step treats a row on its own (see specd_q4_matmul), so a row's
 * result does not depend on the rows beside it. cos / sin: [R, dim]. */
void specd_q4_layers(const q4_layer *layers, int64_t n_layers, float *hidden, int64_t R, int64_t H, int64_t I,
                     int64_t heads, int64_t kv_heads, int64_t dim, float eps, float scale, const float *cos,
                     const float *sin, const q4_row *rows, int threads)
{
    const int64_t Q = heads * dim, N_qkv = (heads + 2 * kv_heads) * dim, widest = I > H ? (I > Q ? I : Q) : (H > Q ? H : Q);
    int8_t *xq = malloc(R * widest);
    float *xd = malloc(sizeof(float) * R * (widest / QK)), *xs = malloc(sizeof(float) * R * (widest / QK));
    float *qkv = malloc(sizeof(float) * R * N_qkv), *att = malloc(sizeof(float) * R * Q);
    float *gate_up = malloc(sizeof(float) * R * 2 * I), *y = malloc(sizeof(float) * R * H);
    int64_t longest = 0;
    for (int64_t r = 0; r < R; r++) longest = rows[r].position + 1 > longest ? rows[r].position + 1 : longest;
    const int64_t group = heads / kv_heads;
    for (int64_t l = 0; l < n_layers; l++) {
        const q4_layer *L = layers + l;
        specd_rms_norm_q8(hidden, L->input_norm, eps, R, H, xq, xd, xs, threads);
        specd_q4_matmul(xq, xd, xs, R, H, L->qkv.w, L->qkv.d, L->qkv.m, L->qkv.bias, N_qkv, qkv, threads);
        for (int64_t r = 0; r < R; r++) {
            const q4_row *row = rows + r;
            for (int64_t h = 0; h < heads + kv_heads; h++) rotate(qkv + r * N_qkv + h * dim, cos + r * dim, sin + r * dim, dim);
            for (int64_t h = 0; h < kv_heads; h++) {
                const int64_t at = ((l * kv_heads + h) * row->capacity + row->position) * dim;
                memcpy(row->keys + at, qkv + r * N_qkv + Q + h * dim, sizeof(float) * dim);
                memcpy(row->values + at, qkv + r * N_qkv + Q + (kv_heads + h) * dim, sizeof(float) * dim);
            }
        }
#pragma omp parallel num_threads(threads)
        {
            float *p = malloc(sizeof(float) * (longest + 8));
#pragma omp for schedule(static)
            for (int64_t rh = 0; rh < R * heads; rh++) {
                const int64_t r = rh / heads, h = rh % heads, kvh = h / group;
                const q4_row *row = rows + r;
                const int64_t base = (l * kv_heads + kvh) * row->capacity * dim;
                attend(qkv + r * N_qkv + h * dim, row->keys + base, row->values + base, row->position + 1, dim, scale, p,
                       att + rh * dim);
            }
            free(p);
        }
        specd_q8_rows(att, R, Q, xq, xd, xs, threads);
        specd_q4_matmul(xq, xd, xs, R, Q, L->o.w, L->o.d, L->o.m, L->o.bias, H, y, threads);
        for (int64_t i = 0; i < R * H; i++) hidden[i] += y[i];
        specd_rms_norm_q8(hidden, L->post_norm, eps, R, H, xq, xd, xs, threads);
        specd_q4_matmul(xq, xd, xs, R, H, L->gate_up.w, L->gate_up.d, L->gate_up.m, L->gate_up.bias, 2 * I, gate_up, threads);
        specd_swiglu_q8(gate_up, R, I, xq, xd, xs, threads);
        specd_q4_matmul(xq, xd, xs, R, I, L->down.w, L->down.d, L->down.m, L->down.bias, H, y, threads);
        for (int64_t i = 0; i < R * H; i++) hidden[i] += y[i];
    }
    free(xq), free(xd), free(xs), free(qkv), free(att), free(gate_up), free(y);
}
