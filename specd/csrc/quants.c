/* Batch-invariant kernels over GGUF weights as stored (quants.h; registry in specd/quants.py).
 *
 * y[m][n] = dot(activation row m, weight row n), weight blocks in ggml's layouts (ggml-common.h),
 * activation rows quantised as ggml quantises them (quantize_row_q8_0_ref / quantize_row_q8_K_ref).
 *
 * Why it is batch-invariant: rows of x are multiplied in tiles of 1..TILE rows that share the
 * decoded weight block, but each row of a tile has its own registers and runs the same instruction
 * sequence whatever the tile size: per block an exact integer dot (int32 lanes; the type's integer
 * sub-block scales and mins folded in as integers; any SIMD order gives the same integers), then
 * lane by lane acc += (d_w * d_x) * isum [- (dmin_w * d_x) * imin] in float, block after block, and
 * one fixed horizontal sum of the 8 float lanes at the end. Threads split the output columns n,
 * never K. So y[m][n] has the same bits for every M, every tile, every thread count.
 *
 * The integer paths differ only in how they reach the same int32 lanes: maddubs + madd (AVX2),
 * VNNI dpwssd / dpbusd (no saturation in either), and in AVX-512 builds 64-byte decodes whose
 * 16 lanes fold into those very 8 (some tile sizes take one, some the other). Every path then runs
 * the same float steps, so the native and haswell builds even agree with each other today.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quants.h"

#define QK_K 256
#define NCHUNK 8 /* output columns a tile visits before the next tile (its rows stay in L1) */

/* AVX-512 (BW) builds decode K-quant weights 64 bytes at a time and have 32 vector registers, so
 * a tile holds up to 8 rows; AVX2 builds (16 registers) up to 4. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define WIDE 1
#define TILE 8
#else
#define WIDE 0
#define TILE 4
#endif
#define TILE_ALLOC 8 /* arrays sized for the largest instance */
/* Tiles of fewer rows than this decode Q4_K / Q5_K 32 bytes at a time even in AVX-512 builds
 * (measured faster there; Q6_K is faster 64 bytes at a time at every size). Both give the same
 * integers, so which one a tile takes changes no bit. */
#define WIDE_ROWS_K45 4

/* ggml's weight blocks (fp16 fields as raw bits). */
typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;
typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } blk_q6_K;
_Static_assert(sizeof(blk_q8_0) == 34 && sizeof(blk_q5_0) == 22 && sizeof(blk_q4_0) == 18, "ggml _0 block sizes");
_Static_assert(sizeof(blk_q4_K) == 144 && sizeof(blk_q5_K) == 176 && sizeof(blk_q6_K) == 210, "ggml K block sizes");
_Static_assert(sizeof(gg_q8_0) == 36 && sizeof(gg_q8_K) == 292, "activation block sizes");

#define INLINE static inline __attribute__((always_inline))

INLINE float fp16(uint16_t h) { return _cvtsh_ss(h); }
INLINE float fp16_round(float x) { return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)); }

INLINE float hsum8(__m256 v)
{
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

INLINE float hmax8(__m256 v)
{
    const __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_max_ss(s2, _mm_movehdup_ps(s2)));
}

