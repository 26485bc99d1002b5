/* The cpu-native execution site: the routed experts of one MoE layer computed on the host CPU straight from
 * qpacked expert rows (runmap/format/qpack.py), in FP32, in one OpenMP parallel region per layer call.
 *
 * Built at first use by kernels/cpu_native.py (cc -O3 -march=native -fopenmp), loaded with ctypes, which
 * releases the GIL for the call. Why a C kernel: torch's CPU int4 matmul splits one M = 1 product across its
 * threads expert by expert and reached 0.20-0.26 of the host read bandwidth on a 16-core host
 * (results/cpu-experts/README.md); here every row of every expert of the call is one work item of a single
 * parallel loop, so all threads stream expert bytes at once.
 *
 * qpack, per projection W (N, K): byte j of a row holds k = 2j in the low nibble and k = 2j + 1 in the high
 * nibble, each nibble u = q + 8 with q in [-7, 7]; one FP16 scale s per block of B values along K (the last
 * block may be partial); w = q * s. The activations are deinterleaved once per call (x_even[j] = x[2j],
 * x_odd[j] = x[2j + 1]) so the inner loop reads bytes and both activation halves contiguously and the compiler
 * vectorises it over LANES independent partial sums (no reassociation needed, so no -ffast-math).
 *
 * Determinism: every output element is computed by one thread in a fixed order (row dot products lane by lane,
 * then the lanes by a fixed tree; the weighted sum over assignments in the caller's order), so the result does
 * not depend on the thread count or the schedule.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define LANES 16 /* partial sums per row dot product: one AVX-512 register of FP32 */
/* Output rows per work item of the gate/up and of the down loop, and those loops' OpenMP schedule. Overridable at
 * compile time (-DROW_CHUNK=16 ...) for measurements (tools/explore/probe_cpu_native_chunks.py); none of them changes
 * a result: each output element is still computed whole by one thread in a fixed order. On the 16-core H200 host,
 * batch 1 (OLMoE), 64 rows with a guided schedule streamed 73.4 / 77.2 GB/s (FP32 / i16) where 16 rows handed out one
 * at a time streamed 58.7 / 63.3 in the same run (results/cpu-experts/probe/probe-cpu-native-chunks-h200.log): longer
 * runs of contiguous rows per thread, and fewer hand-outs. */
#ifndef ROW_CHUNK
#define ROW_CHUNK 64
#endif
#ifndef DOWN_CHUNK
#define DOWN_CHUNK ROW_CHUNK
#endif
#ifndef ROW_SCHEDULE
#define ROW_SCHEDULE guided
#endif
/* STAGE_OVERLAP 1: the gate/up and down items in one ordered work list, a down item waiting only for its own expert's
 * gate/up items (runmap_moe_layer); 0: two loops with a barrier between them. Neither changes a result. */
#ifndef STAGE_OVERLAP
#define STAGE_OVERLAP 0
#endif
#if STAGE_OVERLAP
#include <omp.h>
#include <stdatomic.h>
#endif
#define SUM_CHUNK 128 /* output columns per work item of the weighted sum */

/* IEEE half -> float, exact for every half (normals, subnormals, zeros, inf, NaN): one instruction with F16C. */
#if defined(__F16C__)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        int e = -1;
        do {
            mant <<= 1;
            e++;
        } while ((mant & 0x400u) == 0);
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* One block's partial sums: acc[l] += sum over j = j0 + l (mod LANES) of q_lo * x_even[j] + q_hi * x_odd[j] for
 * the bytes j in [j0, j1). The vector paths below compute the same sums with the same lane assignment in
 * registers; this loop is the portable path and the tail of the vector ones. */
static inline void block_tail(const uint8_t *w_ptr, const float *x_even, const float *x_odd, int j0, int j1,
                              float *acc) {
    for (int j = j0; j < j1; j++) {
        const int v = w_ptr[j];
        acc[(j - j0) % LANES] += (float)((v & 15) - 8) * x_even[j] + (float)((v >> 4) - 8) * x_odd[j];
    }
}

#if !defined(__AVX512F__) /* the AVX-512 path is row_dots_n below */
/* sum_k w[k] * x[k] for one qpacked row of k_size values (k_size / 2 bytes at w_ptr, one FP16 scale per block
 * at scale_ptr); x given deinterleaved: x_even[j] = x[2j], x_odd[j] = x[2j + 1], j < k_size / 2. */
