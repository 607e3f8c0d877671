/* A decode step's transformer layers in one call: the same kernels the forward calls one
   by one from Python (linear_bf16, paged_decode_bf16, the layer_glue functions), called
   here in the same order on the same buffers, so the numbers are the same bit for bit.

   Why: a decode step of the 82m model makes ~10 kernel calls a layer, each through a
   Python wrapper (checks, an output tensor, a ctypes call). With the kernels' work
   removed that is ~1.1 ms a step; between the kernels, whose ~280 MB of reads a step
   leave the caches empty, the same Python took 3.5-3.9 ms (measured on the AMX host:
   every kernel call replaced by a 3 MB copy). Here Python makes one call per step.

   The kernels live in their own libraries (the matmul kernel's helper thread is one per
   process); `decode_layers_bind` hands this one their functions' addresses.

   One source for both element types: `elem_t` is bf16's bits here, and fp32 where
   decode_layers_f32.c defines DECODE_LAYERS_F32 and includes this file (the fp32 kernels
   of a CPU without AVX-512: linear_f32, paged_decode_f32, layer_glue_f32; no helper).
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#ifdef DECODE_LAYERS_F32
typedef float elem_t;
#else
typedef uint16_t elem_t;
#endif

typedef int (*linear_fn)(const elem_t* w, int64_t N, int64_t K, const elem_t* x, int64_t M,
                         int64_t ldx, const float* bias, elem_t* y, int64_t ldy);
typedef int (*attention_fn)(const elem_t* q, const elem_t* kpool, const elem_t* vpool,
                            const int64_t* tables, int64_t table_stride, const int32_t* ctx_lens,
                            const int32_t* starts, int B, int H, int KVH, int hd, int bs,
                            float scale, float* scratch, int64_t scratch_elems, elem_t* out);
typedef void (*norm_fn)(const elem_t* h, const elem_t* delta, const elem_t* w, int64_t rows,
                        int64_t n, float eps, elem_t* h_out, elem_t* x_out);
typedef int (*rope_fn)(elem_t* x, int64_t T, int64_t ld, int rotate, int hd,
                       const elem_t* cos_t, const elem_t* sin_t, const int64_t* pos,
                       int64_t table_rows, int kvh, const int64_t* slots, elem_t* kcache,
                       elem_t* vcache, int64_t cache_slots);
typedef void (*silu_fn)(const elem_t* gu, int64_t rows, int64_t inter, elem_t* out);
typedef void (*head_norm_fn)(elem_t* x, int64_t T, int64_t ld, int heads, int hd,
                             const elem_t* w, float eps);
typedef void (*item_fn)(void* ctx, int64_t item, int worker);
typedef void (*commit_fn)(void* ctx, int64_t item);
typedef int (*parallel_fn)(item_fn fn, commit_fn commit, void* ctx, int64_t items);
typedef void (*steal_fn)(void);

static linear_fn linear;
static attention_fn attention;
static norm_fn add_rms_norm;
static rope_fn rope_kv;
static silu_fn silu_mul;
static head_norm_fn head_rms_norm;
static parallel_fn parallel;
static steal_fn steal_begin, steal_end;

/* par: linear_bf16_parallel, or NULL (the attention then runs on the caller alone);
   begin, end: linear_bf16_steal_begin and _end, or NULL */
void decode_layers_bind(void* lin, void* att, void* norm, void* rope, void* silu, void* head,
                        void* par, void* begin, void* end) {
    linear = (linear_fn)lin;
    attention = (attention_fn)att;
    add_rms_norm = (norm_fn)norm;
    rope_kv = (rope_fn)rope;
    silu_mul = (silu_fn)silu;
    head_rms_norm = (head_norm_fn)head;
    parallel = (parallel_fn)par;
    steal_begin = (steal_fn)begin;
    steal_end = (steal_fn)end;
}

/* One layer's weights: packed for linear_bf16; biases fp32 or NULL; norms bf16;
   q_norm/k_norm NULL unless the family has them (Qwen3); next_norm NULL on the last layer. */
