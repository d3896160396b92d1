/* Paged decode attention on the CPU: vlens.attention.paged_decode_cpu builds this file and calls it.
 *
 * Each row's one query per head meets its keys and values where they lie in the paged cache, through the
 * row's block table, only up to the row's context (and within its sliding window). A task is one range of
 * one row's keys ("split-K", so that a batch of one keeps every thread busy) for all heads at once: a key's
 * slot holds every KV head side by side, so the task reads it once, front to back. Each task keeps, per
 * head, its maximum score, its sum of weights and its weighted values; the merge rescales the ranges to the
 * row's maximum. Scores, softmax and sums are float32.
 *
 * Layouts (contiguous): q and out [rows, heads, dim]; caches [slots, kv_heads, dim]; tables [rows, pages];
 * context [rows]; sinks [heads] or NULL (gpt-oss: a logit per head that joins the softmax as a key with no
 * value; the merge starts from it). window 0: none; softcap 0: none. Returns 0, or 1 when out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float floats8 __attribute__((vector_size(32)));

/* a . b over n floats: eight running sums, added pairwise at the end (`omp simd reduction` left the
 * horizontal sum as a chain of sixteen scalar adds, most of the kernel's time at small head sizes) */
static inline float dot(const float *a, const float *b, int64_t n)
{
    floats8 sums = {0}, x, y;
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
        memcpy(&x, a + d, sizeof x);
        memcpy(&y, b + d, sizeof y);
        sums += x * y;
    }
    float s = ((sums[0] + sums[4]) + (sums[1] + sums[5])) + ((sums[2] + sums[6]) + (sums[3] + sums[7]));
    for (; d < n; d++)
        s += a[d] * b[d];
    return s;
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

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                     const int64_t *context, float *out, const float *sinks, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t pages, int64_t block_size, int64_t window, float scale,
                     float softcap, int threads)
{
    const int64_t group = heads / kv_heads, slot_stride = kv_heads * dim;
    int64_t longest = 1;
    for (int64_t row = 0; row < rows; row++) {
        const int64_t n = context[row], keys = window > 0 && n > window ? window : n;
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
            float *scores = malloc(sizeof(float) * (size_t)(heads * span)); /* one per thread */
            failed = scores == NULL;
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < rows * splits; task++) {
                if (scores == NULL)
                    continue;
                const int64_t row = task / splits, n = context[row];
                const int64_t first = (window > 0 && n > window ? n - window : 0) + task % splits * span;
                const int64_t end = first + span < n ? first + span : n, keys = end > first ? end - first : 0;
                const int64_t *table = tables + row * pages;
                const float *qr = q + row * heads * dim;
                for (int64_t j = first, slot = 0; j < end; j++, slot++) {
                    if (j == first || j % block_size == 0) /* (one division a block) */
                        slot = table[j / block_size] * block_size + j % block_size;
                    const float *k = k_cache + slot * slot_stride;
                    for (int64_t h = 0, kv = 0; kv < kv_heads; kv++) {
                        for (int64_t g = 0; g < group; g++, h++) {
                            float s = dot(qr + h * dim, k + kv * dim, dim) * scale;
                            if (softcap > 0.0f)
                                s = softcap * tanhf(s / softcap);
                            scores[h * span + (j - first)] = s;
                        }
                    }
                }
                float *tops = top + task * heads, *totals = total + task * heads, *accs = acc + task * heads * dim;
                for (int64_t h = 0; h < heads; h++) {
                    float *sh = scores + h * span, m = -INFINITY, sum = 0.0f;
                    for (int64_t j = 0; j < keys; j++)
                        m = sh[j] > m ? sh[j] : m;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < keys; j++) {
                        sh[j] = exp_nonpositive(sh[j] - m);
                        sum += sh[j];
                    }
                    tops[h] = m;
                    totals[h] = sum;
                    for (int64_t d = 0; d < dim; d++)
                        accs[h * dim + d] = 0.0f;
                }
                for (int64_t j = first, slot = 0; j < end; j++, slot++) {
                    if (j == first || j % block_size == 0)
                        slot = table[j / block_size] * block_size + j % block_size;
                    const float *v = v_cache + slot * slot_stride;
                    for (int64_t h = 0, kv = 0; kv < kv_heads; kv++) {
                        for (int64_t g = 0; g < group; g++, h++) {
                            const float p = scores[h * span + (j - first)], *vh = v + kv * dim;
                            float *ah = accs + h * dim;
#pragma omp simd
                            for (int64_t d = 0; d < dim; d++)
                                ah[d] += p * vh[d];
                        }
                    }
                }
            }
            free(scores);
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