static float row_dot(const uint8_t *w_ptr, const uint16_t *scale_ptr, const float *x_even, const float *x_odd,
                     int k_size, int block_size) {
    float total[LANES] = {0};
    const int half_k = k_size / 2, half_block = block_size / 2;
    for (int j0 = 0, b = 0; j0 < half_k; j0 += half_block, b++) {
        const int j1 = j0 + half_block < half_k ? j0 + half_block : half_k;
        float acc[LANES] = {0};
        int j = j0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256i mask = _mm256_set1_epi32(15), offset = _mm256_set1_epi32(8);
        __m256 acc_lo[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256 acc_hi[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (; j + 16 <= j1; j += 16) {
            for (int half = 0; half < 2; half++) {
                const int jj = j + 8 * half;
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w_ptr + jj)));
                const __m256 q_lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, mask), offset));
                const __m256 q_hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), offset));
                acc_lo[half] = _mm256_fmadd_ps(q_lo, _mm256_loadu_ps(x_even + jj), acc_lo[half]);
                acc_hi[half] = _mm256_fmadd_ps(q_hi, _mm256_loadu_ps(x_odd + jj), acc_hi[half]);
            }
        }
        _mm256_storeu_ps(acc, _mm256_add_ps(acc_lo[0], acc_hi[0]));
        _mm256_storeu_ps(acc + 8, _mm256_add_ps(acc_lo[1], acc_hi[1]));
#endif
        block_tail(w_ptr, x_even, x_odd, j, j1, acc);
        const float s = half_to_float(scale_ptr[b]);
        for (int l = 0; l < LANES; l++) total[l] += s * acc[l];
    }
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += total[l];
    return sum;
}

#endif

#if STAGE_OVERLAP
static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}
#endif

static inline int num_blocks(int k, int block) { return (k + block - 1) / block; }

#define MAX_GROUP 4 /* tokens of one expert whose dot products share each decoded weight */

/* out[t] = row_dot(w_ptr, scale_ptr, xs[t], xs[t] + half_k, ...) for t < nt: the weights are decoded once for
 * the nt tokens. Each token's arithmetic is exactly what it would be alone (same lanes, same order), so the
 * result does not depend on how tokens are grouped. */