typedef struct {
    const elem_t *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const elem_t *mlp_norm, *next_norm, *q_norm, *k_norm;
} layer_t;

/* One step: B decoding sequences, one token each. h, x: [B][D] (the residual stream, and
   layer 0's normed input), updated in place. kv: the pool [2][layers][slots][KVH][hd].
   Workspace buffers sized for B rows. */
typedef struct {
    int64_t B, D, inter;
    int32_t H, KVH, hd, bs;
    float eps, scale;
    const elem_t *cos_t, *sin_t;
    int64_t table_rows;
    const int64_t *pos, *slots;
    elem_t* kv;
    int64_t layer_elems, kv_elems, cache_slots; /* one layer's K; K to V; slots per layer */
    const int64_t* tables;
    int64_t table_stride;
    const int32_t *ctx_lens, *starts;
    float* scratch;
    int64_t scratch_elems;
    elem_t *h, *x, *qkv, *q, *attn, *o, *gu, *act;
} step_t;

/* A layer's attention split by sequences between the caller and the matmul kernel's
   helper thread, when it is lent the step (linear_bf16_parallel): each sequence's
   numbers depend on that sequence alone, so they are the same bit for bit however the
   batch is split. Items are runs of `per` sequences, so most sequences still have their
   successor's first rows prefetched by the kernel (paged_decode.c); each worker has its
   half of the scratch (the caller sizes it for two; else the caller runs it all).
   Measured on the AMX host, the helper's core idle (bench_decode_step.py
   --compare-kernels --helper-core 0, 82m, 300 positions): a step of 32 sequences 22.8 ms
   with the matmuls shared, 17.2 with the attention too; 8 sequences 10.9 -> 9.8. */
typedef struct {
    const step_t* s;
    const elem_t *k_cache, *v_cache;
    int64_t per, half;
    _Atomic int rc;
} att_job_t;

/* Each layer's job has a place of its own for the step, not the caller's stack: a helper
   held up inside an item may read it after the caller took the item back and moved on
   (linear_bf16.c, "Taking a group back"); the step waits for it before returning. The
   helper writes its items' outputs to `helper_attn` and commits them from there. */
#define MAX_LAYERS 1024
#define HELPER_ATTN_ELEMS (1 << 19)
static att_job_t att_jobs[MAX_LAYERS];
static elem_t helper_attn[HELPER_ATTN_ELEMS] __attribute__((aligned(64)));

static void attention_item(void* ctx, int64_t item, int worker) {
    att_job_t* j = (att_job_t*)ctx;
    const step_t* s = j->s;
    const int64_t b0 = item * j->per, n = s->B - b0 < j->per ? s->B - b0 : j->per;
    const int64_t qrow = (int64_t)s->H * s->hd;
    const int rc = attention(s->q + b0 * qrow, j->k_cache, j->v_cache,
                             s->tables + b0 * s->table_stride, s->table_stride, s->ctx_lens + b0,
                             s->starts + b0, (int)n, s->H, s->KVH, s->hd, s->bs, s->scale,
                             s->scratch + worker * j->half, j->half,
                             worker ? helper_attn : s->attn + b0 * qrow);
    if (rc) j->rc = rc;
}

static void attention_commit(void* ctx, int64_t item) {
    const att_job_t* j = (const att_job_t*)ctx;
    const step_t* s = j->s;
    const int64_t b0 = item * j->per, n = s->B - b0 < j->per ? s->B - b0 : j->per;
    const int64_t qrow = (int64_t)s->H * s->hd;
    memcpy(s->attn + b0 * qrow, helper_attn, (size_t)(n * qrow) * sizeof(elem_t));
}

/* Whether this step's attention may be split: a helper to split with, two sequences or
   more, scratch for two (the same for every layer, so asked once a step), and room for
   the helper's items. */