INLINE __m256i loadu(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* Integer building blocks: VNNI where the CPU has it, else AVX2; the same int32 results (no
 * maddubs pair below can saturate: |w| <= 128 and |x| <= 127 give at most 32512). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* acc + (pairs of int16 a * b summed into int32 lanes) */
INLINE __m256i madd_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
/* acc + (groups of 4 u8 * s8 products into int32 lanes) */
INLINE __m256i dot_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#if WIDE
INLINE __m512i madd_acc512(__m512i acc, __m512i a, __m512i b) { return _mm512_dpwssd_epi32(acc, a, b); }
#endif
#else
INLINE __m256i madd_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
INLINE __m256i dot_acc(__m256i acc, __m256i u, __m256i s)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#if WIDE
INLINE __m512i madd_acc512(__m512i acc, __m512i a, __m512i b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
#endif

#if WIDE
/* The 8 int32 lanes of a 16-lane sum folded (lane i + lane i + 8): with the 64-byte layouts below
 * these are the very integers the 32-byte path has in its 8 lanes. */
INLINE __m256i fold16(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }
/* Two 256-bit vectors as one 512-bit (lo in the lower half). */
INLINE __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
#endif

/* ---------------------------------------------------------------------------------------------
 * Tiles: R activation rows (x + r * xs, format per type) against one weight row w of K values;
 * out[r] = the dot. Each is written once with R a parameter and instantiated for R = 1..TILE. */
#define TILE_PARAMS const uint8_t *w, const uint8_t *x, int64_t xs, int64_t K, float *out
#define TILE_ARGS w, x, xs, K, out

/* K-quant scale byte shuffles: int16 lane i of a 16-bit vector broadcast to every lane. */
INLINE __m256i pick16(int i) { return _mm256_set1_epi16((short)((2 * i + 1) << 8 | 2 * i)); }

/* Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales sc and mins m (ggml's get_scale_min_k4):
 * -> sc: [sc0..sc7] int16 in both halves; mins: [m0, m0, m1, m1, ..., m7, m7] int16, to meet the
 * activation's 16 bsums (two per sub-block). */
INLINE void k4_scales(const uint8_t *s, __m256i *sc, __m256i *mins)
{
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t lo = u[0] & 0x3f3f3f3f, hi = (u[2] & 0x0f0f0f0f) | ((u[0] >> 6) & 0x03030303) << 4;
    const uint32_t mlo = u[1] & 0x3f3f3f3f, mhi = ((u[2] >> 4) & 0x0f0f0f0f) | ((u[1] >> 6) & 0x03030303) << 4;
    *sc = _mm256_cvtepu8_epi16(_mm_set_epi32(hi, lo, hi, lo));
    const __m256i m32 = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, mhi, mlo));
    *mins = _mm256_or_si256(m32, _mm256_slli_epi32(m32, 16));
}

/* Row r's Q8_K block b. */
#define XK(r, b) ((const gg_q8_K *)(x + (r) * xs) + (b))

/* The float step every K-quant block ends with, lane by lane: acc += (d * d_x) * isum - (dmin * d_x) * imin. */
INLINE __m256 k_step(__m256 acc, __m256 d, __m256 dmin, const float *dx, __m256i isum, __m256i imin)
{
    const __m256 x = _mm256_broadcast_ss(dx);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, x), _mm256_cvtepi32_ps(isum), acc);
    return _mm256_fnmadd_ps(_mm256_mul_ps(dmin, x), _mm256_cvtepi32_ps(imin), acc);
}

/* Q4_K and Q5_K: value q (0..15, or 0..31 with the qh bit) of sub-block j is d*sc_j*q - dmin*m_j;
 * isum = sum_j sc_j * (q . x over j), imin = sum_j m_j * (bsums of j). HIGH: Q5_K's fifth bit.
 * Block b's isum of each row, 32 bytes at a time: chunk j's low nibbles (sub-block 2j) and high
 * nibbles (2j + 1) against the row's values 64j.. and 64j + 32.. */
INLINE void qk45_isum(const uint8_t *qs, const uint8_t *qh, __m256i sc, const uint8_t *x, int64_t xs, int64_t b,
                      __m256i *isum, const int R, const int HIGH)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F), b16 = _mm256_set1_epi8(16);
    const __m256i hbits = HIGH ? loadu(qh) : _mm256_setzero_si256();
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i q = loadu(qs + 32 * j);
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (HIGH) {
            const __m256i bl = _mm256_set1_epi8((char)(1 << 2 * j)), bh = _mm256_set1_epi8((char)(2 << 2 * j));
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, bl), bl), b16));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, bh), bh), b16));
        }
        const __m256i slo = _mm256_shuffle_epi8(sc, pick16(2 * j)), shi = _mm256_shuffle_epi8(sc, pick16(2 * j + 1));
        for (int r = 0; r < R; r++) {
            const int8_t *xq = XK(r, b)->qs + 64 * j;
            isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(lo, loadu(xq)), slo);
            isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(hi, loadu(xq + 32)), shi);
        }
    }
}