static inline __attribute__((always_inline)) void row_dots_n(const uint8_t *w_ptr, const uint16_t *scale_ptr,
                                                             const float *const *xs, int k_size, int block_size,
                                                             float *out, const int nt, int prefetch) {
    (void)prefetch; /* the AVX-512 path's; the others leave it to the hardware prefetcher */
#if defined(__AVX512F__)
    /* the nibble u decodes to q = u - 8 by a 16-entry table lookup: vpermps reads the low 4 bits of each index,
     * so the low nibble needs no mask and neither needs an integer subtract or a conversion */
    const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f,
                                        0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    const int half_k = k_size / 2, half_block = block_size / 2;
    __m512 total[MAX_GROUP];
    for (int t = 0; t < nt; t++) total[t] = _mm512_setzero_ps();
    for (int j0 = 0, b = 0; j0 < half_k; j0 += half_block, b++) {
        const int j1 = j0 + half_block < half_k ? j0 + half_block : half_k;
        /* four FMA chains per token (two 16-byte steps per iteration): one chain per step would wait on the FMA's
         * latency, not on its throughput */
        __m512 acc_lo[MAX_GROUP], acc_hi[MAX_GROUP], acc_lo2[MAX_GROUP], acc_hi2[MAX_GROUP];
        for (int t = 0; t < nt; t++) acc_lo[t] = acc_hi[t] = acc_lo2[t] = acc_hi2[t] = _mm512_setzero_ps();
        int j = j0;
        for (; j + 32 <= j1; j += 32) {
            if (prefetch) _mm_prefetch((const char *)(w_ptr + j + prefetch), _MM_HINT_T0);
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w_ptr + j)));
            const __m512i v2 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w_ptr + j + 16)));
            const __m512 q_lo = _mm512_permutexvar_ps(v, table);
            const __m512 q_hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
            const __m512 q_lo2 = _mm512_permutexvar_ps(v2, table);
            const __m512 q_hi2 = _mm512_permutexvar_ps(_mm512_srli_epi32(v2, 4), table);
            for (int t = 0; t < nt; t++) {
                acc_lo[t] = _mm512_fmadd_ps(q_lo, _mm512_loadu_ps(xs[t] + j), acc_lo[t]);
                acc_hi[t] = _mm512_fmadd_ps(q_hi, _mm512_loadu_ps(xs[t] + half_k + j), acc_hi[t]);
                acc_lo2[t] = _mm512_fmadd_ps(q_lo2, _mm512_loadu_ps(xs[t] + j + 16), acc_lo2[t]);
                acc_hi2[t] = _mm512_fmadd_ps(q_hi2, _mm512_loadu_ps(xs[t] + half_k + j + 16), acc_hi2[t]);
            }
        }
        for (; j + 16 <= j1; j += 16) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w_ptr + j)));
            const __m512 q_lo = _mm512_permutexvar_ps(v, table);
            const __m512 q_hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
            for (int t = 0; t < nt; t++) {
                acc_lo[t] = _mm512_fmadd_ps(q_lo, _mm512_loadu_ps(xs[t] + j), acc_lo[t]);
                acc_hi[t] = _mm512_fmadd_ps(q_hi, _mm512_loadu_ps(xs[t] + half_k + j), acc_hi[t]);
            }
        }
        const __m512 s = _mm512_set1_ps(half_to_float(scale_ptr[b]));
        for (int t = 0; t < nt; t++) {
            __m512 acc = _mm512_add_ps(_mm512_add_ps(acc_lo[t], acc_hi[t]), _mm512_add_ps(acc_lo2[t], acc_hi2[t]));
            if (j < j1) { /* a block whose byte count is not a multiple of 16 */
                float lanes[LANES];
                _mm512_storeu_ps(lanes, acc);
                block_tail(w_ptr, xs[t], xs[t] + half_k, j, j1, lanes);
                acc = _mm512_loadu_ps(lanes);
            }
            total[t] = _mm512_fmadd_ps(s, acc, total[t]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(total[t]); /* a fixed tree of lane additions */
#else
    for (int t = 0; t < nt; t++) out[t] = row_dot(w_ptr, scale_ptr, xs[t], xs[t] + k_size / 2, k_size, block_size);
#endif
}

/* row_dots_n with nt a constant in each branch, so the compiler keeps the accumulators in registers */
static void row_dots(const uint8_t *w_ptr, const uint16_t *scale_ptr, const float *const *xs, int k_size,
                     int block_size, float *out, int nt, int prefetch) {
    switch (nt) {
    case 1: row_dots_n(w_ptr, scale_ptr, xs, k_size, block_size, out, 1, prefetch); break;
    case 2: row_dots_n(w_ptr, scale_ptr, xs, k_size, block_size, out, 2, prefetch); break;
    case 3: row_dots_n(w_ptr, scale_ptr, xs, k_size, block_size, out, 3, prefetch); break;
    default: row_dots_n(w_ptr, scale_ptr, xs, k_size, block_size, out, MAX_GROUP, prefetch); break;
    }
}

/* ---- the i16 path: activations as int16 per block, integer dot products ----
 *
 * Each block of B activations (the same blocks as the weights' scales) is stored as int16 q_x = round(x / s_x),
 * s_x = max|x| / 32767 over the block, with the block's sum of q_x. A row block's dot product is then exact integer
 * arithmetic, sum_k u_k q_x,k - 8 sum_k q_x,k (u = the stored nibble, q = u - 8), scaled once by s_w * s_x: with
 * vpdpwssd (or vpmaddwd) about 2.4x fewer instructions per weight byte than the FP32 path. The activations'
 * rounding is at most 2^-16 of the block's largest value (an int8 version of this path was measured at 1.5-2.3e-2
 * relative error, too coarse for the intermediate's heavy tail; kernels/cpu_native.py states the tolerance). */

/* q, scale, sum of one deinterleaved vector of k values (x_split layout: even half, then odd half). */
static void quantize_split(const float *xs, int k_size, int block_size, int16_t *q, float *scale, int32_t *sum) {
    const int half_k = k_size / 2, half_block = block_size / 2;
    for (int j0 = 0, b = 0; j0 < half_k; j0 += half_block, b++) {
        const int j1 = j0 + half_block < half_k ? j0 + half_block : half_k;
        float amax = 0.0f;
        int finite = 1;
        for (int j = j0; j < j1; j++) {
            finite &= isfinite(xs[j]) && isfinite(xs[half_k + j]);
            const float a = fabsf(xs[j]) > fabsf(xs[half_k + j]) ? fabsf(xs[j]) : fabsf(xs[half_k + j]);
            amax = a > amax ? a : amax;
        }
        if (!finite) { /* a NaN or inf activation: the block's scale is NaN, so the outputs that read it are NaN as
                          on the FP32 path (never a finite result from a broken input) */
            for (int j = j0; j < j1; j++) q[j] = q[half_k + j] = 0;
            scale[b] = NAN;
            sum[b] = 0;
            continue;
        }
        const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int32_t total = 0;
        for (int j = j0; j < j1; j++) {
            for (int half = 0; half < 2; half++) {
                float v = nearbyintf(xs[half * half_k + j] * inv);
                v = v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v);
                q[half * half_k + j] = (int16_t)v;
                total += (int32_t)v;
            }
        }
        scale[b] = amax / 32767.0f;
        sum[b] = total;
    }
}

