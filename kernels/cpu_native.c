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
 * then the lanes in order; the weighted sum over assignments in the caller's order), so the result does not
 * depend on the thread count or the schedule.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define LANES 16     /* partial sums per row dot product: one AVX-512 register of FP32 */
#define ROW_CHUNK 16 /* output rows per work item */

/* IEEE half -> float, exact for every half (normals, subnormals, zeros, inf, NaN). */
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

static inline int num_blocks(int k, int block) { return (k + block - 1) / block; }

#define MAX_GROUP 4 /* tokens of one expert whose dot products share each decoded weight */

/* out[t] = row_dot(w_ptr, scale_ptr, xs[t], xs[t] + half_k, ...) for t < nt: the weights are decoded once for
 * the nt tokens. Each token's arithmetic is exactly what it would be alone (same lanes, same order), so the
 * result does not depend on how tokens are grouped. */
static inline __attribute__((always_inline)) void row_dots_n(const uint8_t *w_ptr, const uint16_t *scale_ptr,
                                                             const float *const *xs, int k_size, int block_size,
                                                             float *out, const int nt) {
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
        __m512 acc_lo[MAX_GROUP], acc_hi[MAX_GROUP];
        for (int t = 0; t < nt; t++) acc_lo[t] = acc_hi[t] = _mm512_setzero_ps();
        int j = j0;
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
            __m512 acc = _mm512_add_ps(acc_lo[t], acc_hi[t]);
            if (j < j1) { /* a block whose byte count is not a multiple of 16 */
                float lanes[LANES];
                _mm512_storeu_ps(lanes, acc);
                block_tail(w_ptr, xs[t], xs[t] + half_k, j, j1, lanes);
                acc = _mm512_loadu_ps(lanes);
            }
            total[t] = _mm512_fmadd_ps(s, acc, total[t]);
        }
    }
    for (int t = 0; t < nt; t++) {
        float lanes[LANES];
        _mm512_storeu_ps(lanes, total[t]);
        float sum = 0.0f;
        for (int l = 0; l < LANES; l++) sum += lanes[l];
        out[t] = sum;
    }
#else
    for (int t = 0; t < nt; t++) out[t] = row_dot(w_ptr, scale_ptr, xs[t], xs[t] + k_size / 2, k_size, block_size);
#endif
}

/* row_dots_n with nt a constant in each branch, so the compiler keeps the accumulators in registers */
static void row_dots(const uint8_t *w_ptr, const uint16_t *scale_ptr, const float *const *xs, int k_size,
                     int block_size, float *out, int nt) {
    switch (nt) {
    case 1: row_dots_n(w_ptr, scale_ptr, xs, k_size, block_size, out, 1); break;
    case 2: row_dots_n(w_ptr, scale_ptr, xs, k_size, block_size, out, 2); break;
    case 3: row_dots_n(w_ptr, scale_ptr, xs, k_size, block_size, out, 3); break;
    default: row_dots_n(w_ptr, scale_ptr, xs, k_size, block_size, out, MAX_GROUP); break;
    }
}

/* Routed-expert output of one layer call.
 *
 * rows:           (n_experts,) pointers to qpacked expert rows (read only).
 * assign_start:   int32 (n_experts + 1,): the assignments of expert i are [assign_start[i], assign_start[i + 1]).
 * assign_token:   int32 (n_assign,) the token (row of x and out) of each assignment.
 * assign_weight:  float32 (n_assign,) its gate weight.
 * x:              float32 (n_tokens, hidden) activations.
 * offsets:        int64 (6,) byte offsets in a row of gate.weight, gate.scale, up.weight, up.scale,
 *                 down.weight, down.scale.
 * x_split:        float32 (n_tokens, hidden) scratch (x deinterleaved).
 * h_split:        float32 (n_assign, intermediate) scratch (silu(gate) * up, deinterleaved).
 * y:              float32 (n_assign, hidden) scratch (each assignment's unweighted expert output).
 * out:            float32 (n_tokens, hidden): out[t] = sum over assignments a of token t, in assignment order,
 *                 of assign_weight[a] * y[a]; tokens with no assignment get zeros.
 * Returns 0; the caller (kernels/cpu_native.py) has checked every shape, offset and index.
 */
