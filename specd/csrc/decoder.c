/* The decoder of the Llama family over GGUF weights as stored (specd/gguf_model.py drives it).
 *
 * One call runs a whole pass: embedding lookup, every layer, the final norm and the logits of the
 * rows asked for. An architecture is a set of switches in gg_model / gg_layer (norm placement,
 * q/k norms, rotary pairing, gate activation, sliding windows, soft-capping, embedding scale),
 * filled from the GGUF metadata by specd/archs.py, never a second decoder.
 *
 * Batch invariance: every step treats a row on its own. Norms, rotary and activations are per row;
 * the linears are specd_matmul (quants.h: a row's result does not depend on the rows beside it);
 * attention runs one query row against exactly the keys a one-row step at that position sees. So
 * row i of a K + 1-row verification, or of a pass shared with other sessions, is bit for bit the
 * one-row step at that position.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quants.h"

typedef struct {
    const float *attn_norm, *attn_post_norm, *ffn_norm, *ffn_post_norm; /* post norms: NULL unless the arch has them */
    const float *q_norm, *k_norm;                                        /* per-head RMS norms before rotary, or NULL */
    gg_linear q, k, v;    /* k.data == NULL: q is the fused q|k|v projection */
    gg_linear o;
    gg_linear gate, up;   /* up.data == NULL: gate is the fused gate|up projection */
    gg_linear down;
    int64_t window;       /* a row sees the keys of the last `window` positions (itself included); 0: all */
    int64_t rope_set;     /* which cos/sin table the layer rotates with */
} gg_layer;

typedef struct {
    int64_t n_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;
    int64_t rope_dims;    /* leading dimensions of a head that rotate */
    int64_t rope_neox;    /* 1: pairs (i, i + rope_dims / 2); 0: pairs (2i, 2i + 1) */
    int64_t gelu;         /* gate activation: 1 gelu (tanh form), 0 silu */
    float eps, attn_scale, attn_softcap, final_softcap, embed_scale; /* softcaps 0: none */
    const float *out_norm;
    gg_linear embed, out;
    const gg_layer *layers;
} gg_model;

/* Where a row's session keeps its keys and values ([layers, kv_heads, capacity, head_dim] float32)
 * and how many positions come before the row (its rotary position; where its own key goes). */
typedef struct {
    float *keys, *values;
    int64_t capacity, position;
} gg_row;

/* One float row per activation format, quantised on demand: q, k and v (or gate and up) may be
 * stored in types that multiply different formats, and each format is made once per input. */
typedef struct {
    const float *x;
    int64_t M, K;
    void *buf[3];
    int ready[3];
} acts;

static void acts_reset(acts *a, const float *x, int64_t M, int64_t K)
{
    a->x = x, a->M = M, a->K = K;
    memset(a->ready, 0, sizeof a->ready);
}

static const void *acts_for(acts *a, int64_t act, int threads)
{
    if (!a->ready[act]) {
        specd_quantize_rows(a->x, a->M, a->K, act, a->buf[act], threads);
        a->ready[act] = 1;
    }
    return a->buf[act];
}

static void linear(const gg_linear *w, acts *a, float *y, int threads)
{
    specd_matmul(w, acts_for(a, specd_act_of(w->type), threads), a->M, y, threads);
}

/* out = x * rsqrt(mean(x^2) + eps) * w over one row of K values (sums in index order). */
static void rms_norm(const float *x, const float *w, int64_t K, float eps, float *out)
{
    float squares = 0.0f;
    for (int64_t k = 0; k < K; k++) squares += x[k] * x[k];
    const float scale = 1.0f / sqrtf(squares / (float)K + eps);
    for (int64_t k = 0; k < K; k++) out[k] = x[k] * scale * w[k];
}

static void rotate(float *x, const float *cos, const float *sin, int64_t dims, int64_t neox)
{
    const int64_t half = dims / 2;
    for (int64_t i = 0; i < half; i++) {
        const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x0 = x[a], x1 = x[b];
        x[a] = x0 * cos[i] - x1 * sin[i];
        x[b] = x1 * cos[i] + x0 * sin[i];
    }
}

/* e^x of 8 floats: Cephes' single-precision polynomial after x = n ln 2 + r (within 2 ulp of expf),
 * x clamped to [-87.34, 88.38] (the normal floats' range). A lane's result depends on its value
 * alone, so every row and position gets the same e^x whatever the lanes beside it. */