/* out[t] = sum over blocks of s_w * s_x[t] * (sum_j u_j q_x[t],j - 8 sum q_x[t]) for one qpacked row and nt
 * quantized activation vectors (xq[t]: even half, then odd half; xs[t] / xsum[t]: per block). */
static inline __attribute__((always_inline)) void row_dots_i16_n(const uint8_t *w_ptr, const uint16_t *scale_ptr,
                                                                const int16_t *const *xq, const float *const *xs,
                                                                const int32_t *const *xsum, int k_size,
                                                                int block_size, float *out, const int nt,
                                                                int prefetch) {
    (void)prefetch;
    const int half_k = k_size / 2, half_block = block_size / 2;
    float corr[MAX_GROUP] = {0};
#if defined(__AVX512BW__)
    const __m512i nibble = _mm512_set1_epi16(15);
    __m512 total[MAX_GROUP];
    for (int t = 0; t < nt; t++) total[t] = _mm512_setzero_ps();
#endif
    for (int j0 = 0, b = 0; j0 < half_k; j0 += half_block, b++) {
        const int j1 = j0 + half_block < half_k ? j0 + half_block : half_k;
        int j = j0;
        int32_t tail[MAX_GROUP] = {0};
#if defined(__AVX512BW__)
        __m512i acc[MAX_GROUP];
        for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_si512();
        __m512i acc2[MAX_GROUP]; /* a second chain per token: the dot-product instruction's latency */
        for (int t = 0; t < nt; t++) acc2[t] = _mm512_setzero_si512();
        for (; j + 32 <= j1; j += 32) { /* 32 bytes = 64 weights: each byte widened to a 16-bit lane */
            if (prefetch) _mm_prefetch((const char *)(w_ptr + j + prefetch), _MM_HINT_T0);
            const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w_ptr + j)));
            const __m512i lo = _mm512_and_si512(v, nibble);
            const __m512i hi = _mm512_srli_epi16(v, 4);
            for (int t = 0; t < nt; t++) {
                const __m512i xe = _mm512_loadu_si512((const void *)(xq[t] + j));
                const __m512i xo = _mm512_loadu_si512((const void *)(xq[t] + half_k + j));
#if defined(__AVX512VNNI__)
                acc[t] = _mm512_dpwssd_epi32(acc[t], lo, xe);
                acc2[t] = _mm512_dpwssd_epi32(acc2[t], hi, xo);
#else /* the same two products per 32-bit lane */
                acc[t] = _mm512_add_epi32(acc[t], _mm512_madd_epi16(lo, xe));
                acc2[t] = _mm512_add_epi32(acc2[t], _mm512_madd_epi16(hi, xo));
#endif
            }
        }
        for (int t = 0; t < nt; t++) acc[t] = _mm512_add_epi32(acc[t], acc2[t]); /* exact: integers */
#endif
        for (; j < j1; j++) { /* the portable path and the vector path's tail: exact integers either way */
            const int v = w_ptr[j];
            for (int t = 0; t < nt; t++) tail[t] += (v & 15) * xq[t][j] + (v >> 4) * xq[t][half_k + j];
        }
        const float s = half_to_float(scale_ptr[b]);
        for (int t = 0; t < nt; t++) {
            const float f = s * xs[t][b];
            corr[t] += f * (float)(tail[t] - 8 * xsum[t][b]);
#if defined(__AVX512BW__)
            total[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), _mm512_set1_ps(f), total[t]);
#endif
        }
    }
    for (int t = 0; t < nt; t++) {
        float sum = corr[t];
#if defined(__AVX512BW__)
        sum += _mm512_reduce_add_ps(total[t]);
#endif
        out[t] = sum;
    }
}

static void row_dots_i16(const uint8_t *w_ptr, const uint16_t *scale_ptr, const int16_t *const *xq,
                        const float *const *xs, const int32_t *const *xsum, int k_size, int block_size, float *out,
                        int nt, int prefetch) {
    switch (nt) {
    case 1: row_dots_i16_n(w_ptr, scale_ptr, xq, xs, xsum, k_size, block_size, out, 1, prefetch); break;
    case 2: row_dots_i16_n(w_ptr, scale_ptr, xq, xs, xsum, k_size, block_size, out, 2, prefetch); break;
    case 3: row_dots_i16_n(w_ptr, scale_ptr, xq, xs, xsum, k_size, block_size, out, 3, prefetch); break;
    default: row_dots_i16_n(w_ptr, scale_ptr, xq, xs, xsum, k_size, block_size, out, MAX_GROUP, prefetch); break;
    }
}

