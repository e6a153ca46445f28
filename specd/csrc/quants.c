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
 *
 * A weight repacked at load (specd_repack, gg_linear.packed) is multiplied by the panel kernels
 * of the "Repacked panels" section instead: one output column per vector lane, so no horizontal
 * sums and several rows sharing each decoded weight vector; batch-invariant by the same argument
 * (exact integer block dots, then a fixed float order per lane). Its float steps differ from the
 * stored path's, so a repacked weight's products differ from the stored one's in rounding.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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
 * Repacked panels (specd_repack_bytes / specd_repack / gg_linear.packed).
 *
 * The same quantised integers, scales and fp16 super-block scales as the stored blocks (a repack,
 * not a requantisation), reorganised so that one vector holds 4 consecutive values of each of 16
 * output columns (byte 4 * col + i: column col's value k0 + i): each activation's 4 bytes are
 * broadcast and one dpbusd (or maddubs + madd) adds the 4 products of every column into that
 * column's own int32 lane. No horizontal sums; a tile of rows shares each decoded weight vector.
 *
 * Layout: columns in panels of PW = 16 (the last one padded with zero columns); a panel is its
 * NB blocks' integer parts (QB bytes each, multiples of 64), then their scale parts (SB bytes
 * each), the whole rounded up to 64 bytes. Per block, per type ("vector" = 64 bytes, 4 values
 * of each of the 16 columns; col-arrays below are [.][16 columns]):
 *   Q4_K: qs [8 sub-blocks j][4 c][64]: low nibble k = 32j + 4c + i, high nibble k = 32j + 16 + 4c + i
 *         (Q5_K: then the fifth bits, 64 bytes per j for its 8 vectors t, t < 4 the low nibbles of
 *         c = t, else the high nibbles of c = t - 4, laid out as put_fifth says);
 *         scales sc [8 j][16] u8, mins [4 i][16][2] u8 (m_2i, m_2i+1), d [16] fp16, dmin [16] fp16.
 *   Q6_K: per 16-value sub-block j: ql0, ql1, qh (3 vectors): values 0..63 of k = 16j + 4t + i:
 *         low 4 bits of t = 0/1 in ql0's low/high nibbles, t = 2/3 in ql1's; the top 2 bits of t at
 *         bits 2t, 2t + 1 of qh; scales [16 j][16] int8, d [16] fp16.
 *   Q8_0: 8 vectors (k = 4t + i) of the int8 values; d [16] fp16.
 *   Q5_0 / Q4_0: 4 vectors of nibbles (low: k = 4c + i, high: k = 16 + 4c + i), Q5_0 then the fifth
 *         bits of its 8 vectors t (k = 4t + i: t < 4 low nibbles, else high; put_fifth); d [16] fp16.
 *
 * The product, per (row, column) lane and block: isum = the exact int32 block dot with the type's
 * integer sub-block scales (dot of sub-block j times sc_j, int32 mullo), the unsigned storage's
 * offset taken out exactly (Q6_K's 32, Q5_0's 16, Q4_0's 8, Q8_0's 128 on VNNI: the dot starts at
 * -offset * sum(x), computed per row before the tiles), imin = sum_j m_j * sum_j(x) for Q4_K / Q5_K;
 * then acc += (d_w * d_x) * isum [- (dmin_w * d_x) * imin] in float, block after block. The
 * float steps are lane-wise, in one order, whatever the tile's rows or strips, so every row of
 * any M equals its one-row product bit for bit. AVX-512 builds take a panel (16 lanes) at a time;
 * AVX2 builds the same layout as two strips of 8 columns (the 32-byte halves).
 */
/* Tiles: up to PK_TILE rows times PK_P strips (16 columns each in AVX-512 builds, 8 in AVX2
 * builds). Measured on the target's shapes with weights streaming from DRAM: one row goes fastest
 * with more strips at once (more independent weight streams in flight); several rows go beside
 * PK_P_ROWS strips, which in AVX2 builds keeps a tile's dots in registers (AMD EPYC, AVX2: 0.81x
 * the time per extra row on Q4_K/Q6_K at 8960x1536, 0.91x at 1536x8960). */
#define PW 16
#if WIDE
#define LANES 16
#define PK_TILE 5
#define PK_P 3
#define PK_P_ROWS 3
#else
#define LANES 8
#define PK_TILE 5   /* a verification of 4 drafts in one tile (as 3 + 2 rows: 1.08-1.10x the time) */
#define PK_P 4
#define PK_P_ROWS 2 /* strips beside a tile of several rows: 4 x 4 int16 dots would spill 16 registers */
#endif
#define SPP (PW / LANES) /* strips per panel */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define VNNI 1
#else
#define VNNI 0
#endif