int runmap_moe_layer(const uint8_t *const *rows, int n_experts, const int32_t *assign_start,
                     const int32_t *assign_token, const float *assign_weight, const float *x, int n_tokens,
                     int hidden, int intermediate, int block_size, const int64_t *offsets, float *x_split,
                     float *h_split, float *y, float *out, int n_threads) {
    const int n_assign = assign_start[n_experts];
    const int half_h = hidden / 2, half_i = intermediate / 2;
    const int nb_h = num_blocks(hidden, block_size), nb_i = num_blocks(intermediate, block_size);
    const int up_chunks = (intermediate + ROW_CHUNK - 1) / ROW_CHUNK;
    const int down_chunks = (hidden + ROW_CHUNK - 1) / ROW_CHUNK;

#pragma omp parallel num_threads(n_threads)
    {
        /* x deinterleaved, one token per iteration */
#pragma omp for schedule(static)
        for (int t = 0; t < n_tokens; t++) {
            const float *xt = x + (int64_t)t * hidden;
            float *xs = x_split + (int64_t)t * hidden;
            for (int j = 0; j < half_h; j++) {
                xs[j] = xt[2 * j];
                xs[half_h + j] = xt[2 * j + 1];
            }
        }

        /* gate and up rows of every expert: h[a, r] = silu(gate_r . x_t) * (up_r . x_t) */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < n_experts * up_chunks; item++) {
            const int e = item / up_chunks, r0 = (item % up_chunks) * ROW_CHUNK;
            const int r1 = r0 + ROW_CHUNK < intermediate ? r0 + ROW_CHUNK : intermediate;
            const uint8_t *row = rows[e];
            for (int r = r0; r < r1; r++) {
                const uint8_t *gw = row + offsets[0] + (int64_t)r * half_h;
                const uint16_t *gs = (const uint16_t *)(row + offsets[1]) + (int64_t)r * nb_h;
                const uint8_t *uw = row + offsets[2] + (int64_t)r * half_h;
                const uint16_t *us = (const uint16_t *)(row + offsets[3]) + (int64_t)r * nb_h;
                const int slot = (r & 1) ? half_i + r / 2 : r / 2;
                for (int a0 = assign_start[e]; a0 < assign_start[e + 1]; a0 += MAX_GROUP) {
                    const int nt = assign_start[e + 1] - a0 < MAX_GROUP ? assign_start[e + 1] - a0 : MAX_GROUP;
                    const float *xs[MAX_GROUP];
                    float g[MAX_GROUP], u[MAX_GROUP];
                    for (int t = 0; t < nt; t++) xs[t] = x_split + (int64_t)assign_token[a0 + t] * hidden;
                    row_dots(gw, gs, xs, hidden, block_size, g, nt);
                    row_dots(uw, us, xs, hidden, block_size, u, nt);
                    for (int t = 0; t < nt; t++)
                        h_split[(int64_t)(a0 + t) * intermediate + slot] = g[t] / (1.0f + expf(-g[t])) * u[t];
                }
            }
        }

        /* down rows: y[a, r] = down_r . h[a] */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < n_experts * down_chunks; item++) {
            const int e = item / down_chunks, r0 = (item % down_chunks) * ROW_CHUNK;
            const int r1 = r0 + ROW_CHUNK < hidden ? r0 + ROW_CHUNK : hidden;
            const uint8_t *row = rows[e];
            for (int r = r0; r < r1; r++) {
                const uint8_t *dw = row + offsets[4] + (int64_t)r * half_i;
                const uint16_t *ds = (const uint16_t *)(row + offsets[5]) + (int64_t)r * nb_i;
                for (int a0 = assign_start[e]; a0 < assign_start[e + 1]; a0 += MAX_GROUP) {
                    const int nt = assign_start[e + 1] - a0 < MAX_GROUP ? assign_start[e + 1] - a0 : MAX_GROUP;
                    const float *hs[MAX_GROUP];
                    float d[MAX_GROUP];
                    for (int t = 0; t < nt; t++) hs[t] = h_split + (int64_t)(a0 + t) * intermediate;
                    row_dots(dw, ds, hs, intermediate, block_size, d, nt);
                    for (int t = 0; t < nt; t++) y[(int64_t)(a0 + t) * hidden + r] = d[t];
                }
            }
        }

        /* the weighted sum, column chunks in parallel, assignments in order within each element */
#pragma omp for schedule(static)
        for (int c0 = 0; c0 < hidden; c0 += ROW_CHUNK * 8) {
            const int c1 = c0 + ROW_CHUNK * 8 < hidden ? c0 + ROW_CHUNK * 8 : hidden;
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
    return 0;
}