/* Everything the work items of one layer call read or write (runmap_moe_layer's arguments, see below). */
struct layer_call {
    const uint8_t *const *rows;
    const int32_t *assign_start, *assign_token;
    const int64_t *offsets;
    const float *x_split;
    float *h_split, *y;
    int hidden, intermediate, block_size, nb_h, nb_i, quantized, prefetch;
    const int16_t *x_q;
    const float *x_scale;
    const int32_t *x_sum;
    int16_t *h_q;
    float *h_scale;
    int32_t *h_sum;
};

/* gate and up rows [r0, r1) of expert e: h[a, r] = silu(gate_r . x_t) * (up_r . x_t) for each assignment a of e */
static void gate_up_rows(const struct layer_call *c, int e, int r0, int r1) {
    const int hidden = c->hidden, intermediate = c->intermediate, half_h = hidden / 2, half_i = intermediate / 2;
    const int nb_h = c->nb_h;
    const int32_t *assign_start = c->assign_start;
    const uint8_t *row = c->rows[e];
    for (int r = r0; r < r1; r++) {
        const uint8_t *gw = row + c->offsets[0] + (int64_t)r * half_h;
        const uint16_t *gs = (const uint16_t *)(row + c->offsets[1]) + (int64_t)r * nb_h;
        const uint8_t *uw = row + c->offsets[2] + (int64_t)r * half_h;
        const uint16_t *us = (const uint16_t *)(row + c->offsets[3]) + (int64_t)r * nb_h;
        const int slot = (r & 1) ? half_i + r / 2 : r / 2;
        for (int a0 = assign_start[e]; a0 < assign_start[e + 1]; a0 += MAX_GROUP) {
            const int nt = assign_start[e + 1] - a0 < MAX_GROUP ? assign_start[e + 1] - a0 : MAX_GROUP;
            float g[MAX_GROUP], u[MAX_GROUP];
            if (c->quantized) {
                const int16_t *xq[MAX_GROUP];
                const float *xsc[MAX_GROUP];
                const int32_t *xsm[MAX_GROUP];
                for (int t = 0; t < nt; t++) {
                    const int64_t tok = c->assign_token[a0 + t];
                    xq[t] = c->x_q + tok * hidden;
                    xsc[t] = c->x_scale + tok * nb_h;
                    xsm[t] = c->x_sum + tok * nb_h;
                }
                row_dots_i16(gw, gs, xq, xsc, xsm, hidden, c->block_size, g, nt, c->prefetch);
                row_dots_i16(uw, us, xq, xsc, xsm, hidden, c->block_size, u, nt, c->prefetch);
            } else {
                const float *xs[MAX_GROUP];
                for (int t = 0; t < nt; t++) xs[t] = c->x_split + (int64_t)c->assign_token[a0 + t] * hidden;
                row_dots(gw, gs, xs, hidden, c->block_size, g, nt, c->prefetch);
                row_dots(uw, us, xs, hidden, c->block_size, u, nt, c->prefetch);
            }
            for (int t = 0; t < nt; t++)
                c->h_split[(int64_t)(a0 + t) * intermediate + slot] = g[t] / (1.0f + expf(-g[t])) * u[t];
        }
    }
}

/* the intermediate of assignment a quantized for the down rows (the i16 path) */
static void quantize_intermediate(const struct layer_call *c, int a) {
    quantize_split(c->h_split + (int64_t)a * c->intermediate, c->intermediate, c->block_size,
                   c->h_q + (int64_t)a * c->intermediate, c->h_scale + (int64_t)a * c->nb_i,
                   c->h_sum + (int64_t)a * c->nb_i);
}

/* down rows [r0, r1) of expert e: y[a, r] = down_r . h[a] for each assignment a of e */
static void down_rows(const struct layer_call *c, int e, int r0, int r1) {
    const int hidden = c->hidden, intermediate = c->intermediate, half_i = intermediate / 2, nb_i = c->nb_i;
    const int32_t *assign_start = c->assign_start;
    const uint8_t *row = c->rows[e];
    for (int r = r0; r < r1; r++) {
        const uint8_t *dw = row + c->offsets[4] + (int64_t)r * half_i;
        const uint16_t *ds = (const uint16_t *)(row + c->offsets[5]) + (int64_t)r * nb_i;
        for (int a0 = assign_start[e]; a0 < assign_start[e + 1]; a0 += MAX_GROUP) {
            const int nt = assign_start[e + 1] - a0 < MAX_GROUP ? assign_start[e + 1] - a0 : MAX_GROUP;
            float d[MAX_GROUP];
            if (c->quantized) {
                const int16_t *hq[MAX_GROUP];
                const float *hsc[MAX_GROUP];
                const int32_t *hsm[MAX_GROUP];
                for (int t = 0; t < nt; t++) {
                    hq[t] = c->h_q + (int64_t)(a0 + t) * intermediate;
                    hsc[t] = c->h_scale + (int64_t)(a0 + t) * nb_i;
                    hsm[t] = c->h_sum + (int64_t)(a0 + t) * nb_i;
                }
                row_dots_i16(dw, ds, hq, hsc, hsm, intermediate, c->block_size, d, nt, c->prefetch);
            } else {
                const float *hs[MAX_GROUP];
                for (int t = 0; t < nt; t++) hs[t] = c->h_split + (int64_t)(a0 + t) * intermediate;
                row_dots(dw, ds, hs, intermediate, c->block_size, d, nt, c->prefetch);
            }
            for (int t = 0; t < nt; t++) c->y[(int64_t)(a0 + t) * hidden + r] = d[t];
        }
    }
}