#if WIDE
typedef __m512i vi;
typedef __m512 vf;
INLINE vi vload(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
INLINE vi vzero(void) { return _mm512_setzero_si512(); }
INLINE vi vset8(int c) { return _mm512_set1_epi8((char)c); }
INLINE vi vset16(int c) { return _mm512_set1_epi16((short)c); }
INLINE vi vset32(int32_t c) { return _mm512_set1_epi32(c); }
INLINE vi vand(vi a, vi b) { return _mm512_and_si512(a, b); }
INLINE vi vor(vi a, vi b) { return _mm512_or_si512(a, b); }
INLINE vi vxor(vi a, vi b) { return _mm512_xor_si512(a, b); }
INLINE vi vsrl16(vi a, int n) { return _mm512_srli_epi16(a, n); }
INLINE vi vsll16(vi a, int n) { return _mm512_slli_epi16(a, n); }
INLINE vi vadd32(vi a, vi b) { return _mm512_add_epi32(a, b); }
INLINE vi vmullo(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
INLINE vi vu8to32(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
INLINE vi vs8to32(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
INLINE vi vu8to16(const uint8_t *p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vf vhalf(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vf vfzero(void) { return _mm512_setzero_ps(); }
INLINE vf vcvt(vi a) { return _mm512_cvtepi32_ps(a); }
INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
INLINE vf vsetps(float f) { return _mm512_set1_ps(f); }
/* v + 16 in the bytes whose fifth bit is set: vector t of a group of 8 (see put_fifth), its 64 bits a mask */
INLINE vi vfifth(vi v, const uint8_t *group, int h, int t)
{
    uint64_t m;
    memcpy(&m, group + 8 * t + h / 2, 8);
    return _mm512_mask_add_epi8(v, _cvtu64_mask64(m), v, _mm512_set1_epi8(16));
}
#if VNNI
INLINE vi vdot(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
/* vdot against the 4 signed bytes at p broadcast, the broadcast folded into the instruction's
 * memory operand (compilers keep a separate vpbroadcastd, one more uop a product) */
INLINE vi vdotx(vi acc, vi u, const uint8_t *p)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}
#define HAVE_DOTX 1
INLINE vi vdotw(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
INLINE vi vdot(vi acc, vi u, vi s)
{
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
INLINE vi vdotw(vi acc, vi a, vi b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
INLINE vi vabs8(vi a) { return _mm512_abs_epi8(a); }
INLINE vi vmaddubs(vi u, vi s) { return _mm512_maddubs_epi16(u, s); }
INLINE vi vadd16(vi a, vi b) { return _mm512_add_epi16(a, b); }
INLINE vi vsll32(vi a, int n) { return _mm512_slli_epi32(a, n); }
INLINE vi vsub32(vi a, vi b) { return _mm512_sub_epi32(a, b); }
/* x with the sign of w byte by byte (x where w > 0, -x where w < 0; w = 0 meets |w| = 0) */
INLINE vi vsign8(vi x, vi w) { return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x); }
INLINE void vstore(float *y, vf v, const float *bias, int n)
{
    const __mmask16 keep = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias));
    _mm512_mask_storeu_ps(y, keep, v);
}
#else
typedef __m256i vi;
typedef __m256 vf;
INLINE vi vload(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE vi vzero(void) { return _mm256_setzero_si256(); }
INLINE vi vset8(int c) { return _mm256_set1_epi8((char)c); }
INLINE vi vset16(int c) { return _mm256_set1_epi16((short)c); }
INLINE vi vset32(int32_t c) { return _mm256_set1_epi32(c); }
INLINE vi vand(vi a, vi b) { return _mm256_and_si256(a, b); }
INLINE vi vor(vi a, vi b) { return _mm256_or_si256(a, b); }
INLINE vi vxor(vi a, vi b) { return _mm256_xor_si256(a, b); }
INLINE vi vsrl16(vi a, int n) { return _mm256_srli_epi16(a, n); }
INLINE vi vsll16(vi a, int n) { return _mm256_slli_epi16(a, n); }
INLINE vi vadd32(vi a, vi b) { return _mm256_add_epi32(a, b); }
INLINE vi vmullo(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
INLINE vi vu8to32(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
INLINE vi vs8to32(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
INLINE vi vu8to16(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }
INLINE vf vhalf(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE vf vfzero(void) { return _mm256_setzero_ps(); }
INLINE vf vcvt(vi a) { return _mm256_cvtepi32_ps(a); }
INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
INLINE vf vsetps(float f) { return _mm256_set1_ps(f); }
/* v + 16 in the bytes whose fifth bit is set: vector t of a group of 8 (see put_fifth), bit t of
 * each byte of its half-panel's plane: a shift and a mask */
INLINE vi vfifth(vi v, const uint8_t *group, int h, int t)
{
    const vi plane = vload(group + 4 * h);
    return vor(v, vand(t <= 4 ? vsll16(plane, 4 - t) : vsrl16(plane, t - 4), vset8(16)));
}
#if VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
INLINE vi vdot(vi acc, vi u, vi s) { return _mm256_dpbusd_epi32(acc, u, s); }
INLINE vi vdotw(vi acc, vi a, vi b) { return _mm256_dpwssd_epi32(acc, a, b); }
#else
INLINE vi vdot(vi acc, vi u, vi s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
INLINE vi vdotw(vi acc, vi a, vi b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#endif
#else
/* maddubs pairs cannot saturate here: the unsigned weights are at most 63 (|x| <= 127), or |w| <= 128
 * for Q8_0 (see pk_q_0) */
INLINE vi vdot(vi acc, vi u, vi s)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
INLINE vi vdotw(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif
INLINE vi vabs8(vi a) { return _mm256_abs_epi8(a); }
INLINE vi vmaddubs(vi u, vi s) { return _mm256_maddubs_epi16(u, s); }
INLINE vi vadd16(vi a, vi b) { return _mm256_add_epi16(a, b); }
INLINE vi vsll32(vi a, int n) { return _mm256_slli_epi32(a, n); }
INLINE vi vsub32(vi a, vi b) { return _mm256_sub_epi32(a, b); }
INLINE vi vsign8(vi x, vi w) { return _mm256_sign_epi8(x, w); }
INLINE void vstore(float *y, vf v, const float *bias, int n)
{
    float out[8];
    _mm256_storeu_ps(out, v);
    for (int i = 0; i < n && i < 8; i++) y[i] = bias ? out[i] + bias[i] : out[i];
}
#endif

/* 4 activation bytes broadcast to every lane. */
INLINE vi vbcast(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return vset32(v);
}
/* Each lane's int8 at a (low int16 half) and at b (high half), sign-extended. */
INLINE vi vpair16(const uint8_t *a, const uint8_t *b) { return vor(vand(vs8to32(a), vset32(0xFFFF)), vsll32(vs8to32(b), 16)); }
#ifndef HAVE_DOTX
INLINE vi vdotx(vi acc, vi u, const uint8_t *p) { return vdot(acc, u, vbcast(p)); }
#endif

/* What a tile call needs: the packed weight, its first strip, R activation rows (x, row stride
 * xs bytes) with their per-row integer extras (ex, stride exs int32s), and R output rows. */
typedef struct {
    const uint8_t *w;
    int64_t pbytes, NB, s0;
    const uint8_t *x;
    int64_t xs;
    const int32_t *ex;
    int64_t exs;
    const float *bias;
    float *y;
    int64_t N;
} pk_args;

/* The tiles' loops over rows, strips and vectors are unrolled (their bounds are constants of each
 * instance) so that accumulators live in registers. */
#define UNROLL _Pragma("GCC unroll 16")
/* Without VNNI the sub-block loops stay rolled: unrolled, GCC hoists every step's decoded weights
 * and spills the int16 sums (measured ~0.85x the time at 4 to 16 rows rolled; VNNI builds ~1.03x). */
#if VNNI
#define UNROLL_C UNROLL
#else
#define UNROLL_C _Pragma("GCC unroll 1")
#endif

/* Strip p of a tile: its panel's integer part (at the strip's bytes), scale part and first
 * column h within the panel (0, or 8 for an AVX2 build's second half). */
#define STRIPS(QB)                                                                                   \
    const uint8_t *qp[PK_P], *sp[PK_P];                                                              \
    int h[PK_P];                                                                                     \
    UNROLL for (int p = 0; p < P; p++) {                                                             \
        const int64_t strip = A->s0 + p;                                                             \
        const uint8_t *panel = A->w + strip / SPP * A->pbytes;                                       \
        h[p] = (int)(strip % SPP) * LANES;                                                           \
        qp[p] = panel + 4 * h[p];                                                                    \
        sp[p] = panel + A->NB * (QB);                                                                \
    }

/* y[r][n] = acc (+ bias[n]) for the strip's columns below N. */
#define STORE()                                                                                      \
    UNROLL for (int p = 0; p < P; p++) {                                                             \
        const int64_t n = (A->s0 + p) * LANES;                                                       \
        const int left = (int)(A->N - n < LANES ? A->N - n : LANES);                                 \
        UNROLL for (int r = 0; r < R; r++)                                                           \
            vstore(A->y + r * A->N + n, acc[r][p], A->bias ? A->bias + n : 0, left);                 \
    }

/* Q4_K (HIGH 0) and Q5_K (HIGH 1). */
#define QB_Q4_K 2048
#define QB_Q5_K 2560
#define SB_QK45 320
#if !WIDE && !VNNI
#define Q4K_ASM 1
/* One c step of a Q4_K tile of R = 2..5 rows by 2 strips in AVX2 builds, in assembly: the same
 * maddubs and int16 adds as the C loop (the same integers), but its 2R dots stay in registers, where
 * GCC's allocation spills half of them to the stack every step. The dots, four weight vectors, one
 * broadcast and one product fill the 16 registers; the nibble mask is read from memory. The weights
 * and activations it reads stay unchanged through a product, so the statements name no memory. The
 * prefetch a few blocks ahead keeps a tile of a few rows, neither bound by memory nor by compute,
 * from waiting on each new line (AMD EPYC Zen 2: 0.88x the time of a two-row pass). */
#define Q4K_ROW(X, r)                                                                                \
    "vpbroadcastd " X ", %[t]\n\t"                                                                   \
    "vpmaddubsw %[t], %[lo0], %[m]\n\t"                                                              \
    "vpaddw %[m], %[d" #r "0], %[d" #r "0]\n\t"                                                      \
    "vpmaddubsw %[t], %[lo1], %[m]\n\t"                                                              \
    "vpaddw %[m], %[d" #r "1], %[d" #r "1]\n\t"                                                      \
    "vpbroadcastd 16" X ", %[t]\n\t"                                                                 \
    "vpmaddubsw %[t], %[hi0], %[m]\n\t"                                                              \
    "vpaddw %[m], %[d" #r "0], %[d" #r "0]\n\t"                                                      \
    "vpmaddubsw %[t], %[hi1], %[m]\n\t"                                                              \
    "vpaddw %[m], %[d" #r "1], %[d" #r "1]\n\t"
#define Q4K_DECODE                                                                                   \
    "prefetcht0 1024(%[w0])\n\t"                                                                     \
    "vmovdqu (%[w0]), %[hi0]\n\t"                                                                    \
    "vpand %[m4], %[hi0], %[lo0]\n\t"                                                                \
    "vpsrlw $4, %[hi0], %[hi0]\n\t"                                                                  \
    "vpand %[m4], %[hi0], %[hi0]\n\t"                                                                \
    "vmovdqu (%[w1]), %[hi1]\n\t"                                                                    \
    "vpand %[m4], %[hi1], %[lo1]\n\t"                                                                \
    "vpsrlw $4, %[hi1], %[hi1]\n\t"                                                                  \
    "vpand %[m4], %[hi1], %[hi1]\n\t"
#define Q4K_DOTS(r) [d##r##0] "+x"(dot[r][0]), [d##r##1] "+x"(dot[r][1])
#define Q4K_NIBBLES_OUT [lo0] "=&x"(lo0), [hi0] "=&x"(hi0), [lo1] "=&x"(lo1), [hi1] "=&x"(hi1)
#define Q4K_NIBBLES_IN [lo0] "x"(lo0), [hi0] "x"(hi0), [lo1] "x"(lo1), [hi1] "x"(hi1)
#define Q4K_SCRATCH [t] "=&x"(t), [m] "=&x"(m)
#define Q4K_X0 "(%[x])"
#define Q4K_X1 "(%[x],%[xs],1)"
#define Q4K_X2 "(%[x],%[xs],2)"
#define Q4K_X3 "(%[x3])"
#define Q4K_X4 "(%[x3],%[xs],1)"
INLINE void q4k_step(const int R, vi dot[][PK_P], const uint8_t *w0, const uint8_t *w1, const uint8_t *x, int64_t xs,
                     const vi *m4)
{
    vi lo0, hi0, lo1, hi1, t, m;
    const uint8_t *x3 = x + 3 * xs;
    if (R == 2)
        __asm__(Q4K_DECODE Q4K_ROW(Q4K_X0, 0) Q4K_ROW(Q4K_X1, 1)
                : Q4K_DOTS(0), Q4K_DOTS(1), Q4K_NIBBLES_OUT, Q4K_SCRATCH
                : [w0] "r"(w0), [w1] "r"(w1), [m4] "m"(*m4), [x] "r"(x), [xs] "r"(xs));
    else
        __asm__(Q4K_DECODE Q4K_ROW(Q4K_X0, 0) Q4K_ROW(Q4K_X1, 1) Q4K_ROW(Q4K_X2, 2)
                : Q4K_DOTS(0), Q4K_DOTS(1), Q4K_DOTS(2), Q4K_NIBBLES_OUT, Q4K_SCRATCH
                : [w0] "r"(w0), [w1] "r"(w1), [m4] "m"(*m4), [x] "r"(x), [xs] "r"(xs));
    if (R == 4)
        __asm__(Q4K_ROW(Q4K_X3, 3)
                : Q4K_DOTS(3), Q4K_SCRATCH
                : Q4K_NIBBLES_IN, [x3] "r"(x3), [xs] "r"(xs));
    else if (R == 5)
        __asm__(Q4K_ROW(Q4K_X3, 3) Q4K_ROW(Q4K_X4, 4)
                : Q4K_DOTS(3), Q4K_DOTS(4), Q4K_SCRATCH
                : Q4K_NIBBLES_IN, [x3] "r"(x3), [xs] "r"(xs));
}
#else
#define Q4K_ASM 0
#endif
/* Strip p's vector c of sub-block j: its low and high nibbles, Q5_K's with their fifth bits. */
#define QK45_NIBBLES(p, c, LO, HI)                                                                         \
    do {                                                                                                   \
        const vi v_ = vload(qp[p] + b * QB + (4 * j + (c)) * 64);                                          \
        LO = vand(v_, m4), HI = vand(vsrl16(v_, 4), m4);                                                   \
        if (HIGH) {                                                                                        \
            const uint8_t *group_ = qp[p] - 4 * h[p] + b * QB + QB_Q4_K + 64 * j;                          \
            LO = vfifth(LO, group_, h[p], (c)), HI = vfifth(HI, group_, h[p], (c) + 4);                    \
        }                                                                                                  \
    } while (0)
INLINE void pk_qk45(const pk_args *A, const int R, const int P, const int HIGH)
{
    const int64_t QB = HIGH ? QB_Q5_K : QB_Q4_K;
    STRIPS(QB)
    const vi m4 = vset8(0x0F);
    vf acc[PK_TILE][PK_P];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int p = 0; p < P; p++) acc[r][p] = vfzero();
    for (int64_t b = 0; b < A->NB; b++) {
        vi isum[PK_TILE][PK_P];
        UNROLL for (int r = 0; r < R; r++)
            UNROLL for (int p = 0; p < P; p++) isum[r][p] = vzero();
        for (int j = 0; j < 8; j++) {
#if VNNI
            vi dot[PK_TILE][PK_P];
            UNROLL for (int r = 0; r < R; r++)
                UNROLL for (int p = 0; p < P; p++) dot[r][p] = vzero();
            UNROLL for (int c = 0; c < 4; c++) {
                vi lo[PK_P], hi[PK_P];
                UNROLL for (int p = 0; p < P; p++) QK45_NIBBLES(p, c, lo[p], hi[p]);
                UNROLL for (int r = 0; r < R; r++) {
                    const uint8_t *xq = A->x + r * A->xs + b * (int64_t)sizeof(gg_q8_K) + 4 + 32 * j + 4 * c;
                    UNROLL for (int p = 0; p < P; p++) dot[r][p] = vdotx(vdotx(dot[r][p], lo[p], xq), hi[p], xq + 16);
                }
            }
            UNROLL for (int p = 0; p < P; p++) {
                const vi sc = vu8to32(sp[p] + b * SB_QK45 + 16 * j + h[p]);
                UNROLL for (int r = 0; r < R; r++) isum[r][p] = vadd32(isum[r][p], vmullo(dot[r][p], sc));
            }
#else
            /* dot's int16 halves sum maddubs pairs (each |.| <= 2 * 15 * 127, or 2 * 31 * 127 for
             * Q5_K) over 4 c (Q5_K: 2), below 2^15, so any order of the adds gives the same sums; one
             * madd then applies the scale and joins the halves. Tiles of several rows by 2 strips
             * take q4k_step, which keeps their dots in registers. */
            vi dot[PK_TILE][PK_P];
            UNROLL for (int r = 0; r < R; r++)
                UNROLL for (int p = 0; p < P; p++) dot[r][p] = vzero();
            UNROLL_C for (int c = 0; c < 4; c++) {
                vi lo[PK_P], hi[PK_P];
                const uint8_t *x0 = A->x + b * (int64_t)sizeof(gg_q8_K) + 4 + 32 * j + 4 * c;
#if Q4K_ASM
                if (!HIGH && P == 2 && R >= 2) {
                    const int64_t at = b * QB + (4 * j + c) * 64;
                    q4k_step(R, dot, qp[0] + at, qp[1] + at, x0, A->xs, &m4);
                } else
#endif
                {
                    UNROLL for (int p = 0; p < P; p++) QK45_NIBBLES(p, c, lo[p], hi[p]);
                    UNROLL for (int r = 0; r < R; r++) {
                        const uint8_t *xq = x0 + r * A->xs;
                        const vi xl = vbcast(xq);
                        UNROLL for (int p = 0; p < P; p++) dot[r][p] = vadd16(dot[r][p], vmaddubs(lo[p], xl));
                        const vi xh = vbcast(xq + 16);
                        UNROLL for (int p = 0; p < P; p++) dot[r][p] = vadd16(dot[r][p], vmaddubs(hi[p], xh));
                    }
                }
                if (c == 3 || (HIGH && c == 1)) {
                    UNROLL for (int p = 0; p < P; p++) {
                        const vi sc = vu8to32(sp[p] + b * SB_QK45 + 16 * j + h[p]);
                        const vi sc2 = vor(sc, vsll32(sc, 16)); /* the sub-block scale in both int16 halves */
                        UNROLL for (int r = 0; r < R; r++) isum[r][p] = vdotw(isum[r][p], dot[r][p], sc2), dot[r][p] = vzero();
                    }
                }
            }
#endif
        }
        UNROLL for (int p = 0; p < P; p++) {
            const uint8_t *s = sp[p] + b * SB_QK45;
            vi mins[4];
            UNROLL for (int i = 0; i < 4; i++) mins[i] = vu8to16(s + 128 + 32 * i + 2 * h[p]);
            const vf d = vhalf(s + 256 + 2 * h[p]), dmin = vhalf(s + 288 + 2 * h[p]);
            UNROLL for (int r = 0; r < R; r++) {
                const int32_t *e = A->ex + r * A->exs + 4 * b;
                vi imin = vzero();
                UNROLL for (int i = 0; i < 4; i++) imin = vdotw(imin, mins[i], vset32(e[i]));
                const vf dx = vsetps(((const gg_q8_K *)(A->x + r * A->xs) + b)->d);
                acc[r][p] = vfmadd(vmul(d, dx), vcvt(isum[r][p]), acc[r][p]);
                acc[r][p] = vfnmadd(vmul(dmin, dx), vcvt(imin), acc[r][p]);
            }
        }
    }
    STORE()
}

/* Q6_K: unsigned values 0..63, dot_j starting at -32 * bsum_j (ex), times the int8 scale. */
#define QB_Q6_K 3072
#define SB_Q6_K 288
INLINE void pk6(const pk_args *A, const int R, const int P)
{
    STRIPS(QB_Q6_K)
    const vi m4 = vset8(0x0F), m30 = vset8(0x30);
    vf acc[PK_TILE][PK_P];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int p = 0; p < P; p++) acc[r][p] = vfzero();
    for (int64_t b = 0; b < A->NB; b++) {
        vi isum[PK_TILE][PK_P];
        UNROLL for (int r = 0; r < R; r++)
            UNROLL for (int p = 0; p < P; p++) isum[r][p] = vzero();
        for (int j = 0; j < 16; j++) {
            vi v[4][PK_P];
            UNROLL for (int p = 0; p < P; p++) {
                const uint8_t *q = qp[p] + b * QB_Q6_K + 192 * j;
                if (!WIDE && !VNNI && R > 1) { /* as in q4k_step */
                    _mm_prefetch((const char *)q + 1536, _MM_HINT_T0);
                    _mm_prefetch((const char *)q + 1600, _MM_HINT_T0);
                    _mm_prefetch((const char *)q + 1664, _MM_HINT_T0);
                }
                const vi a = vload(q), c = vload(q + 64), hb = vload(q + 128);
                v[0][p] = vor(vand(a, m4), vand(vsll16(hb, 4), m30));
                v[1][p] = vor(vand(vsrl16(a, 4), m4), vand(vsll16(hb, 2), m30));
                v[2][p] = vor(vand(c, m4), vand(hb, m30));
                v[3][p] = vor(vand(vsrl16(c, 4), m4), vand(vsrl16(hb, 2), m30));
            }
#if VNNI
            vi dot[PK_TILE][PK_P];
            UNROLL for (int r = 0; r < R; r++) {
                const uint8_t *xq = A->x + r * A->xs + b * (int64_t)sizeof(gg_q8_K) + 4 + 16 * j;
                const vi start = vset32(A->ex[r * A->exs + 16 * b + j]);
                UNROLL for (int p = 0; p < P; p++) dot[r][p] = start;
                UNROLL for (int t = 0; t < 4; t++)
                    UNROLL for (int p = 0; p < P; p++) dot[r][p] = vdotx(dot[r][p], v[t][p], xq + 4 * t);
            }
            UNROLL for (int p = 0; p < P; p++) {
                const vi sc = vs8to32(sp[p] + b * SB_Q6_K + 16 * j + h[p]);
                UNROLL for (int r = 0; r < R; r++) isum[r][p] = vadd32(isum[r][p], vmullo(dot[r][p], sc));
            }
#else
            /* two maddubs pairs (each |.| <= 2 * 63 * 127) per int16 half, then one madd by the scale
             * in both halves; the -32 offset is taken out per block below */
            vi sc2[PK_P];
            UNROLL for (int p = 0; p < P; p++) sc2[p] = vpair16(sp[p] + b * SB_Q6_K + 16 * j + h[p], sp[p] + b * SB_Q6_K + 16 * j + h[p]);
            UNROLL for (int r = 0; r < R; r++) {
                const uint8_t *xq = A->x + r * A->xs + b * (int64_t)sizeof(gg_q8_K) + 4 + 16 * j;
                const vi x0 = vbcast(xq), x1 = vbcast(xq + 4), x2 = vbcast(xq + 8), x3 = vbcast(xq + 12);
                UNROLL for (int p = 0; p < P; p++) {
                    isum[r][p] = vdotw(isum[r][p], vadd16(vmaddubs(v[0][p], x0), vmaddubs(v[1][p], x1)), sc2[p]);
                    isum[r][p] = vdotw(isum[r][p], vadd16(vmaddubs(v[2][p], x2), vmaddubs(v[3][p], x3)), sc2[p]);
                }
            }
#endif
        }
#if !VNNI
        /* isum -= 32 * sum_j sc_j * bsum_j: the sub-block sums of x, two j a madd */
        vi off[PK_TILE][PK_P];
        UNROLL for (int r = 0; r < R; r++)
            UNROLL for (int p = 0; p < P; p++) off[r][p] = vzero();
        UNROLL for (int i = 0; i < 8; i++)
            UNROLL for (int p = 0; p < P; p++) {
                const uint8_t *sc = sp[p] + b * SB_Q6_K + 32 * i + h[p];
                const vi pair = vpair16(sc, sc + 16);
                UNROLL for (int r = 0; r < R; r++)
                    off[r][p] = vdotw(off[r][p], pair, vbcast((const uint8_t *)(((const gg_q8_K *)(A->x + r * A->xs) + b)->bsums + 2 * i)));
            }
        UNROLL for (int r = 0; r < R; r++)
            UNROLL for (int p = 0; p < P; p++) isum[r][p] = vsub32(isum[r][p], vsll32(off[r][p], 5));
#endif
        UNROLL for (int p = 0; p < P; p++) {
            const vf d = vhalf(sp[p] + b * SB_Q6_K + 256 + 2 * h[p]);
            UNROLL for (int r = 0; r < R; r++) {
                const vf dx = vsetps(((const gg_q8_K *)(A->x + r * A->xs) + b)->d);
                acc[r][p] = vfmadd(vmul(d, dx), vcvt(isum[r][p]), acc[r][p]);
            }
        }
    }
    STORE()
}

/* Q8_0 / Q5_0 / Q4_0 against Q8_0 rows: one block of 32 = 8 vectors; the dot starts at
 * -offset * sum(x) (ex) and acc += (d_w * d_x) * isum. Q8_0 without VNNI multiplies |w| by x
 * with w's sign (maddubs pairs then stay within int16: 128 * 127 * 2 < 2^15) and has no offset. */
#define QB_Q8_0 512
#define QB_Q5_0 320
#define QB_Q4_0 256
#define SB_Q_0 32
/* Strip p's nibble vector c of block b: its low nibbles (vector t = c) and high (t = c + 4), Q5_0's
 * with their fifth bits. */
#define Q0_NIBBLES(p, c, LO, HI)                                                                           \
    do {                                                                                                   \
        const uint8_t *q_ = qp[p] + b * QB;                                                                \
        const vi n_ = vload(q_ + 64 * (c));                                                                \
        LO = vand(n_, m4), HI = vand(vsrl16(n_, 4), m4);                                                   \
        if (T == TYPE_Q5_0) {                                                                              \
            LO = vfifth(LO, q_ - 4 * h[p] + 256, h[p], (c));                                               \
            HI = vfifth(HI, q_ - 4 * h[p] + 256, h[p], (c) + 4);                                           \
        }                                                                                                  \
    } while (0)
INLINE void pk_q_0(const pk_args *A, const int R, const int P, const int T)
{
    const int64_t QB = T == TYPE_Q8_0 ? QB_Q8_0 : T == TYPE_Q5_0 ? QB_Q5_0 : QB_Q4_0;
    STRIPS(QB)
    const vi m4 = vset8(0x0F);
    vf acc[PK_TILE][PK_P];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int p = 0; p < P; p++) acc[r][p] = vfzero();
    for (int64_t b = 0; b < A->NB; b++) {
        vi dot[PK_TILE][PK_P];
        UNROLL for (int r = 0; r < R; r++)
            UNROLL for (int p = 0; p < P; p++) dot[r][p] = vset32(A->ex[r * A->exs + b]);
#if VNNI
        vi v[8][PK_P];
        UNROLL for (int p = 0; p < P; p++) {
            const uint8_t *q = qp[p] + b * QB;
            if (T == TYPE_Q8_0) {
                UNROLL for (int t = 0; t < 8; t++) v[t][p] = vxor(vload(q + 64 * t), vset8(0x80));
            } else {
                UNROLL for (int c = 0; c < 4; c++) Q0_NIBBLES(p, c, v[c][p], v[c + 4][p]);
            }
        }
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *xq = A->x + r * A->xs + b * (int64_t)sizeof(gg_q8_0) + 4;
            UNROLL for (int t = 0; t < 8; t++)
                UNROLL for (int p = 0; p < P; p++) dot[r][p] = vdotx(dot[r][p], v[t][p], xq + 4 * t);
        }
#else
        if (T == TYPE_Q8_0) {
            /* |w| times x with w's sign: each maddubs pair up to 2 * 128 * 127, a madd a vector; the
             * int8 weights need no decoding, so a vector is loaded where a row takes it */
            UNROLL for (int r = 0; r < R; r++) {
                const uint8_t *xq = A->x + r * A->xs + b * (int64_t)sizeof(gg_q8_0) + 4;
                UNROLL for (int t = 0; t < 8; t++) {
                    const vi x = vbcast(xq + 4 * t);
                    UNROLL for (int p = 0; p < P; p++) {
                        const vi w = vload(qp[p] + b * QB + 64 * t);
                        dot[r][p] = vdot(dot[r][p], vabs8(w), vsign8(x, w));
                    }
                }
            }
        } else {
            /* The low and high nibbles of two c at a time, every row's dot taking them at once: a tile
             * holds its dots and four vectors, not all eight of each strip. Their four maddubs pairs
             * (each |.| <= 2 * 31 * 127) sum in int16 below 2^15, one madd a group. */
            UNROLL for (int g = 0; g < 2; g++)
                UNROLL for (int p = 0; p < P; p++) {
                    vi v[4];
                    const int t[4] = {2 * g, 2 * g + 1, 2 * g + 4, 2 * g + 5};
                    Q0_NIBBLES(p, 2 * g, v[0], v[2]);
                    Q0_NIBBLES(p, 2 * g + 1, v[1], v[3]);
                    UNROLL for (int r = 0; r < R; r++) {
                        const uint8_t *xq = A->x + r * A->xs + b * (int64_t)sizeof(gg_q8_0) + 4;
                        const vi s = vadd16(vadd16(vmaddubs(v[0], vbcast(xq + 4 * t[0])), vmaddubs(v[1], vbcast(xq + 4 * t[1]))),
                                            vadd16(vmaddubs(v[2], vbcast(xq + 4 * t[2])), vmaddubs(v[3], vbcast(xq + 4 * t[3]))));
                        dot[r][p] = vdotw(dot[r][p], s, vset16(1));
                    }
                }
        }
#endif
        UNROLL for (int p = 0; p < P; p++) {
            const vf d = vhalf(sp[p] + b * SB_Q_0 + 2 * h[p]);
            UNROLL for (int r = 0; r < R; r++) {
                const vf dx = vsetps(((const gg_q8_0 *)(A->x + r * A->xs) + b)->d);
                acc[r][p] = vfmadd(vmul(d, dx), vcvt(dot[r][p]), acc[r][p]);
            }
        }
    }
    STORE()
}

typedef void (*pk_fn)(const pk_args *);
#define PK_FN(NAME, CALL, R, P) \
    static void NAME##_##R##_##P(const pk_args *A) { CALL(R, P); }
/* R = 1..5 rows, P = 1..3 strips (AVX-512 builds) or 1..4 (AVX2) */
#if WIDE
#define PK_ROW(NAME, CALL, R) PK_FN(NAME, CALL, R, 1) PK_FN(NAME, CALL, R, 2) PK_FN(NAME, CALL, R, 3)
#define PK_ENTRY(NAME, R) {NAME##_##R##_1, NAME##_##R##_2, NAME##_##R##_3}
#else
#define PK_ROW(NAME, CALL, R) PK_FN(NAME, CALL, R, 1) PK_FN(NAME, CALL, R, 2) PK_FN(NAME, CALL, R, 3) PK_FN(NAME, CALL, R, 4)
#define PK_ENTRY(NAME, R) {NAME##_##R##_1, NAME##_##R##_2, NAME##_##R##_3, NAME##_##R##_4}
#endif
#define PK_TILES(NAME, CALL)                                                                                 \
    PK_ROW(NAME, CALL, 1) PK_ROW(NAME, CALL, 2) PK_ROW(NAME, CALL, 3) PK_ROW(NAME, CALL, 4)                  \
    PK_ROW(NAME, CALL, 5)                                                                                    \
    static const pk_fn NAME[PK_TILE][PK_P] = {PK_ENTRY(NAME, 1), PK_ENTRY(NAME, 2), PK_ENTRY(NAME, 3),       \
                                              PK_ENTRY(NAME, 4), PK_ENTRY(NAME, 5)};
#define PK_Q4_K(R, P) pk_qk45(A, R, P, 0)
#define PK_Q5_K(R, P) pk_qk45(A, R, P, 1)
#define PK_Q6_K(R, P) pk6(A, R, P)
#define PK_Q8_0(R, P) pk_q_0(A, R, P, TYPE_Q8_0)
#define PK_Q5_0(R, P) pk_q_0(A, R, P, TYPE_Q5_0)
#define PK_Q4_0(R, P) pk_q_0(A, R, P, TYPE_Q4_0)
PK_TILES(pk_q4_K, PK_Q4_K)
PK_TILES(pk_q5_K, PK_Q5_K)
PK_TILES(pk_q6_K, PK_Q6_K)
PK_TILES(pk_q5_0, PK_Q5_0)
PK_TILES(pk_q4_0, PK_Q4_0)
PK_TILES(pk_q8_0, PK_Q8_0)

/* ---- repacking: each stored block decoded to its integers, then placed in the panel ---- */

typedef struct {
    uint8_t q[QK_K];  /* the unsigned stored values (Q8_0: the int8 bytes) */
    uint8_t sc[16];   /* sub-block scales (Q6_K: int8 bytes) */
    uint8_t m[8];     /* sub-block mins */
    uint16_t d, dmin; /* fp16 bits */
} ints;

static void ints_qk45(const uint8_t *p, ints *o, const int HIGH)
{
    const blk_q4_K *b4 = (const blk_q4_K *)p;
    const blk_q5_K *b5 = (const blk_q5_K *)p;
    const uint8_t *scales = HIGH ? b5->scales : b4->scales, *qs = HIGH ? b5->qs : b4->qs;
    o->d = HIGH ? b5->d : b4->d, o->dmin = HIGH ? b5->dmin : b4->dmin;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, scales, &sc, &m);
        o->sc[j] = (uint8_t)sc, o->m[j] = (uint8_t)m;
        for (int l = 0; l < 32; l++) {
            int v = j % 2 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 0x0F;
            if (HIGH) v |= ((b5->qh[l] >> j) & 1) << 4;
            o->q[32 * j + l] = (uint8_t)v;
        }
    }
}

static void ints_q6_K(const uint8_t *p, ints *o)
{
    const blk_q6_K *b = (const blk_q6_K *)p;
    o->d = b->d;
    memcpy(o->sc, b->scales, 16);
    for (int hh = 0; hh < 2; hh++) {
        const uint8_t *ql = b->ql + 64 * hh, *qh = b->qh + 32 * hh;
        for (int l = 0; l < 32; l++) {
            o->q[128 * hh + l] = (uint8_t)((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4);
            o->q[128 * hh + 32 + l] = (uint8_t)((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4);
            o->q[128 * hh + 64 + l] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
            o->q[128 * hh + 96 + l] = (uint8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
        }
    }
}

static void ints_q_0(const uint8_t *p, ints *o, const int T)
{
    memcpy(&o->d, p, 2);
    if (T == TYPE_Q8_0) {
        memcpy(o->q, p + 2, 32);
        return;
    }
    uint32_t qh = 0;
    if (T == TYPE_Q5_0) memcpy(&qh, p + 2, 4);
    const uint8_t *qs = p + (T == TYPE_Q5_0 ? 6 : 2);
    for (int i = 0; i < 16; i++) {
        o->q[i] = (uint8_t)((qs[i] & 0x0F) | ((qh >> i) & 1) << 4);
        o->q[i + 16] = (uint8_t)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
    }
}

/* The fifth bits of the 4 values at v (column col, vector t of a group of 8 vectors, 64 bytes) where
 * the build's kernels read them: AVX-512, vector t's 8 bytes, bit 4 col + i (a byte mask); AVX2, a
 * 32-byte plane per half-panel (8 columns), byte 4 (col % 8) + i, bit t (a shift and a mask apiece). */
INLINE void put_fifth(uint8_t *group, int col, int t, const uint8_t *v)
{
    for (int i = 0; i < 4; i++) {
        const int bit = v[i] >> 4 & 1;
#if WIDE
        group[8 * t + col / 2] |= (uint8_t)(bit << (4 * (col % 2) + i));
#else
        group[32 * (col / 8) + 4 * (col % 8) + i] |= (uint8_t)(bit << t);
#endif
    }
}

/* Column col of block o into the panel's block parts q (integers) and s (scales); both zeroed. */
static void put_qk45(const ints *o, int col, uint8_t *q, uint8_t *s, const int HIGH)
{
    for (int j = 0; j < 8; j++)
        for (int c = 0; c < 4; c++) {
            const uint8_t *lo = o->q + 32 * j + 4 * c, *hi = lo + 16;
            for (int i = 0; i < 4; i++) q[(4 * j + c) * 64 + 4 * col + i] = (uint8_t)((lo[i] & 0x0F) | (hi[i] & 0x0F) << 4);
            if (HIGH) {
                put_fifth(q + QB_Q4_K + 64 * j, col, c, lo);
                put_fifth(q + QB_Q4_K + 64 * j, col, c + 4, hi);
            }
        }
    for (int j = 0; j < 8; j++) s[16 * j + col] = o->sc[j];
    for (int i = 0; i < 4; i++) s[128 + 32 * i + 2 * col] = o->m[2 * i], s[128 + 32 * i + 2 * col + 1] = o->m[2 * i + 1];
    memcpy(s + 256 + 2 * col, &o->d, 2);
    memcpy(s + 288 + 2 * col, &o->dmin, 2);
}

static void put_q6_K(const ints *o, int col, uint8_t *q, uint8_t *s)
{
    for (int j = 0; j < 16; j++) {
        uint8_t *v = q + 192 * j;
        for (int i = 0; i < 4; i++) {
            const int t0 = o->q[16 * j + i], t1 = o->q[16 * j + 4 + i], t2 = o->q[16 * j + 8 + i], t3 = o->q[16 * j + 12 + i];
            v[4 * col + i] = (uint8_t)((t0 & 0xF) | (t1 & 0xF) << 4);
            v[64 + 4 * col + i] = (uint8_t)((t2 & 0xF) | (t3 & 0xF) << 4);
            v[128 + 4 * col + i] = (uint8_t)((t0 >> 4) | (t1 >> 4) << 2 | (t2 >> 4) << 4 | (t3 >> 4) << 6);
        }
        s[16 * j + col] = o->sc[j];
    }
    memcpy(s + 256 + 2 * col, &o->d, 2);
}

static void put_q_0(const ints *o, int col, uint8_t *q, uint8_t *s, const int T)
{
    if (T == TYPE_Q8_0)
        for (int t = 0; t < 8; t++) memcpy(q + 64 * t + 4 * col, o->q + 4 * t, 4);
    else
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 4; i++) q[64 * c + 4 * col + i] = (uint8_t)((o->q[4 * c + i] & 0x0F) | (o->q[16 + 4 * c + i] & 0x0F) << 4);
    if (T == TYPE_Q5_0)
        for (int t = 0; t < 8; t++) put_fifth(q + 256, col, t, o->q + 4 * t);
    memcpy(s + 2 * col, &o->d, 2);
}

/* Per-row integer extras the tiles start from (see the top of this section). */
static void extras_qk45(const uint8_t *x, int64_t NB, int32_t *e)
{
    for (int64_t b = 0; b < NB; b++) {
        const int16_t *bs = ((const gg_q8_K *)x + b)->bsums;
        for (int i = 0; i < 4; i++) {
            const int lo = bs[4 * i] + bs[4 * i + 1], hi = bs[4 * i + 2] + bs[4 * i + 3];
            e[4 * b + i] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)(uint16_t)hi << 16);
        }
    }
}

static void extras_q6_K(const uint8_t *x, int64_t NB, int32_t *e)
{
    for (int64_t b = 0; b < NB; b++)
        for (int j = 0; j < 16; j++) e[16 * b + j] = -32 * ((const gg_q8_K *)x + b)->bsums[j];
}

static void extras_q_0(const uint8_t *x, int64_t NB, int32_t *e, int offset)
{
    for (int64_t b = 0; b < NB; b++) {
        const int8_t *qs = ((const gg_q8_0 *)x + b)->qs;
        int sum = 0;
        for (int i = 0; i < 32; i++) sum += qs[i];
        e[b] = -offset * sum;
    }
}

typedef struct {
    int64_t type;
    int block, qbytes, sbytes, extras; /* values per block, packed bytes per panel and block, extras per block */
    const pk_fn (*tiles)[PK_P];
} pack_info;

static const pack_info PACKS[] = {
    {GG_Q4_K, QK_K, QB_Q4_K, SB_QK45, 4, pk_q4_K},
    {GG_Q5_K, QK_K, QB_Q5_K, SB_QK45, 4, pk_q5_K},
    {GG_Q6_K, QK_K, QB_Q6_K, SB_Q6_K, 16, pk_q6_K},
    {GG_Q8_0, 32, QB_Q8_0, SB_Q_0, 1, pk_q8_0},
    {GG_Q5_0, 32, QB_Q5_0, SB_Q_0, 1, pk_q5_0},
    {GG_Q4_0, 32, QB_Q4_0, SB_Q_0, 1, pk_q4_0},
};

static const pack_info *pack_of(int64_t type)
{
    for (size_t i = 0; i < sizeof PACKS / sizeof *PACKS; i++)
        if (PACKS[i].type == type) return PACKS + i;
    return 0;
}

static int64_t panel_bytes(const pack_info *t, int64_t K)
{
    return (K / t->block * (t->qbytes + t->sbytes) + 63) / 64 * 64;
}

int64_t specd_repack_bytes(int64_t type, int64_t N, int64_t K)
{
    const pack_info *t = pack_of(type);
    if (!t || N <= 0 || K <= 0 || K % t->block) return 0;
    return (N + PW - 1) / PW * panel_bytes(t, K);
}

void specd_repack(const gg_linear *w, void *out, int threads)
{
    const pack_info *t = pack_of(w->type);
    const type_info *ti = type_of(w->type);
    if (!t || !ti || specd_repack_bytes(w->type, w->N, w->K) == 0) return;
    const int64_t N = w->N, NB = w->K / t->block, wrow = NB * ti->bytes, pb = panel_bytes(t, w->K);
    const int64_t panels = (N + PW - 1) / PW;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t p = 0; p < panels; p++) {
        uint8_t *panel = (uint8_t *)out + p * pb;
        memset(panel, 0, pb);
        ints o;
        for (int col = 0; col < PW && p * PW + col < N; col++) {
            const uint8_t *row = (const uint8_t *)w->data + (p * PW + col) * wrow;
            for (int64_t b = 0; b < NB; b++) {
                const uint8_t *blk = row + b * ti->bytes;
                uint8_t *q = panel + b * t->qbytes, *s = panel + NB * t->qbytes + b * t->sbytes;
                switch (w->type) {
                case GG_Q4_K: ints_qk45(blk, &o, 0), put_qk45(&o, col, q, s, 0); break;
                case GG_Q5_K: ints_qk45(blk, &o, 1), put_qk45(&o, col, q, s, 1); break;
                case GG_Q6_K: ints_q6_K(blk, &o), put_q6_K(&o, col, q, s); break;
                case GG_Q8_0: ints_q_0(blk, &o, TYPE_Q8_0), put_q_0(&o, col, q, s, TYPE_Q8_0); break;
                case GG_Q5_0: ints_q_0(blk, &o, TYPE_Q5_0), put_q_0(&o, col, q, s, TYPE_Q5_0); break;
                case GG_Q4_0: ints_q_0(blk, &o, TYPE_Q4_0), put_q_0(&o, col, q, s, TYPE_Q4_0); break;
                }
            }
        }
    }
}

/* The packed product: per-row extras first, then strips in groups of PK_P (threads split the
 * groups, never K), each group's rows in as few tiles as can be, of balanced sizes (which tile
 * and group a row and column land in changes no step of theirs). */
#define XTR 2
#define XTP 3
static void matmul_packed(const gg_linear *w, const pack_info *t, const uint8_t *X, int64_t M, float *y, int threads)
{
    const int64_t K = w->K, N = w->N, NB = K / t->block, act = specd_act_of(w->type);
    const int64_t xs = specd_act_row_bytes(act, K), exs = NB * t->extras;
    int32_t *ex = malloc(sizeof(int32_t) * (M * exs + 1));
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *row = X + m * xs;
        int32_t *e = ex + m * exs;
        switch (w->type) {
        case GG_Q4_K: case GG_Q5_K: extras_qk45(row, NB, e); break;
        case GG_Q6_K: extras_q6_K(row, NB, e); break;
        case GG_Q8_0: extras_q_0(row, NB, e, VNNI ? 128 : 0); break;
        case GG_Q5_0: extras_q_0(row, NB, e, 16); break;
        case GG_Q4_0: extras_q_0(row, NB, e, 8); break;
        }
    }
    const int64_t strips = (N + LANES - 1) / LANES, tiles = (M + PK_TILE - 1) / PK_TILE;
    const int64_t G = M == 1 ? PK_P : PK_P_ROWS, groups = (strips + G - 1) / G;
    const int64_t pb = panel_bytes(t, K);
    /* guided: a thread the OS preempts (the services' other threads share a small host's cores) leaves
     * the groups it has not taken to the others, where a static split would hold the pass for it */
#pragma omp parallel for num_threads(threads) schedule(guided) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t s0 = g * G, P = strips - s0 < G ? strips - s0 : G;
        for (int64_t i = 0, m0 = 0; i < tiles; i++) {
            const int64_t R = M / tiles + (i < M % tiles);
            const pk_args a = {(const uint8_t *)w->packed, pb, NB, s0, X + m0 * xs, xs, ex + m0 * exs, exs,
                               w->bias, y + m0 * N, N};
            t->tiles[R - 1][P - 1](&a);
            m0 += R;
        }
    }
    free(ex);
}

/* ---------------------------------------------------------------------------------------------
 * The product. Columns are split among threads in chunks of NCHUNK; inside a chunk every tile
 * visits each column. M rows go in as few tiles as can be, of balanced sizes (9 rows: 5 + 4 or
 * 3 + 3 + 3): which tile a row lands in changes no step of its own. */

void specd_matmul(const gg_linear *w, const void *x, int64_t M, float *y, int threads)
{
    const type_info *t = type_of(w->type);
    if (!t || M <= 0) return;
    const pack_info *packed = w->packed ? pack_of(w->type) : 0;
    if (packed) {
        matmul_packed(w, packed, (const uint8_t *)x, M, y, threads);
        return;
    }
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