#if WIDE
/* The same, 64 bytes at a time: chunk j's low then high nibbles as one vector against the row's
 * 64 contiguous values, int16 scales sc_2j x 16 then sc_2j+1 x 16; folded, the same 8 lanes. */
INLINE void qk45_isum_wide(const uint8_t *qs, const uint8_t *qh, __m256i sc, const uint8_t *x, int64_t xs,
                           int64_t b, __m256i *isum, const int R, const int HIGH)
{
    const __m512i shift = join(_mm256_setzero_si256(), _mm256_set1_epi16(4));
    const __m512i scw = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sc));
    __m512i wide[TILE_ALLOC];
    for (int r = 0; r < R; r++) wide[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        __m512i q = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(loadu(qs + 32 * j)), shift),
                                     _mm512_set1_epi8(0x0F));
        if (HIGH) {
            const __m512i bits = join(_mm256_set1_epi8((char)(1 << 2 * j)), _mm256_set1_epi8((char)(2 << 2 * j)));
            const __mmask64 set = _mm512_test_epi8_mask(_mm512_broadcast_i64x4(loadu(qh)), bits);
            q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(16)));
        }
        const __m512i s16 = _mm512_shuffle_epi8(scw, join(pick16(2 * j), pick16(2 * j + 1)));
        for (int r = 0; r < R; r++)
            wide[r] = madd_acc512(wide[r], _mm512_maddubs_epi16(q, _mm512_loadu_si512(XK(r, b)->qs + 64 * j)), s16);
    }
    for (int r = 0; r < R; r++) isum[r] = fold16(wide[r]);
}
#endif

INLINE void tile_qk45(TILE_PARAMS, const int R, const int HIGH)
{
    __m256 acc[TILE_ALLOC];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / QK_K; b++) {
        const uint8_t *scales, *qs, *qh = 0;
        uint16_t d16, dmin16;
        if (HIGH) {
            const blk_q5_K *blk = (const blk_q5_K *)w + b;
            scales = blk->scales, qs = blk->qs, qh = blk->qh, d16 = blk->d, dmin16 = blk->dmin;
        } else {
            const blk_q4_K *blk = (const blk_q4_K *)w + b;
            scales = blk->scales, qs = blk->qs, d16 = blk->d, dmin16 = blk->dmin;
        }
        __m256i sc, mins, isum[TILE_ALLOC];
        k4_scales(scales, &sc, &mins);
#if WIDE
        if (R >= WIDE_ROWS_K45) qk45_isum_wide(qs, qh, sc, x, xs, b, isum, R, HIGH); else
#endif
        qk45_isum(qs, qh, sc, x, xs, b, isum, R, HIGH);
        const __m256 d = _mm256_set1_ps(fp16(d16)), dmin = _mm256_set1_ps(fp16(dmin16));
        for (int r = 0; r < R; r++) {
            const gg_q8_K *xb = XK(r, b);
            acc[r] = k_step(acc[r], d, dmin, &xb->d, isum[r], _mm256_madd_epi16(mins, loadu(xb->bsums)));
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

/* Q6_K: value (q - 32) * d * sc_i, q 0..63, 16 sub-blocks of 16 with int8 scales. The products
 * use q (unsigned) and the offset comes back as an integer: isum - 32 * sum_i sc_i * bsum_i.
 * Block b's isum of each row, 32 values at a time (q0..q3 of each 128-value half). */
INLINE void q6_K_isum(const blk_q6_K *blk, __m128i sc8, const uint8_t *x, int64_t xs, int64_t b, __m256i *isum,
                      const int R)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = loadu(blk->ql + 64 * h), l1 = loadu(blk->ql + 64 * h + 32), hh = loadu(blk->qh + 32 * h);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 4), m30));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 2), m30));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hh, m30));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(hh, 2), m30));
        for (int k = 0; k < 4; k++) {
            /* int16 scale lanes: 8 x sc[8h + 2k] (values 0..15 of the 32), 8 x sc[8h + 2k + 1] */
            const int i = 8 * h + 2 * k;
            const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (i + 1), 0x0101010101010101LL * i);
            const __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
            for (int r = 0; r < R; r++)
                isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(q[k], loadu(XK(r, b)->qs + 128 * h + 32 * k)), s);
        }
    }
}