/* Routed-expert output of one layer call.
 *
 * rows:           (n_experts,) pointers to qpacked expert rows (read only).
 * assign_start:   int32 (n_experts + 1,): the assignments of expert i are [assign_start[i], assign_start[i + 1]).
 * assign_token:   int32 (n_assign,) the token (row of x and out) of each assignment.
 * assign_weight:  float32 (n_assign,) its gate weight.
 * x:              (n_tokens, hidden) activations: float32, or IEEE half when x_half is 1 (widened exactly here).
 * offsets:        int64 (6,) byte offsets in a row of gate.weight, gate.scale, up.weight, up.scale,
 *                 down.weight, down.scale.
 * x_split:        float32 (n_tokens, hidden) scratch (x deinterleaved).
 * h_split:        float32 (n_assign, intermediate) scratch (silu(gate) * up, deinterleaved).
 * y:              float32 (n_assign, hidden) scratch (each assignment's unweighted expert output).
 * out:            float32 (n_tokens, hidden): out[t] = sum over assignments a of token t, in assignment order,
 *                 of assign_weight[a] * y[a]; tokens with no assignment get zeros.
 * quantized:      0 = the FP32 path; 1 = the i16 path, whose scratch follows (NULL otherwise):
 * x_q, x_scale, x_sum:  int16 (n_tokens, hidden), float32 / int32 (n_tokens, blocks of hidden);
 * h_q, h_scale, h_sum:  int16 (n_assign, intermediate), float32 / int32 (n_assign, blocks of intermediate).
 * prefetch:       bytes ahead of the weight byte being read to prefetch into L1 (0: none). Rows of a projection are
 *                 contiguous, so this reaches the next rows of the same stream: one thread alone streamed expert
 *                 bytes at ~0.45 of its read bandwidth on the H200 host (results/cpu-experts/README.md).
 * x_half:         1 when x holds IEEE half values (the decode chain's FP16 activations), 0 for float32.
 * Returns 0, or 1 when the overlapped schedule's counters cannot be allocated; the caller (kernels/cpu_native.py)
 * has checked every shape, offset and index.
 */
