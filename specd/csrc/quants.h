/* The GGUF block formats specd multiplies as stored (specd/quants.py holds the registry).
 *
 * A weight is a GGUF tensor [N, K]: N rows of K values, each row its K / block blocks of the stored
 * type, rows contiguous (the file's bytes, memory-mapped). A linear multiplies activation rows
 * quantised the way ggml quantises them for that weight type (its "vec_dot_type"): Q8_K for the
 * K-quants, Q8_0 for Q8_0 and Q5_0, float32 for F32 / F16 / BF16.
 *
 * Batch invariance: y[m][n] is computed by the same instructions in the same order whatever M is
 * and whichever tile holds row m: integer block dots (exact), then the float sum over blocks in a
 * fixed order. Threads split n, never K.
 */
#ifndef SPECD_QUANTS_H
#define SPECD_QUANTS_H
#include <stddef.h>
#include <stdint.h>

/* ggml's type ids (ggml.h enum ggml_type): what GGUF stores per tensor. */
enum { GG_F32 = 0, GG_F16 = 1, GG_Q4_0 = 2, GG_Q5_0 = 6, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14,
       GG_BF16 = 30 };

/* Activation row formats. */
enum { ACT_F32 = 0, ACT_Q8_0 = 1, ACT_Q8_K = 2 };

/* One quantised activation block of each format (ggml's block_q8_0 keeps d as fp16; we keep the
 * float value of that fp16, so the numbers are ggml's and no conversion runs in the inner loop). */
typedef struct { float d; int8_t qs[32]; } gg_q8_0; /* 36 bytes */
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } gg_q8_K; /* ggml's block_q8_K, 292 bytes */

/* A linear's weight as stored: data points at row 0's first block. bias [N] float32 or NULL.
 * packed: NULL, or the same weight repacked into column panels by specd_repack (the products then
 * read it instead of data; embedding lookups keep reading data). */
typedef struct {
    const void *data;
    int64_t type; /* a GG_* id */
    int64_t N, K;
    const float *bias;
    const void *packed;
} gg_linear;

/* The activation format a weight type multiplies, or -1 when the type has no kernel. */
int specd_act_of(int64_t type);
/* Bytes of one activation row of K values in format act (K a multiple of its block). */
int64_t specd_act_row_bytes(int64_t act, int64_t K);
/* x [M, K] float32 -> M rows in format act (ACT_F32 copies), each row quantised on its own. */
void specd_quantize_rows(const float *x, int64_t M, int64_t K, int64_t act, void *out, int threads);
/* y [M, N] = x @ W.T (+ bias), x being M activation rows in W's format (specd_act_of(W->type)).
 * Each y[m][n] independent of M and of the other rows (see above). */
void specd_matmul(const gg_linear *w, const void *x, int64_t M, float *y, int threads);
/* Bytes of W [N, K] of `type` repacked into column panels (quants.c: the same integers and scales,
 * laid out so each output column accumulates in its own vector lane), or 0 when this build has no
 * panel kernel for the type. The layout belongs to the library build (march) that made it. */
int64_t specd_repack_bytes(int64_t type, int64_t N, int64_t K);
/* w's stored rows -> out (specd_repack_bytes bytes, 64-byte aligned for speed; threads split the
 * panels). The caller then sets w->packed = out. Products through the panels are batch-invariant
 * too; they differ from the stored path's in float rounding only. */
void specd_repack(const gg_linear *w, void *out, int threads);
/* Rows `rows[0..M)` of W dequantised to float32: out [M, K] (an embedding lookup). */
void specd_dequantize_rows(const gg_linear *w, const int64_t *rows, int64_t M, float *out);

#endif
