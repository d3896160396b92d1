/* Paged decode attention on the CPU: vlens.attention.paged_decode_cpu builds this file and calls it.
 *
 * Each row's one query per head meets its keys and values where they lie in the paged cache, through the
 * row's block table, only up to the row's context (and within its sliding window, or its chunk). A task is one range of
 * one row's keys ("split-K", so that a batch of one keeps every thread busy) for all heads. It finds the
 * range's cache slots once; then each KV head's keys, eight at a time, meet the queries of its group (the
 * eight keys stay in L1 across the group), and each head's weighted values are summed in registers, a few
 * columns at a time, over the range. Each task keeps, per head, its maximum score, its sum of weights and
 * its weighted values; the merge rescales the ranges to the row's maximum. Scores, softmax and sums are
 * float32.
 *
 * Layouts (contiguous): q and out [rows, heads, dim]; caches [slots, kv_heads, dim]; tables [rows, pages];
 * context [rows]; sinks [heads] or NULL (gpt-oss: a logit per head that joins the softmax as a key with no
 * value; the merge starts from it). window 0: none; chunk 0: none; softcap 0: none. Returns 0, or 1 when out of
 * memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float floats8 __attribute__((vector_size(32)));

/* the lanes of a and b picked by eight indices, b's counted from 8 (clang's builtin; GCC's older one, for the
 * GCC releases before 12 that lack clang's) */
#if defined(__clang__)
#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t ints8 __attribute__((vector_size(32)));
#define PICK(a, b, ...) __builtin_shuffle(a, b, (ints8){__VA_ARGS__})
#endif

