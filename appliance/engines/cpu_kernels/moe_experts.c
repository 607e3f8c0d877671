/* A mixture of experts' SwiGLU experts for one step in one call: the rows grouped by the
   expert they chose (a stable counting sort, as `layers.moe.SparseMoE` sorts them), each
   expert with work multiplied through the matmul kernel (gate/up, SwiGLU's activation,
   down), and every row's outputs weighed and summed into its token in that order.

   Why: `SparseMoE` runs a Python loop over the experts with work, each a few torch calls,
   and a decode step of a Qwen3-MoE-shaped model (128 experts, top 8) touches ~50 experts
   a layer at 8 sequences. Measured on one AMD EPYC Zen 4 core, 12 layers of hidden 768
   and 128 experts of 256 in bf16, the experts' weights read at 7-8 GB/s through oneDNN
   and that loop, 12.5-15 through the matmul kernel and the same loop, where the kernel
   streams a dense layer at ~30 (bench/bench_torch_moe.py has the served figures).

   The numbers are the Python loop's through the same matmul kernel, bit for bit: the
   activation is layer_glue's (torch's `silu` then `mul_`), each row's product with its
   routing weight is rounded to the activations' type (`(ys * w).to(x.dtype)`: in fp32
   whether w is fp32, as Mixtral keeps it, or bf16, as Qwen3-MoE casts it), and a token's
   rows are summed in fp32 in the sorted order and rounded once, as torch's `index_add_`
   into a bf16 tensor does on the CPU.

   Experts without biases and with SwiGLU only (Qwen3-MoE, Mixtral); gpt-oss's clamped,
   biased experts stay in Python. One source for both element types: bf16 here, fp32 where
   moe_experts_f32.c defines MOE_EXPERTS_F32 and includes this file (linear_f32 and
   layer_glue_f32 on a CPU without AVX-512). The kernels are bound by address, as
   decode_layers.c binds them. Built by appliance/engines/cpu_kernels/builder.py. */
#include <stdint.h>
#include <string.h>

#ifdef MOE_EXPERTS_F32
typedef float elem_t;
#else
typedef uint16_t elem_t;
#include "vec_math.h"
#endif

typedef int (*linear_fn)(const elem_t* w, int64_t N, int64_t K, const elem_t* x, int64_t M,
                         int64_t ldx, const float* bias, elem_t* y, int64_t ldy);
typedef void (*silu_fn)(const elem_t* gu, int64_t rows, int64_t inter, elem_t* out);

static linear_fn linear;
static silu_fn silu_mul;

void moe_experts_bind(void* lin, void* silu) {
    linear = (linear_fn)lin;
    silu_mul = (silu_fn)silu;
}

/* Rows of one expert per matmul call at most: a prompt's experts get hundreds, and the
   call's buffers then stay in L2 (a long prompt's expert reads its weights again per
   CHUNK rows, from the caches). */
#define MOE_CHUNK 128

/* Elements of `work` a call needs: X, G, A, Y for MOE_CHUNK rows. */
int64_t moe_experts_work(int64_t D, int64_t I) { return (int64_t)MOE_CHUNK * (2 * D + 3 * I); }

/* acc[t] += round(y * w) (fp32 sums) */
static void weigh_add(float* acc, const elem_t* y, float w, int64_t D) {
#ifdef MOE_EXPERTS_F32
    for (int64_t d = 0; d < D; d++) acc[d] = acc[d] + y[d] * w;
#else
    const __m512 wv = _mm512_set1_ps(w);
    for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = first(D - d);
        const __m512 s = round_bf16(_mm512_mul_ps(load_bf16_mask(y + d, m), wv));
        _mm512_mask_storeu_ps(acc + d, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + d), s));
    }
#endif
}

static inline float weight_of(const void* weights, int weights_f32, int64_t p) {
    if (weights_f32) return ((const float*)weights)[p];
#ifdef MOE_EXPERTS_F32
    return ((const float*)weights)[p];
#else
    const uint32_t u = (uint32_t)((const uint16_t*)weights)[p] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* x [T][D]; experts, weights [T][k] (int64 ids; fp32 when weights_f32, else elem_t);
   gate_up[e] [2I][D] and down[e] [D][I] packed for the matmul kernel; out [T][D], written
   whole. work: moe_experts_work(D, I) elements; acc: T*D fp32 (bf16 only: fp32 sums into
   `out` itself); order: T*k int32; starts: 2 * (E + 1) int64. Returns 0; -1 for an expert id out of range or an expert with work and no
   weights; the matmul kernel's own code where it refuses. */
int moe_experts(const elem_t* const* gate_up, const elem_t* const* down, int64_t E,
                int64_t D, int64_t I, const elem_t* x, int64_t T, int64_t k,
                const int64_t* experts, const void* weights, int weights_f32, elem_t* out,
                elem_t* work, float* acc, int32_t* order, int64_t* starts) {
    if (!linear || !silu_mul) return -2;
    int64_t* cursor = starts + E + 1;
    memset(starts, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t p = 0; p < T * k; p++) {
        const int64_t e = experts[p];
        if (e < 0 || e >= E) return -1;
        starts[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++) starts[e + 1] += starts[e];
    memcpy(cursor, starts, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t p = 0; p < T * k; p++) order[cursor[experts[p]]++] = (int32_t)p;
#ifdef MOE_EXPERTS_F32
    acc = out;
#endif
    memset(acc, 0, sizeof(float) * (size_t)(T * D));
    elem_t *X = work, *G = X + MOE_CHUNK * D, *A = G + MOE_CHUNK * 2 * I, *Y = A + MOE_CHUNK * I;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = starts[e + 1] - starts[e];
        if (n == 0) continue;
        if (!gate_up[e] || !down[e]) return -1;
        for (int64_t c = 0; c < n; c += MOE_CHUNK) {
            const int64_t m = n - c < MOE_CHUNK ? n - c : MOE_CHUNK;
            const int32_t* rows = order + starts[e] + c;
            for (int64_t r = 0; r < m; r++)
                memcpy(X + r * D, x + (rows[r] / k) * D, sizeof(elem_t) * (size_t)D);
            int rc = linear(gate_up[e], 2 * I, D, X, m, D, NULL, G, 2 * I);
            if (rc) return rc;
            silu_mul(G, m, I, A);
            rc = linear(down[e], D, I, A, m, I, NULL, Y, D);
            if (rc) return rc;
            for (int64_t r = 0; r < m; r++)
                weigh_add(acc + (rows[r] / k) * D, Y + r * D,
                          weight_of(weights, weights_f32, rows[r]), D);
        }
    }
#ifndef MOE_EXPERTS_F32
    for (int64_t i = 0; i < T * D; i += 16) {
        const __mmask16 m = first(T * D - i);
        store_bf16(out + i, _mm512_maskz_loadu_ps(m, acc + i), m);
    }
#endif
    return 0;
}