int runmap_moe_layer(const uint8_t *const *rows, int n_experts, const int32_t *assign_start,
                     const int32_t *assign_token, const float *assign_weight, const void *x, int n_tokens,
                     int hidden, int intermediate, int block_size, const int64_t *offsets, float *x_split,
                     float *h_split, float *y, float *out, int n_threads, int quantized, int16_t *x_q,
                     float *x_scale, int32_t *x_sum, int16_t *h_q, float *h_scale, int32_t *h_sum, int prefetch,
                     int x_half) {
    const int n_assign = assign_start[n_experts];
    const int half_h = hidden / 2;
    const int nb_h = num_blocks(hidden, block_size), nb_i = num_blocks(intermediate, block_size);
    const int up_chunks = (intermediate + ROW_CHUNK - 1) / ROW_CHUNK;
    const int down_chunks = (hidden + DOWN_CHUNK - 1) / DOWN_CHUNK;

    const struct layer_call call = {rows, assign_start, assign_token, offsets, x_split, h_split, y, hidden, intermediate,
                                     block_size, nb_h, nb_i, quantized, prefetch, x_q, x_scale, x_sum, h_q, h_scale,
                                     h_sum};
    const int up_items = n_experts * up_chunks, all_items = up_items + n_experts * down_chunks;
#if STAGE_OVERLAP
    /* one work list, gate/up items first, handed out in order from a shared counter: the thread that finishes an
     * expert's last gate/up item quantizes its intermediates and marks it ready, and a down item waits only for its
     * own expert, so threads past the gate/up items start down rows instead of waiting at a barrier. Items are
     * handed out in ascending order, so every gate/up item is already taken (and runs without waiting) when a down
     * item waits on it: no deadlock. */
    atomic_int next_item = 0;
    atomic_int *up_done = malloc((size_t)n_experts * sizeof(atomic_int));
    atomic_int *ready = malloc((size_t)n_experts * sizeof(atomic_int));
    if (up_done == NULL || ready == NULL) {
        free(up_done);
        free(ready);
        return 1;
    }
    for (int e = 0; e < n_experts; e++) {
        atomic_init(&up_done[e], 0);
        atomic_init(&ready[e], up_chunks == 0); /* no gate/up rows (intermediate 0): nothing to wait for */
    }
#endif

#pragma omp parallel num_threads(n_threads)
    {
        /* x deinterleaved (and quantized on the i16 path), one token per iteration */
#pragma omp for schedule(static)
        for (int t = 0; t < n_tokens; t++) {
            float *xs = x_split + (int64_t)t * hidden;
            if (x_half) { /* FP16 activations widened here: exact, and no widening pass on the caller's side */
                const uint16_t *xt = (const uint16_t *)x + (int64_t)t * hidden;
                for (int j = 0; j < half_h; j++) {
                    xs[j] = half_to_float(xt[2 * j]);
                    xs[half_h + j] = half_to_float(xt[2 * j + 1]);
                }
            } else {
                const float *xt = (const float *)x + (int64_t)t * hidden;
                for (int j = 0; j < half_h; j++) {
                    xs[j] = xt[2 * j];
                    xs[half_h + j] = xt[2 * j + 1];
                }
            }
            if (quantized)
                quantize_split(xs, hidden, block_size, x_q + (int64_t)t * hidden, x_scale + (int64_t)t * nb_h,
                               x_sum + (int64_t)t * nb_h);
        }

#if STAGE_OVERLAP
        const int team = omp_get_num_threads();
        for (;;) {
            /* a guided hand-out: a share of what remains, at least one item */
            int first = atomic_load_explicit(&next_item, memory_order_relaxed), take = 0;
            do {
                const int left = all_items - first;
                if (left <= 0)
                    break;
                take = left / (2 * team) > 1 ? left / (2 * team) : 1;
            } while (!atomic_compare_exchange_weak_explicit(&next_item, &first, first + take, memory_order_relaxed,
                                                            memory_order_relaxed));
            if (first >= all_items)
                break;
            for (int item = first; item < first + take; item++) {
                if (item < up_items) {
                    const int e = item / up_chunks, r0 = (item % up_chunks) * ROW_CHUNK;
                    gate_up_rows(&call, e, r0, r0 + ROW_CHUNK < intermediate ? r0 + ROW_CHUNK : intermediate);
                    /* acq_rel: the last of an expert's items sees every other item's h writes */
                    if (atomic_fetch_add_explicit(&up_done[e], 1, memory_order_acq_rel) == up_chunks - 1) {
                        if (quantized)
                            for (int a = assign_start[e]; a < assign_start[e + 1]; a++) quantize_intermediate(&call, a);
                        atomic_store_explicit(&ready[e], 1, memory_order_release);
                    }
                } else {
                    const int d = item - up_items, e = d / down_chunks, r0 = (d % down_chunks) * DOWN_CHUNK;
                    while (!atomic_load_explicit(&ready[e], memory_order_acquire))
                        spin_pause();
                    down_rows(&call, e, r0, r0 + DOWN_CHUNK < hidden ? r0 + DOWN_CHUNK : hidden);
                }
            }
        }
#pragma omp barrier
#else
        /* gate and up rows of every expert */
#pragma omp for schedule(ROW_SCHEDULE)
        for (int item = 0; item < up_items; item++) {
            const int e = item / up_chunks, r0 = (item % up_chunks) * ROW_CHUNK;
            gate_up_rows(&call, e, r0, r0 + ROW_CHUNK < intermediate ? r0 + ROW_CHUNK : intermediate);
        }

        if (quantized) { /* the intermediate quantized per assignment for the down rows */
#pragma omp for schedule(static)
            for (int a = 0; a < n_assign; a++)
                quantize_intermediate(&call, a);
        }

        /* down rows of every expert */
#pragma omp for schedule(ROW_SCHEDULE)
        for (int item = up_items; item < all_items; item++) {
            const int d = item - up_items, e = d / down_chunks, r0 = (d % down_chunks) * DOWN_CHUNK;
            down_rows(&call, e, r0, r0 + DOWN_CHUNK < hidden ? r0 + DOWN_CHUNK : hidden);
        }
#endif

        /* the weighted sum, column chunks in parallel, assignments in order within each element */
#pragma omp for schedule(static)
        for (int c0 = 0; c0 < hidden; c0 += SUM_CHUNK) {
            const int c1 = c0 + SUM_CHUNK < hidden ? c0 + SUM_CHUNK : hidden;
            for (int t = 0; t < n_tokens; t++)
                for (int c = c0; c < c1; c++) out[(int64_t)t * hidden + c] = 0.0f;
            for (int a = 0; a < n_assign; a++) {
                const float wa = assign_weight[a];
                const float *ya = y + (int64_t)a * hidden;
                float *ot = out + (int64_t)assign_token[a] * hidden;
                for (int c = c0; c < c1; c++) ot[c] += wa * ya[c];
            }
        }
    }
#if STAGE_OVERLAP
    free(up_done);
    free(ready);
#endif
    return 0;
}