#if WIDE
/* The same, 64 values at a time: q0|q1 (then q2|q3) of a half against 64 contiguous row values,
 * int16 scales 8 x each of the four 16-value sub-blocks; folded, the same 8 lanes. */
INLINE void q6_K_isum_wide(const blk_q6_K *blk, __m128i sc8, const uint8_t *x, int64_t xs, int64_t b,
                           __m256i *isum, const int R)
{
    const __m512i up42 = join(_mm256_set1_epi16(4), _mm256_set1_epi16(2));
    const __m512i dn02 = join(_mm256_setzero_si256(), _mm256_set1_epi16(2));
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m256i sc2 = _mm256_broadcastsi128_si256(sc8);
    __m512i wide[TILE_ALLOC];
    for (int r = 0; r < R; r++) wide[r] = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i l = _mm512_loadu_si512(blk->ql + 64 * h), hh = _mm512_broadcast_i64x4(loadu(blk->qh + 32 * h));
        const __m512i q[2] = {
            _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi16(hh, up42), m30)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), _mm512_and_si512(_mm512_srlv_epi16(hh, dn02), m30))};
        for (int k = 0; k < 2; k++) {
            const int i = 8 * h + 4 * k;
            const __m256i pick = _mm256_setr_epi64x(0x0101010101010101LL * i, 0x0101010101010101LL * (i + 1),
                                                    0x0101010101010101LL * (i + 2), 0x0101010101010101LL * (i + 3));
            const __m512i s = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(sc2, pick));
            for (int r = 0; r < R; r++) {
                const __m512i xv = _mm512_loadu_si512(XK(r, b)->qs + 128 * h + 64 * k);
                wide[r] = madd_acc512(wide[r], _mm512_maddubs_epi16(q[k], xv), s);
            }
        }
    }
    for (int r = 0; r < R; r++) isum[r] = fold16(wide[r]);
}
#endif

INLINE void tile_q6_K(TILE_PARAMS, const int R)
{
    __m256 acc[TILE_ALLOC];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / QK_K; b++) {
        const blk_q6_K *blk = (const blk_q6_K *)w + b;
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)blk->scales);
        __m256i isum[TILE_ALLOC];
#if WIDE
        q6_K_isum_wide(blk, sc8, x, xs, b, isum, R);
#else
        q6_K_isum(blk, sc8, x, xs, b, isum, R);
#endif
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        const __m256 d = _mm256_set1_ps(fp16(blk->d));
        for (int r = 0; r < R; r++) {
            const gg_q8_K *xb = XK(r, b);
            const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, loadu(xb->bsums)), 5);
            const __m256 dd = _mm256_mul_ps(d, _mm256_broadcast_ss(&xb->d));
            acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], off)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

#if !WIDE
/* 32 bytes 0xFF where bit i of the 32-bit word at p is set (Q5_0's fifth bits). */
INLINE __m256i bits32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v),
                                               _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                                 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}
#endif

/* Q8_0 / Q5_0 / Q4_0 against Q8_0 rows: the block's 32 signed weights w, then per row
 * isum = w . x (|w| times x with w's sign: u8 x s8) and acc += (d_w * d_x) * isum, lane by lane. */