static int can_split(const step_t* s, int L) {
    int64_t longest = 0;
    for (int64_t b = 0; b < s->B; b++)
        if (s->ctx_lens[b] - s->starts[b] > longest) longest = s->ctx_lens[b] - s->starts[b];
    return parallel && s->B >= 2 && L <= MAX_LAYERS
           && s->scratch_elems / 2 >= (int64_t)s->H * longest
           && (s->B + 15) / 16 * (int64_t)s->H * s->hd <= HELPER_ATTN_ELEMS;
}

static int layer_attention(const step_t* s, const elem_t* k_cache, const elem_t* v_cache,
                           int li, int split) {
    if (split) {
        att_job_t* j = &att_jobs[li];
        j->s = s, j->k_cache = k_cache, j->v_cache = v_cache;
        j->per = (s->B + 15) / 16, j->half = s->scratch_elems / 2, j->rc = 0;
        parallel(attention_item, attention_commit, j, (s->B + j->per - 1) / j->per);
        return j->rc;
    }
    return attention(s->q, k_cache, v_cache, s->tables, s->table_stride, s->ctx_lens, s->starts,
                     (int)s->B, s->H, s->KVH, s->hd, s->bs, s->scale, s->scratch,
                     s->scratch_elems, s->attn);
}

static int run_layers(const layer_t* layers, int L, const step_t* s, int split) {
    const int64_t B = s->B, D = s->D, W = (int64_t)(s->H + 2 * s->KVH) * s->hd;
    const int64_t Q = (int64_t)s->H * s->hd;
    for (int li = 0; li < L; li++) {
        const layer_t* l = layers + li;
        elem_t* k_cache = s->kv + li * s->layer_elems;
        elem_t* v_cache = k_cache + s->kv_elems;
        linear(l->qkv, W, D, s->x, B, D, l->qkv_bias, s->qkv, W);
        if (l->q_norm) {
            head_rms_norm(s->qkv, B, W, s->H, s->hd, l->q_norm, s->eps);
            head_rms_norm(s->qkv + Q, B, W, s->KVH, s->hd, l->k_norm, s->eps);
        }
        if (rope_kv(s->qkv, B, W, s->H + s->KVH, s->hd, s->cos_t, s->sin_t, s->pos,
                    s->table_rows, s->KVH, s->slots, k_cache, v_cache, s->cache_slots))
            return 1 + li;
        for (int64_t b = 0; b < B; b++)  /* the decode kernel takes q rows contiguous */
            memcpy(s->q + b * Q, s->qkv + b * W, (size_t)Q * sizeof(elem_t));
        if (layer_attention(s, k_cache, v_cache, li, split)) return 1 + li;
        linear(l->o, D, Q, s->attn, B, Q, l->o_bias, s->o, D);
        add_rms_norm(s->h, s->o, l->mlp_norm, B, D, s->eps, s->h, s->x);
        linear(l->gate_up, 2 * s->inter, D, s->x, B, D, l->gate_up_bias, s->gu, 2 * s->inter);
        silu_mul(s->gu, B, s->inter, s->act);
        linear(l->down, D, s->inter, s->act, B, s->inter, l->down_bias, s->o, D);
        /* the last layer: h + delta alone (its norm lands in x, which nothing reads) */
        add_rms_norm(s->h, s->o, l->next_norm ? l->next_norm : l->mlp_norm, B, D, s->eps, s->h,
                     s->x);
    }
    return 0;
}

/* Returns 0; 1 + the layer when a kernel refused its input (a position or slot out of
   range, an attention shape or scratch it does not take): nothing after it was run.
   Between steal_begin and steal_end a call may take a held-up helper's group back: the
   step's buffers (the caller's) outlive every call in it, and steal_end waits for the
   helper to leave such a group before they are handed back. */
int decode_layers(const layer_t* layers, int L, const step_t* s) {
    const int split = can_split(s, L);
    const int stealing = steal_begin && steal_end;
    if (stealing) steal_begin();
    const int rc = run_layers(layers, L, s, split);
    if (stealing) steal_end();
    return rc;
}