/* The CPU site's part of one layer as a device split left it (the one-graph two-site step, runmap/engine/engine.py):
 * the routed pairs whose keep[j] is 0 are computed, every other pair is left to the device. The assignment table is
 * built here, so the host's call is one bound ctypes call with no Python between the layer's ids arriving in pinned
 * memory and its sum being published: experts ascending, within an expert the pairs in (token, slot) order, the
 * order of kernels/cpu_native.py assignments_arrays, so the sum is bit for bit the table call's for the same experts.
 *
 * layer_rows:   (n_layer_experts,) addresses of the layer's qpacked row of every expert (read only).
 * ids:          int64 (n_tokens, top_k) routed expert ids. keep: int32 (n_tokens * top_k), 0 = the CPU computes.
 * weights:      float32 (n_tokens, top_k) gate weights.
 * work:         int32 scratch of 2 * (n_layer_experts + 1) + n_tokens * top_k values.
 * rows_sel:     scratch of n_layer_experts row addresses. weights_sel: float32 scratch of n_tokens * top_k values.
 * The rest as runmap_moe_layer (its scratch sized for n_tokens * top_k assignments).
 * Returns 0; 2 when a pair to compute names an expert outside [0, n_layer_experts) (nothing read, out untouched);
 * with no pair to compute, out is zeroed.
 */
int runmap_moe_layer_masked(const uint8_t *const *layer_rows, int n_layer_experts, const int64_t *ids,
                            const int32_t *keep, const float *weights, int top_k, int32_t *work,
                            const uint8_t **rows_sel, float *weights_sel, const void *x, int n_tokens, int hidden,
                            int intermediate, int block_size, const int64_t *offsets, float *x_split, float *h_split,
                            float *y, float *out, int n_threads, int quantized, int16_t *x_q, float *x_scale,
                            int32_t *x_sum, int16_t *h_q, float *h_scale, int32_t *h_sum, int prefetch, int x_half) {
    const int n_pairs = n_tokens * top_k;
    int32_t *cursor = work;                              /* per expert id: its pairs, then its next slot */
    int32_t *start = work + (n_layer_experts + 1);       /* per computed expert: its first assignment */
    int32_t *token = work + 2 * (n_layer_experts + 1);   /* per assignment: its token */
    for (int e = 0; e < n_layer_experts; e++)
        cursor[e] = 0;
    for (int j = 0; j < n_pairs; j++) {
        if (keep[j] != 0)
            continue;
        const int64_t e = ids[j];
        if (e < 0 || e >= n_layer_experts)
            return 2;
        cursor[e]++;
    }
    int n_exp = 0;
    start[0] = 0;
    for (int e = 0; e < n_layer_experts; e++) {
        if (cursor[e] == 0)
            continue;
        rows_sel[n_exp] = layer_rows[e];
        start[n_exp + 1] = start[n_exp] + cursor[e];
        cursor[e] = start[n_exp];
        n_exp++;
    }
    if (n_exp == 0) {
        for (int64_t v = 0; v < (int64_t)n_tokens * hidden; v++)
            out[v] = 0.0f;
        return 0;
    }
    for (int j = 0; j < n_pairs; j++) { /* (the ids checked again: each pass reads them from memory the device wrote) */
        if (keep[j] != 0)
            continue;
        const int64_t e = ids[j];
        if (e < 0 || e >= n_layer_experts || cursor[e] >= n_pairs)
            return 2;
        const int a = cursor[e]++;
        token[a] = j / top_k;
        weights_sel[a] = weights[j];
    }
    return runmap_moe_layer(rows_sel, n_exp, start, token, weights_sel, x, n_tokens, hidden, intermediate, block_size,
                            offsets, x_split, h_split, y, out, n_threads, quantized, x_q, x_scale, x_sum, h_q, h_scale,
                            h_sum, prefetch, x_half);
}