#define TYPE_Q8_0 0
#define TYPE_Q5_0 1
#define TYPE_Q4_0 2
INLINE void tile_q_0(TILE_PARAMS, const int R, const int T)
{
    const int64_t bytes = T == TYPE_Q8_0 ? 34 : T == TYPE_Q5_0 ? 22 : 18;
    __m256 acc[TILE_ALLOC];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t *blk = w + b * bytes;
        uint16_t d16;
        memcpy(&d16, blk, 2);
        __m256i v;
        if (T == TYPE_Q8_0) {
            v = loadu(blk + 2);
        } else {
            const uint8_t *qs = blk + (T == TYPE_Q5_0 ? 6 : 2);
            const __m128i packed = _mm_loadu_si128((const __m128i *)qs);
            v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
            if (T == TYPE_Q5_0) {
#if WIDE /* the 32 fifth bits are a byte mask: q - 16 where the bit is clear */
                uint32_t qh;
                memcpy(&qh, blk + 2, 4);
                v = _mm256_mask_sub_epi8(v, (__mmask32)~qh, v, _mm256_set1_epi8(16));
#else
                v = _mm256_sub_epi8(_mm256_or_si256(v, _mm256_and_si256(bits32(blk + 2), _mm256_set1_epi8(16))),
                                    _mm256_set1_epi8(16));
#endif
            } else
                v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
        }
        const __m256i av = _mm256_abs_epi8(v);
        const float d = fp16(d16);
        for (int r = 0; r < R; r++) {
            const gg_q8_0 *xb = (const gg_q8_0 *)(x + r * xs) + b;
            const __m256i isum = dot_acc(_mm256_setzero_si256(), av, _mm256_sign_epi8(loadu(xb->qs), v));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(isum), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

/* F32 / F16 / BF16 weights against float rows: 16 values a step in two 8-lane fma accumulators,
 * the K % 16 tail in a scalar, then hsum(a0 + a1) + tail. */
INLINE __m256 widen8(const uint8_t *w, int64_t k, const int64_t type)
{
    if (type == GG_F32) return _mm256_loadu_ps((const float *)w + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
    if (type == GG_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INLINE float widen1(const uint8_t *w, int64_t k, const int64_t type)
{
    if (type == GG_F32) return ((const float *)w)[k];
    uint16_t h;
    memcpy(&h, w + 2 * k, 2);
    if (type == GG_F16) return fp16(h);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE void tile_float(TILE_PARAMS, const int R, const int64_t type)
{
    __m256 a0[TILE_ALLOC], a1[TILE_ALLOC];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    const int64_t K16 = K & ~(int64_t)15;
    for (int64_t k = 0; k < K16; k += 16) {
        const __m256 w0 = widen8(w, k, type), w1 = widen8(w, k + 8, type);
        for (int r = 0; r < R; r++) {
            const float *xr = (const float *)(x + r * xs);
            a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr + k), a0[r]);
            a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + k + 8), a1[r]);
        }
    }
    float tail[TILE_ALLOC];
    for (int r = 0; r < R; r++) tail[r] = 0.0f;
    for (int64_t k = K16; k < K; k++) {
        const float wk = widen1(w, k, type);
        for (int r = 0; r < R; r++) tail[r] += wk * ((const float *)(x + r * xs))[k];
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(_mm256_add_ps(a0[r], a1[r])) + tail[r];
}

/* Instances: NAME_R for R = 1..TILE, gathered in a table the driver indexes by R - 1. */
typedef void (*tile_fn)(TILE_PARAMS);
#define TILE_FN(NAME, CALL, R) \
    static void NAME##_##R(TILE_PARAMS) { CALL(R); }
#if TILE == 8
#define TILES(NAME, CALL)                                                                                       \
    TILE_FN(NAME, CALL, 1) TILE_FN(NAME, CALL, 2) TILE_FN(NAME, CALL, 3) TILE_FN(NAME, CALL, 4)                  \
    TILE_FN(NAME, CALL, 5) TILE_FN(NAME, CALL, 6) TILE_FN(NAME, CALL, 7) TILE_FN(NAME, CALL, 8)                  \
    static const tile_fn NAME[TILE] = {NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8};
#else
#define TILES(NAME, CALL)                                                                                       \
    TILE_FN(NAME, CALL, 1) TILE_FN(NAME, CALL, 2) TILE_FN(NAME, CALL, 3) TILE_FN(NAME, CALL, 4)                  \
    static const tile_fn NAME[TILE] = {NAME##_1, NAME##_2, NAME##_3, NAME##_4};
#endif
_Static_assert(TILE <= TILE_ALLOC, "tile arrays");

#define CALL_Q4_K(R) tile_qk45(TILE_ARGS, R, 0)
#define CALL_Q5_K(R) tile_qk45(TILE_ARGS, R, 1)
#define CALL_Q6_K(R) tile_q6_K(TILE_ARGS, R)
#define CALL_Q8_0(R) tile_q_0(TILE_ARGS, R, TYPE_Q8_0)
#define CALL_Q5_0(R) tile_q_0(TILE_ARGS, R, TYPE_Q5_0)
#define CALL_Q4_0(R) tile_q_0(TILE_ARGS, R, TYPE_Q4_0)
#define CALL_F32(R) tile_float(TILE_ARGS, R, GG_F32)
#define CALL_F16(R) tile_float(TILE_ARGS, R, GG_F16)
#define CALL_BF16(R) tile_float(TILE_ARGS, R, GG_BF16)
TILES(tiles_q4_K, CALL_Q4_K)
TILES(tiles_q5_K, CALL_Q5_K)
TILES(tiles_q6_K, CALL_Q6_K)
TILES(tiles_q8_0, CALL_Q8_0)
TILES(tiles_q5_0, CALL_Q5_0)
TILES(tiles_q4_0, CALL_Q4_0)
TILES(tiles_f32, CALL_F32)
TILES(tiles_f16, CALL_F16)
TILES(tiles_bf16, CALL_BF16)

/* ---------------------------------------------------------------------------------------------
 * Dequantisation, one block at a time, in the float steps of gguf's numpy dequantisers (which
 * follow ggml's dequantize_row_*): the same products in the same order, so the same bits. */

static void deq_q8_0(const uint8_t *p, float *y)
{
    const blk_q8_0 *b = (const blk_q8_0 *)p;
    const float d = fp16(b->d);
    for (int i = 0; i < 32; i++) y[i] = (float)b->qs[i] * d;
}

static void deq_q5_0(const uint8_t *p, float *y)
{
    const blk_q5_0 *b = (const blk_q5_0 *)p;
    const float d = fp16(b->d);
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((int)((b->qs[i] & 0x0F) | ((qh >> i) & 1) << 4) - 16);
        y[i + 16] = d * (float)((int)((b->qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - 16);
    }
}

static void deq_q4_0(const uint8_t *p, float *y)
{
    const blk_q4_0 *b = (const blk_q4_0 *)p;
    const float d = fp16(b->d);
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((b->qs[i] & 0x0F) - 8);
        y[i + 16] = d * (float)((b->qs[i] >> 4) - 8);
    }
}

/* ggml's get_scale_min_k4 for sub-block j. */
static void scale_min_k4(int j, const uint8_t *q, int *sc, int *m)
{
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K / Q5_K: (d * sc) * q - (dmin * m); qh NULL for Q4_K. */
static void deq_qk45(const uint16_t d16, uint16_t dmin16, const uint8_t *scales, const uint8_t *qh,
                     const uint8_t *qs, float *y)
{
    const float d = fp16(d16), dmin = fp16(dmin16);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, scales, &sc, &m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            int v = j % 2 ? q[l] >> 4 : q[l] & 0x0F;
            if (qh) v |= ((qh[l] >> j) & 1) << 4;
            y[32 * j + l] = dl * (float)v - ml;
        }
    }
}

static void deq_q4_K(const uint8_t *p, float *y)
{
    const blk_q4_K *b = (const blk_q4_K *)p;
    deq_qk45(b->d, b->dmin, b->scales, 0, b->qs, y);
}

static void deq_q5_K(const uint8_t *p, float *y)
{
    const blk_q5_K *b = (const blk_q5_K *)p;
    deq_qk45(b->d, b->dmin, b->scales, b->qh, b->qs, y);
}

static void deq_q6_K(const uint8_t *p, float *y)
{
    const blk_q6_K *b = (const blk_q6_K *)p;
    const float d = fp16(b->d);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        for (int l = 0; l < 32; l++) {
            const int q[4] = {(ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4, (ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4,
                              (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4, (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4};
            for (int k = 0; k < 4; k++) {
                const int i = 128 * h + 32 * k + l;
                y[i] = (d * (float)b->scales[i / 16]) * (float)(q[k] - 32);
            }
        }
    }
}

static void deq_f32(const uint8_t *p, float *y) { memcpy(y, p, 4); }
static void deq_f16(const uint8_t *p, float *y) { *y = widen1(p, 0, GG_F16); }
static void deq_bf16(const uint8_t *p, float *y) { *y = widen1(p, 0, GG_BF16); }

/* ---------------------------------------------------------------------------------------------
 * The types. */

typedef struct {
    int64_t type;
    int act;
    int block, bytes; /* values and bytes per block */
    const tile_fn *tiles;
    void (*deq)(const uint8_t *, float *);
} type_info;

static const type_info TYPES[] = {
    {GG_F32, ACT_F32, 1, 4, tiles_f32, deq_f32},
    {GG_F16, ACT_F32, 1, 2, tiles_f16, deq_f16},
    {GG_BF16, ACT_F32, 1, 2, tiles_bf16, deq_bf16},
    {GG_Q8_0, ACT_Q8_0, 32, 34, tiles_q8_0, deq_q8_0},
    {GG_Q5_0, ACT_Q8_0, 32, 22, tiles_q5_0, deq_q5_0},
    {GG_Q4_0, ACT_Q8_0, 32, 18, tiles_q4_0, deq_q4_0},
    {GG_Q4_K, ACT_Q8_K, QK_K, 144, tiles_q4_K, deq_q4_K},
    {GG_Q5_K, ACT_Q8_K, QK_K, 176, tiles_q5_K, deq_q5_K},
    {GG_Q6_K, ACT_Q8_K, QK_K, 210, tiles_q6_K, deq_q6_K},
};

static const type_info *type_of(int64_t type)
{
    for (size_t i = 0; i < sizeof TYPES / sizeof *TYPES; i++)
        if (TYPES[i].type == type) return TYPES + i;
    return 0;
}

int specd_act_of(int64_t type)
{
    const type_info *t = type_of(type);
    return t ? t->act : -1;
}

int64_t specd_act_row_bytes(int64_t act, int64_t K)
{
    switch (act) {
    case ACT_F32: return K * (int64_t)sizeof(float);
    case ACT_Q8_0: return K / 32 * (int64_t)sizeof(gg_q8_0);
    case ACT_Q8_K: return K / QK_K * (int64_t)sizeof(gg_q8_K);
    default: return -1;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Activation quantisation: ggml's reference quantisers, vectorised with the same arithmetic. */

/* 32 int32 -> 32 int8 in order (the values fit: packs never saturates here). */
INLINE void store32(int8_t *out, __m256i a, __m256i b, __m256i c, __m256i d)
{
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* quantize_row_q8_K_ref: max = the first value of largest |x|; iscale = -127 / max;
 * q = min(127, nearest_int(iscale * x)) (round half to even: cvtps under the default mode);
 * bsums per 16; d = 1 / iscale. */
static void quantize_q8_K(const float *x, gg_q8_K *y, int64_t nb)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; b++, x += QK_K, y++) {
        __m256 top = _mm256_setzero_ps();
        for (int i = 0; i < QK_K; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
        const float amax = hmax8(top);
        if (!(amax > 0.0f)) {
            memset(y, 0, sizeof *y);
            continue;
        }
        float max = 0.0f;
        for (int i = 0; i < QK_K; i++)
            if (fabsf(x[i]) == amax) {
                max = x[i];
                break;
            }
        const float iscale = -127.f / max;
        const __m256 is = _mm256_set1_ps(iscale);
        const __m256i cap = _mm256_set1_epi32(127);
        for (int i = 0; i < QK_K; i += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++)
                q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(is, _mm256_loadu_ps(x + i + 8 * k))), cap);
            store32(y->qs + i, q[0], q[1], q[2], q[3]);
        }
        for (int j = 0; j < QK_K / 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += y->qs[16 * j + i];
            y->bsums[j] = (int16_t)sum;
        }
        y->d = 1 / iscale;
    }
}

/* roundf (half away from zero) of 8 floats, as int32: trunc, then one step out when the dropped
 * fraction (exact) is at least one half. */
INLINE __m256i roundf8(__m256 v)
{
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 frac = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(v, t));
    const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, _mm256_set1_ps(-0.0f))); /* +-1 */
    const __m256 step = _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), one);
    return _mm256_cvttps_epi32(_mm256_add_ps(t, step));
}