static inline __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_set1_ps(88.37626f), _mm256_max_ps(_mm256_set1_ps(-87.33654f), x)); /* a NaN stays NaN */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    static const float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
    __m256 p = _mm256_set1_ps(c[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* e^x of n floats in place, in chunks of 8; a tail goes through the same chunk code, padded. */
static void exp_n(float *x, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
    if (i < n) {
        float tail[8] = {0};
        memcpy(tail, x + i, sizeof(float) * (n - i));
        _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
        memcpy(x + i, tail, sizeof(float) * (n - i));
    }
}

static inline float hsum256(__m256 v)
{
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* q . k_j over dim for 4 keys at once: four independent chains (one would wait on each fma's
 * latency), each key's sum in the same order as alone. */
static inline void scores4(const float *q, const float *k, int64_t dim, float *s)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < dim; i += 8) {
        const __m256 x = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + dim + i), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * dim + i), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * dim + i), a3);
    }
    s[0] = hsum256(a0), s[1] = hsum256(a1), s[2] = hsum256(a2), s[3] = hsum256(a3);
}

static inline float score1(const float *q, const float *k, int64_t dim)
{
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
    return hsum256(acc);
}

/* One query head against keys and values [L, dim] (the row's window, its own last). Every sum
 * runs in index order whatever L, dim or the row's batch. */
static void attend(const float *q, const float *k, const float *v, int64_t L, int64_t dim, float scale, float cap,
                   float *p, float *out)
{
    int64_t j = 0;
    for (; j + 4 <= L; j += 4) scores4(q, k + j * dim, dim, p + j);
    for (; j < L; j++) p[j] = score1(q, k + j * dim, dim);
    float top = -INFINITY;
    for (j = 0; j < L; j++) {
        float s = p[j] * scale;
        if (cap > 0.0f) s = cap * tanhf(s / cap);
        p[j] = s;
        top = fmaxf(top, s);
    }
    for (j = 0; j < L; j++) p[j] -= top;
    exp_n(p, L);
    float total = 0.0f;
    for (j = 0; j < L; j++) total += p[j];
    const __m256 norm = _mm256_set1_ps(total);
    int64_t i = 0;
    for (; i + 32 <= dim; i += 32) { /* four output chunks at once, each summed over j in order */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (j = 0; j < L; j++) {
            const __m256 w = _mm256_set1_ps(p[j]);
            const float *vj = v + j * dim + i;
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 24), a3);
        }
        _mm256_storeu_ps(out + i, _mm256_div_ps(a0, norm));
        _mm256_storeu_ps(out + i + 8, _mm256_div_ps(a1, norm));
        _mm256_storeu_ps(out + i + 16, _mm256_div_ps(a2, norm));
        _mm256_storeu_ps(out + i + 24, _mm256_div_ps(a3, norm));
    }
    for (; i < dim; i += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (j = 0; j < L; j++) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + j * dim + i), acc);
        _mm256_storeu_ps(out + i, _mm256_div_ps(acc, norm));
    }
}

/* act(gate) * up over n <= 8 values: silu as g / (1 + e^-g) by exp8, gelu (tanh form) per value. A
 * short chunk (a row's tail) goes through the same code, padded: each value's result is its own. */
static void gated8(const float *gate, const float *up, int64_t n, int64_t gelu, float *out)
{
    float g[8] = {0}, u[8] = {0}, y[8];
    memcpy(g, gate, sizeof(float) * n), memcpy(u, up, sizeof(float) * n);
    if (gelu) {
        for (int i = 0; i < 8; i++)
            y[i] = 0.5f * g[i] * (1.0f + tanhf(0.7978845608028654f * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * u[i];
    } else {
        const __m256 gv = _mm256_loadu_ps(g), e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), _mm256_loadu_ps(u)));
    }
    memcpy(out, y, sizeof(float) * n);
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The largest activation buffer a pass needs, per format, for R rows of at most K values. */
static void acts_alloc(acts *a, int64_t R, int64_t K)
{
    for (int64_t act = 0; act < 3; act++) a->buf[act] = malloc(specd_act_row_bytes(act, K) * R + 64);
}

static void acts_free(acts *a)
{
    for (int act = 0; act < 3; act++) free(a->buf[act]);
}