static inline floats8 load8(const float *p)
{
    floats8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* a . b over n floats: eight running sums, added pairwise at the end */
static inline float dot(const float *a, const float *b, int64_t n)
{
    floats8 sums = {0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        sums += load8(a + d) * load8(b + d);
    float s = ((sums[0] + sums[4]) + (sums[1] + sums[5])) + ((sums[2] + sums[6]) + (sums[3] + sums[7]));
    for (; d < n; d++)
        s += a[d] * b[d];
    return s;
}

/* lanes i of a and b added pairwise: [a0+a1, b0+b1, a2+a3, b2+b3, ...] */
static inline floats8 pairs(floats8 a, floats8 b)
{
    return PICK(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
           PICK(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}

/* q . k[i] for eight keys at once: per key eight running sums, then one transposing reduction for all
 * eight (a key's own horizontal sum was most of the time at small head sizes) */
static inline floats8 dot8(const float *q, const float *const k[8], int64_t n)
{
    floats8 s[8] = {{0}};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
        const floats8 x = load8(q + d);
        for (int i = 0; i < 8; i++)
            s[i] += x * load8(k[i] + d);
    }
    const floats8 a = pairs(s[0], s[1]), b = pairs(s[2], s[3]), c = pairs(s[4], s[5]), e = pairs(s[6], s[7]);
    /* [s0, s1, s2, s3 | s4, s5, s6, s7 partial sums of lanes 0-3, then of lanes 4-7] */
    const floats8 ab = PICK(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
                       PICK(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    const floats8 ce = PICK(c, e, 0, 1, 8, 9, 4, 5, 12, 13) +
                       PICK(c, e, 2, 3, 10, 11, 6, 7, 14, 15);
    floats8 r = PICK(ab, ce, 0, 1, 2, 3, 8, 9, 10, 11) +
                PICK(ab, ce, 4, 5, 6, 7, 12, 13, 14, 15);
    for (; d < n; d++)
        for (int i = 0; i < 8; i++)
            r[i] += q[d] * k[i][d];
    return r;
}

/* e^x for x <= 0 (a score less its maximum), within 2 ulp of expf: Cody-Waite reduction to r in
 * [-ln2/2, ln2/2], a degree-6 polynomial and the exponent set in the bits; plain arithmetic (no libm call),
 * so the loop over a range's scores vectorizes (libm's expf is a call per score, a third of the kernel's
 * time) */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x; /* e^-87 is about the smallest normal float: a weight of ~0 either way */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* rounded: 1.5 * 2^23 */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union {
        int32_t bits;
        float value;
    } two_to_n = {.bits = ((int32_t)n + 127) << 23};
    return p * two_to_n.value;
}

/* acc[0 .. width) = sum over the range's keys i of p[i] * v[i][col .. col + width), width a multiple of 8 up
 * to 32, in registers */
static inline void weigh(float *acc, const float *p, const float *const *v, int64_t keys, int64_t col, int width)
{
    floats8 a[4] = {{0}};
    for (int64_t i = 0; i < keys; i++) {
        const floats8 w = {p[i], p[i], p[i], p[i], p[i], p[i], p[i], p[i]};
        for (int c = 0; c < width / 8; c++)
            a[c] += w * load8(v[i] + col + 8 * c);
    }
    memcpy(acc + col, a, sizeof(float) * (size_t)width);
}

/* the first key a row of n keys sees, its query at position n - 1: HF's sliding window (keys past n - 1 - window),
 * Llama 4's chunk (keys of the query's chunk of positions), else 0 */
static inline int64_t first_key(int64_t n, int64_t window, int64_t chunk)
{
    if (window > 0)
        return n > window ? n - window : 0;
    return chunk > 0 ? (n - 1) - (n - 1) % chunk : 0;
}

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                     const int64_t *context, float *out, const float *sinks, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t pages, int64_t block_size, int64_t window, int64_t chunk,
                     float scale, float softcap, int threads)
{
    const int64_t group = heads / kv_heads, slot_stride = kv_heads * dim;
    int64_t longest = 1;
    for (int64_t row = 0; row < rows; row++) {
        const int64_t keys = context[row] - first_key(context[row], window, chunk);
        longest = keys > longest ? keys : longest;
    }
    /* splits per row: enough tasks for 4 per thread, no range shorter than 64 keys */
    int64_t splits = (4 * threads + rows - 1) / rows, most = (longest + 63) / 64;
    splits = splits < most ? splits : most;
    splits = splits < 1 ? 1 : splits;
    const int64_t span = (longest + splits - 1) / splits, parts = rows * splits * heads;
    float *top = malloc(sizeof(float) * (size_t)parts), *total = malloc(sizeof(float) * (size_t)parts);
    float *acc = malloc(sizeof(float) * (size_t)(parts * dim));
    int failed = top == NULL || total == NULL || acc == NULL;
    if (!failed) {
#pragma omp parallel num_threads(threads) reduction(| : failed)
        {
            /* one per thread: the range's scores per head, and where each key's slot row starts in each cache */
            float *scores = malloc(sizeof(float) * (size_t)(heads * span));
            const float **key_rows = malloc(sizeof(float *) * (size_t)(2 * span));
            const float **value_rows = key_rows ? key_rows + span : NULL;
            failed = scores == NULL || key_rows == NULL;
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < rows * splits; task++) {
                if (failed)
                    continue;
                const int64_t row = task / splits, n = context[row];
                const int64_t first = first_key(n, window, chunk) + task % splits * span;
                const int64_t end = first + span < n ? first + span : n, keys = end > first ? end - first : 0;
                const int64_t *table = tables + row * pages;
                const float *qr = q + row * heads * dim;
                for (int64_t j = first, slot = 0; j < end; j++, slot++) {
                    if (j == first || j % block_size == 0) /* (one division a block) */
                        slot = table[j / block_size] * block_size + j % block_size;
                    key_rows[j - first] = k_cache + slot * slot_stride;
                    value_rows[j - first] = v_cache + slot * slot_stride;
                }
                for (int64_t kv = 0; kv < kv_heads; kv++) {
                    const float *kh[8];
                    int64_t i = 0;
                    for (; i + 8 <= keys; i += 8) {
                        for (int t = 0; t < 8; t++)
                            kh[t] = key_rows[i + t] + kv * dim;
                        for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
                            const floats8 s = dot8(qr + h * dim, kh, dim) * scale;
                            memcpy(scores + h * span + i, &s, sizeof s);
                        }
                    }
                    for (; i < keys; i++)
                        for (int64_t h = kv * group; h < (kv + 1) * group; h++)
                            scores[h * span + i] = dot(qr + h * dim, key_rows[i] + kv * dim, dim) * scale;
                }
                float *tops = top + task * heads, *totals = total + task * heads, *accs = acc + task * heads * dim;
                for (int64_t h = 0; h < heads; h++) {
                    float *sh = scores + h * span, m = -INFINITY, sum = 0.0f;
                    if (softcap > 0.0f)
                        for (int64_t j = 0; j < keys; j++)
                            sh[j] = softcap * tanhf(sh[j] / softcap);
                    for (int64_t j = 0; j < keys; j++)
                        m = sh[j] > m ? sh[j] : m;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < keys; j++) {
                        sh[j] = exp_nonpositive(sh[j] - m);
                        sum += sh[j];
                    }
                    tops[h] = m;
                    totals[h] = sum;
                    /* (the value rows at this head's KV head: key_rows is free once the scores are made) */
                    const float **vh = key_rows;
                    for (int64_t i = 0; i < keys; i++)
                        vh[i] = value_rows[i] + h / group * dim;
                    float *ah = accs + h * dim;
                    int64_t col = 0;
                    for (; col + 32 <= dim; col += 32)
                        weigh(ah, sh, vh, keys, col, 32);
                    for (; col + 8 <= dim; col += 8)
                        weigh(ah, sh, vh, keys, col, 8);
                    for (; col < dim; col++) {
                        float a = 0.0f;
                        for (int64_t i = 0; i < keys; i++)
                            a += sh[i] * vh[i][col];
                        ah[col] = a;
                    }
                }
            }
            free(scores);
            free(key_rows);
#pragma omp for schedule(static) /* (after the tasks: omp for ends on a barrier) */
            for (int64_t row = 0; row < rows; row++) {
                for (int64_t h = 0; h < heads; h++) {
                    float m = sinks ? sinks[h] : -INFINITY, sum = 0.0f, *o = out + (row * heads + h) * dim;
                    for (int64_t s = 0; s < splits; s++)
                        m = top[(row * splits + s) * heads + h] > m ? top[(row * splits + s) * heads + h] : m;
                    for (int64_t d = 0; d < dim; d++)
                        o[d] = 0.0f;
                    for (int64_t s = 0; s < splits; s++) {
                        const int64_t part = (row * splits + s) * heads + h;
                        if (total[part] == 0.0f) /* a range past the row's keys */
                            continue;
                        const float w = expf(top[part] - m);
                        sum += w * total[part];
#pragma omp simd
                        for (int64_t d = 0; d < dim; d++)
                            o[d] += w * acc[part * dim + d];
                    }
                    if (sinks)
                        sum += expf(sinks[h] - m);
                    for (int64_t d = 0; d < dim; d++)
                        o[d] /= sum;
                }
            }
        }
    }
    free(top);
    free(total);
    free(acc);
    return failed;
}