/* quantize_row_q8_0_ref: d = amax / 127, id = d ? 1 / d : 0, q = roundf(x * id); d stored as
 * fp16 (we keep the float value of that fp16). */
static void quantize_q8_0(const float *x, gg_q8_0 *y, int64_t nb)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; b++, x += 32, y++) {
        __m256 v[4], top = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[k]));
        }
        const float amax = hmax8(top);
        const float d = amax / 127;
        const float id = d ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; k++) q[k] = roundf8(_mm256_mul_ps(v[k], vid));
        store32(y->qs, q[0], q[1], q[2], q[3]);
        y->d = fp16_round(d);
    }
}

void specd_quantize_rows(const float *x, int64_t M, int64_t K, int64_t act, void *out, int threads)
{
    const int64_t bytes = specd_act_row_bytes(act, K);
    if (bytes < 0) return;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        uint8_t *row = (uint8_t *)out + m * bytes;
        if (act == ACT_F32) memcpy(row, x + m * K, K * sizeof(float));
        else if (act == ACT_Q8_0) quantize_q8_0(x + m * K, (gg_q8_0 *)row, K / 32);
        else quantize_q8_K(x + m * K, (gg_q8_K *)row, K / QK_K);
    }
}

/* ---------------------------------------------------------------------------------------------
 * The product. Columns are split among threads in chunks of NCHUNK; inside a chunk every tile
 * visits each column. M rows go in as few tiles as can be, of balanced sizes (9 rows: 5 + 4 or
 * 3 + 3 + 3): which tile a row lands in changes no step of its own. */