/* Attention block of one layer over R rows: h holds the normed input; out receives o's output. */
static void attention(const gg_model *m, const gg_layer *L, int64_t l, acts *a, int64_t R, const gg_row *rows,
                      const float *cos, const float *sin, float *qkv, float *att, float *out, int threads)
{
    const int64_t dim = m->head_dim, Q = m->heads * dim, KV = m->kv_heads * dim, N = Q + 2 * KV;
    if (L->k.data == NULL) {
        linear(&L->q, a, qkv, threads);
    } else {
        float *part = malloc(sizeof(float) * R * Q);
        const gg_linear *w[3] = {&L->q, &L->k, &L->v};
        const int64_t offset[3] = {0, Q, Q + KV}, width[3] = {Q, KV, KV};
        for (int i = 0; i < 3; i++) {
            linear(w[i], a, part, threads);
            for (int64_t r = 0; r < R; r++) memcpy(qkv + r * N + offset[i], part + r * width[i], sizeof(float) * width[i]);
        }
        free(part);
    }
    const int64_t half = m->rope_dims / 2;
    for (int64_t r = 0; r < R; r++) {
        float *x = qkv + r * N;
        for (int64_t h = 0; h < m->heads + m->kv_heads; h++) {
            float *head = x + h * dim;
            const float *w = h < m->heads ? L->q_norm : L->k_norm;
            if (w) rms_norm(head, w, dim, m->eps, head);
            rotate(head, cos + (L->rope_set * R + r) * half, sin + (L->rope_set * R + r) * half, m->rope_dims, m->rope_neox);
        }
        const gg_row *row = rows + r;
        for (int64_t h = 0; h < m->kv_heads; h++) {
            const int64_t at = ((l * m->kv_heads + h) * row->capacity + row->position) * dim;
            memcpy(row->keys + at, x + Q + h * dim, sizeof(float) * dim);
            memcpy(row->values + at, x + Q + KV + h * dim, sizeof(float) * dim);
        }
    }
    int64_t longest = 0;
    for (int64_t r = 0; r < R; r++) longest = max64(longest, rows[r].position + 1);
    const int64_t group = m->heads / m->kv_heads;
#pragma omp parallel num_threads(threads)
    {
        float *p = malloc(sizeof(float) * (longest + 8));
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < R * m->heads; rh++) {
            const int64_t r = rh / m->heads, h = rh % m->heads;
            const gg_row *row = rows + r;
            const int64_t first = L->window > 0 ? max64(0, row->position + 1 - L->window) : 0;
            const int64_t base = ((l * m->kv_heads + h / group) * row->capacity + first) * dim;
            attend(qkv + r * N + h * dim, row->keys + base, row->values + base, row->position + 1 - first, dim,
                   m->attn_scale, m->attn_softcap, p, att + rh * dim);
        }
        free(p);
    }
    acts b;
    b.buf[0] = a->buf[0], b.buf[1] = a->buf[1], b.buf[2] = a->buf[2];
    acts_reset(&b, att, R, Q);
    linear(&L->o, &b, out, threads);
}

/* Feed-forward block: h holds the normed input; out receives down's output. */
static void feed_forward(const gg_model *m, const gg_layer *L, acts *a, int64_t R, float *gate_up, float *mid,
                         float *out, int threads)
{
    const int64_t I = m->intermediate;
    if (L->up.data == NULL) {
        linear(&L->gate, a, gate_up, threads);
    } else {
        float *part = malloc(sizeof(float) * R * I);
        linear(&L->gate, a, part, threads);
        for (int64_t r = 0; r < R; r++) memcpy(gate_up + r * 2 * I, part + r * I, sizeof(float) * I);
        linear(&L->up, a, part, threads);
        for (int64_t r = 0; r < R; r++) memcpy(gate_up + r * 2 * I + I, part + r * I, sizeof(float) * I);
        free(part);
    }
    /* in chunks of 8 values of a row, the threads splitting them (an exp and a division apiece) */
    const int64_t chunks = (I + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t rc = 0; rc < R * chunks; rc++) {
        const int64_t r = rc / chunks, i = rc % chunks * 8, n = I - i < 8 ? I - i : 8;
        gated8(gate_up + r * 2 * I + i, gate_up + r * 2 * I + I + i, n, m->gelu, mid + r * I + i);
    }
    acts b;
    b.buf[0] = a->buf[0], b.buf[1] = a->buf[1], b.buf[2] = a->buf[2];
    acts_reset(&b, mid, R, I);
    linear(&L->down, &b, out, threads);
}

/* hidden += post_norm(y) (or y when the arch has no post norm), row by row. */
static void residual(float *hidden, float *y, const float *post_norm, int64_t R, int64_t H, float eps)
{
    for (int64_t r = 0; r < R; r++) {
        if (post_norm) rms_norm(y + r * H, post_norm, H, eps, y + r * H);
        for (int64_t i = 0; i < H; i++) hidden[r * H + i] += y[r * H + i];
    }
}