void specd_matmul(const gg_linear *w, const void *x, int64_t M, float *y, int threads)
{
    const type_info *t = type_of(w->type);
    if (!t || M <= 0) return;
    const int64_t N = w->N, K = w->K, wrow = K / t->block * t->bytes, xs = specd_act_row_bytes(t->act, K);
    const uint8_t *W = (const uint8_t *)w->data, *X = (const uint8_t *)x;
    const float *bias = w->bias;
    const int64_t chunks = (N + NCHUNK - 1) / NCHUNK, tiles = (M + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * NCHUNK, n1 = n0 + NCHUNK < N ? n0 + NCHUNK : N;
        for (int64_t i = 0, m0 = 0; i < tiles; i++) {
            const int R = (int)(M / tiles + (i < M % tiles));
            for (int64_t n = n0; n < n1; n++) {
                float s[TILE_ALLOC];
                t->tiles[R - 1](W + n * wrow, X + m0 * xs, xs, K, s);
                for (int r = 0; r < R; r++) y[(m0 + r) * N + n] = bias ? s[r] + bias[n] : s[r];
            }
            m0 += R;
        }
    }
}

void specd_dequantize_rows(const gg_linear *w, const int64_t *rows, int64_t M, float *out)
{
    const type_info *t = type_of(w->type);
    if (!t) return;
    const int64_t K = w->K, nb = K / t->block, wrow = nb * t->bytes;
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *row = (const uint8_t *)w->data + rows[m] * wrow;
        for (int64_t b = 0; b < nb; b++) t->deq(row + b * t->bytes, out + m * K + b * t->block);
    }
}