/* A pass over R rows (tokens [R], each row's cache in rows [R]; cos / sin [sets, R, rope_dims / 2]):
 * writes each new key and value into its row's cache and the logits of rows keep [n_keep] into
 * logits [n_keep, vocab]. */
void specd_forward(const gg_model *m, const int64_t *tokens, int64_t R, const gg_row *rows, const float *cos,
                   const float *sin, const int64_t *keep, int64_t n_keep, float *logits, int threads)
{
    const int64_t H = m->hidden, I = m->intermediate, Q = m->heads * m->head_dim;
    const int64_t N = Q + 2 * m->kv_heads * m->head_dim, widest = max64(max64(H, I), Q);
    float *hidden = malloc(sizeof(float) * R * H), *h = malloc(sizeof(float) * R * widest);
    float *y = malloc(sizeof(float) * R * H), *qkv = malloc(sizeof(float) * R * N), *att = malloc(sizeof(float) * R * Q);
    float *gate_up = malloc(sizeof(float) * R * 2 * I), *mid = malloc(sizeof(float) * R * I);
    acts a;
    acts_alloc(&a, R, widest);
    specd_dequantize_rows(&m->embed, tokens, R, hidden);
    if (m->embed_scale != 1.0f)
        for (int64_t i = 0; i < R * H; i++) hidden[i] *= m->embed_scale;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const gg_layer *L = m->layers + l;
        for (int64_t r = 0; r < R; r++) rms_norm(hidden + r * H, L->attn_norm, H, m->eps, h + r * H);
        acts_reset(&a, h, R, H);
        attention(m, L, l, &a, R, rows, cos, sin, qkv, att, y, threads);
        residual(hidden, y, L->attn_post_norm, R, H, m->eps);
        for (int64_t r = 0; r < R; r++) rms_norm(hidden + r * H, L->ffn_norm, H, m->eps, h + r * H);
        acts_reset(&a, h, R, H);
        feed_forward(m, L, &a, R, gate_up, mid, y, threads);
        residual(hidden, y, L->ffn_post_norm, R, H, m->eps);
    }
    for (int64_t i = 0; i < n_keep; i++) rms_norm(hidden + keep[i] * H, m->out_norm, H, m->eps, h + i * H);
    acts_reset(&a, h, n_keep, H);
    linear(&m->out, &a, logits, threads);
    if (m->final_softcap > 0.0f)
        for (int64_t i = 0; i < n_keep * m->vocab; i++) logits[i] = m->final_softcap * tanhf(logits[i] / m->final_softcap);
    acts_free(&a);
    free(hidden), free(h), free(y), free(qkv), free(att), free(gate_up), free(mid);
}

/* The index of the first greatest value of x [n] (a NaN counts as greatest: torch.argmax's rule). */
static int64_t first_max(const float *x, int64_t n, float *best)
{
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        m = _mm256_max_ps(m, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float top = lanes[0];
    for (int j = 1; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < n; i++) {
        any_nan |= x[i] != x[i];
        top = x[i] > top ? x[i] : top;
    }
    i = 0;
    if (!any_nan) {  /* the first lane equal to the maximum, 8 at a time */
        const __m256 t = _mm256_set1_ps(top);
        for (; i + 8 <= n; i += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_EQ_OQ));
            if (hit) {
                *best = top;
                return i + __builtin_ctz(hit);
            }
        }
    }
    for (; i < n; i++)
        if (any_nan ? x[i] != x[i] : x[i] == top) break;
    *best = x[i < n ? i : 0];
    return i < n ? i : 0;
}

/* Each row of x [rows, n]: the first index of its greatest value, and sum_j e^(x_j - max) in double,
 * whose inverse is the row's softmax probability of that token (greedy decoding's choice and how
 * sure the model was, without a softmax over the vocabulary). */
void specd_top1(const float *x, int64_t rows, int64_t n, int64_t *argmax, double *sum_exp)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        float top;
        argmax[r] = first_max(row, n, &top);
        const __m256 shift = _mm256_set1_ps(top);
        __m256d lo = _mm256_setzero_pd(), hi = lo;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), shift));
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        double lanes[4], total = 0.0;
        _mm256_storeu_pd(lanes, _mm256_add_pd(lo, hi));
        for (int j = 0; j < 4; j++) total += lanes[j];
        for (; i < n; i++) total += expf(row[i] - top);
        sum_exp[r] = total;
    }
}
