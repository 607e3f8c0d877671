/* y = x @ W^T (+ bias) in bf16 for the few rows of a decode step (AVX512-BF16; on a CPU
   with AMX, its tiles; optionally shared with a helper thread on an idle core: both
   further down).

   Why a kernel: at 1-8 rows a decode step's matmuls stream every weight once and do
   little arithmetic per byte, and oneDNN's packed bf16 linear reads the 82m model's
   weights at 12-16 GB/s on one core where a plain read runs at ~30. Here the weight is
   stored as pairs of input columns interleaved across 16 output rows, so one 64-byte load
   feeds one VDPBF16PS per input row, with no horizontal sums: the products and their
   fp32 sums are those oneDNN's bf16 kernel makes on the same instruction (equal results
   were measured at up to 8 rows; at more, a few outputs differ by one bf16 step).
   The weight is one contiguous stream in the order the kernel reads it, and the caller
   keeps it on transparent huge pages (`cpu_kernels.huge_page_empty`): measured on the
   82m model's weights at 5 rows, one core, 32 GB/s against 19 with 16-row blocks stored
   one after the other on 4 KB pages (~22 on huge pages). Up to 5 rows, no software
   prefetch: the hardware's stream does better (one row 6.4 ms per step's layers without,
   7.4 ms prefetching 1 KB ahead, 7.8 ms at 8 KB; 16 KB into L2 made 1-5 rows 3-46%
   slower on an AMD EPYC Zen 4, 6 rows within 4% either way). From 7 rows on, the
   products take about as long as the stream (8 rows of the 82m model: ~5.4 ms of
   VDPBF16PS against ~5 ms of reads), the hardware's prefetcher falls behind while the
   core computes, and a prefetch into L2 PF_DIST bytes ahead, made while a group's first
   tile of rows reads it from memory, keeps the stream in flight: the 82m model's layers
   at 7, 8, 12 and 16 rows 6.90 -> 6.16-6.29, 7.63-7.75 -> 6.71-6.73, 10.48 -> 9.70 and
   13.63 -> 12.72 ms on that core (alternating builds pass by pass; 8-64 KB ahead alike,
   1 KB into L1 slower than none). Prompt-sized calls (over PF_MAX_ROWS rows) never
   prefetch: there the stream is a small share of the time (256 rows: 177.4 against
   177.5 ms).

   Layout: w [Npad/16][K/2][16][2] bf16 split in groups of NT blocks (the last group may
   hold fewer), each group stored [K/2][blocks in group][16][2]: the pairs of input
   columns of its 32 output rows, k-pair after k-pair. Npad = N rounded up to 16, padding
   rows zero; K even. x [M, ldx] bf16 (K columns used); bias [N] fp32 or NULL;
   y [M, ldy] bf16.
   Built by appliance/engines/cpu_kernels/builder.py with the host's compiler. */
#define _GNU_SOURCE /* pthread_attr_setaffinity_np */
#include <immintrin.h>
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define NT 2 /* 16-row weight blocks per tile */
#define MT 8 /* input rows per tile */
#define PF_DIST 16384  /* bytes of the weight stream prefetched ahead, into L2 */
#define PF_MIN_ROWS 7  /* rows from which that prefetch pays (see above) */
#define PF_MAX_ROWS 16 /* and up to which (a call's rows) */

static inline __attribute__((always_inline)) void tile(const uint16_t* w, int64_t K2, int nblocks, const uint16_t* x, int64_t ldx,
                 int rows, const float* bias, int64_t n0, int64_t N, uint16_t* y, int64_t ldy,
                 int first /* the group's first tile of rows: it reads the weights from memory */) {
    __m512 acc[MT][NT];
    for (int m = 0; m < MT; m++)
        for (int j = 0; j < NT; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K2; kp++) {
        __m512bh wv[NT];
        if (first && rows >= PF_MIN_ROWS)
            for (int j = 0; j < nblocks; j++)
                _mm_prefetch((const char*)(w + (kp * nblocks + j) * 32) + PF_DIST, _MM_HINT_T1);
        for (int j = 0; j < nblocks; j++) {
            const uint16_t* at = w + (kp * nblocks + j) * 32;
            wv[j] = (__m512bh)_mm512_loadu_si512(at);
        }
        for (int m = 0; m < rows; m++) {
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * kp, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < nblocks; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
        }
    }
    for (int j = 0; j < nblocks; j++) {
        const int64_t n = n0 + 16 * j;
        const __mmask16 keep = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
        for (int m = 0; m < rows; m++) {
            const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], b));
            _mm256_mask_storeu_epi16(y + m * ldy + n, keep, (__m256i)out);
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The same weight stream through AMX's tiles (Sapphire Rapids and later). There one
   VDPBF16PS per input row per 64-byte load makes the kernel above compute-bound beyond a
   few rows (measured on such a core, 82m layer weights: ahead of oneDNN at 1-3 rows, 1.9x
   behind at 8, 6x at 32), while a TDPBF16PS multiplies up to 16 rows by a 1 KB weight
   tile at once. The layout needs no change: a B tile is 16 k-pairs of one 16-row block,
   which the stream holds NT * 64 bytes apart. Tiles: C 0-3 (rows 0-15 and 16-31 of the
   chunk, times the group's two blocks), A 4-5, B 6-7. K must be a multiple of 32 (a
   whole tile of k-pairs); other weights take the path above. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state; /* 0 not asked yet, 1 granted, -1 refused */

/* Unlike the path above, tile loads gain from a software prefetch of the stream ahead
   (one 2 KB chunk of a group's k-pairs: the 82m model's weights at 1, 8 and 32 rows,
   12.3 -> 11.3, 12.8 -> 12.2 and 16.2 -> 14.8 ms; 4 KB and beyond no better). The chunk
   is prefetched a quarter at a time between the tile products: all at once, the
   prefetches waited on the core's line-fill buffers ahead of the products (a decode
   step's matmuls at 32 rows 15.0 -> 13.7 ms, at 8 rows 11.7 -> 11.3).
   Each line is also asked into L2 AMX_PREFETCH_L2 bytes ahead of that: those requests
   wait in L2's deeper queue rather than the line-fill buffers, so more of the stream is
   in flight where memory answers slowly (on a day the same host read 8-10 GB/s plain,
   13-15 with L2 prefetches: the 82m model's weights at 1, 8 and 32 rows 11.06 -> 10.89,
   11.77 -> 11.24 and 13.56 -> 12.38 ms, alternating in one process; 4 KB alike). */
#define AMX_PREFETCH 2048
#define AMX_PREFETCH_L2 8192

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Linux hands AMX's tile state to a process only when asked (else the first tile
   instruction faults); oneDNN asks too, and asking twice is harmless. */
int linear_bf16_amx(void) {
    if (!amx_state)
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state == 1;
}

static void configure(int rows0, int rows1) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64;
    c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)rows0;
    c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)(rows1 ? rows1 : 1);
    c.rows[6] = c.rows[7] = 16;
    _tile_loadconfig(&c);
}

static void store_rows(const float* acc, int rows, const float* bias, int64_t n, int64_t N,
                       uint16_t* y, int64_t ldy) {
    const __mmask16 keep = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) {
        const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(acc + 16 * m), b));
        _mm256_mask_storeu_epi16(y + m * ldy + n, keep, (__m256i)out);
    }
}

/* One group of NT blocks times rows m0 .. m0 + rows0 + rows1 of x, under a tile
   configuration for those row counts. */
static inline void amx_group(const uint16_t* wt, int nblocks, int64_t K, const uint16_t* x0,
                             int64_t ldx, int rows0, int rows1, const float* bias, int64_t n0,
                             int64_t N, uint16_t* y, int64_t ldy) {
    float acc[16 * 16];
    const int64_t wstride = nblocks * 64; /* bytes from one k-pair to the next */
    const uint16_t* x1 = x0 + 16 * ldx;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        const uint16_t* wk = wt + (k / 2) * nblocks * 32;
        const char* ahead = (const char*)wk + AMX_PREFETCH;
        const int64_t q = wstride * 4; /* a quarter of the next 2 KB, between the products */
#define AHEAD(i)                                                       \
    for (int64_t l = (i) * q; l < ((i) + 1) * q; l += 64) {            \
        _mm_prefetch(ahead + l, _MM_HINT_T0);                          \
        _mm_prefetch(ahead + AMX_PREFETCH_L2 + l, _MM_HINT_T2);        \
    }
        AHEAD(0);
        _tile_loadd(4, x0 + k, ldx * 2);
        _tile_loadd(6, wk, wstride);
        _tile_dpbf16ps(0, 4, 6);
        AHEAD(1);
        if (nblocks > 1) {
            _tile_loadd(7, wk + 32, wstride);
            _tile_dpbf16ps(1, 4, 7);
        }
        AHEAD(2);
        if (rows1) {
            _tile_loadd(5, x1 + k, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (nblocks > 1) _tile_dpbf16ps(3, 5, 7);
        }
        AHEAD(3);
#undef AHEAD
    }
    _tile_stored(0, acc, 64);
    store_rows(acc, rows0, bias, n0, N, y, ldy);
    if (nblocks > 1) {
        _tile_stored(1, acc, 64);
        store_rows(acc, rows0, bias, n0 + 16, N, y, ldy);
    }
    if (rows1) {
        _tile_stored(2, acc, 64);
        store_rows(acc, rows1, bias, n0, N, y + 16 * ldy, ldy);
        if (nblocks > 1) {
            _tile_stored(3, acc, 64);
            store_rows(acc, rows1, bias, n0 + 16, N, y + 16 * ldy, ldy);
        }
    }
}

static __thread int tiles_rows = -1; /* the configuration this thread loaded: rows0 * 64 + rows1 */

static void configure_once(int rows0, int rows1) {
    if (tiles_rows != rows0 * 64 + rows1) {
        configure(rows0, rows1);
        tiles_rows = rows0 * 64 + rows1;
    }
}

static void release_tiles(void) {
    if (tiles_rows >= 0) {
        _tile_release(); /* so the kernel does not save 8 KB of tiles at every switch */
        tiles_rows = -1;
    }
}

/* Weight groups g0 .. g1-1 (NT blocks each) times all M rows: the rows in chunks of 32
   (two A tiles) under each group, so the weight is read from memory once whatever M is
   (the group, 32 x K, stays in L2 across the chunks). */
static void amx_groups(const uint16_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M,
                       int64_t ldx, const float* bias, uint16_t* y, int64_t ldy, int64_t g0,
                       int64_t g1) {
    const int64_t K2 = K / 2, blocks = (N + 15) / 16;
    const int64_t full = M / 32 * 32;          /* rows in whole chunks of 32 */
    const int last = (int)(M - full);
    const int last0 = last < 16 ? last : 16, last1 = last - last0;
    for (int64_t nb = g0 * NT; nb < blocks && nb < g1 * NT; nb += NT) {
        const int nblocks = blocks - nb < NT ? (int)(blocks - nb) : NT;
        const uint16_t* wt = w + nb * K2 * 32;
        if (full) {
            configure_once(16, 16);
            for (int64_t m0 = 0; m0 < full; m0 += 32)
                amx_group(wt, nblocks, K, x + m0 * ldx, ldx, 16, 16, bias, nb * 16, N,
                          y + m0 * ldy, ldy);
        }
        if (last) {
            configure_once(last0, last1);
            amx_group(wt, nblocks, K, x + full * ldx, ldx, last0, last1, bias, nb * 16, N,
                      y + full * ldy, ldy);
        }
    }
}
#define AMX_BUILT 1
#else
int linear_bf16_amx(void) { return 0; }
#endif

/* Weight groups g0 .. g1-1 times all M rows, on the AMX path where it applies. */
static void run_groups(const uint16_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M,
                       int64_t ldx, const float* bias, uint16_t* y, int64_t ldy, int64_t g0,
                       int64_t g1) {
#ifdef AMX_BUILT
    if (K % 32 == 0 && amx_state == 1) {
        amx_groups(w, N, K, x, M, ldx, bias, y, ldy, g0, g1);
        return;
    }
#endif
    const int64_t K2 = K / 2, blocks = (N + 15) / 16;
    const int pf = M <= PF_MAX_ROWS; /* decode-sized calls only (see the top) */
    for (int64_t nb = g0 * NT; nb < blocks && nb < g1 * NT; nb += NT) {
        const int nblocks = blocks - nb < NT ? (int)(blocks - nb) : NT;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int rows = M - m0 < MT ? (int)(M - m0) : MT;
            const uint16_t* wt = w + nb * K2 * 32;
            const uint16_t* xt = x + m0 * ldx;
            uint16_t* yt = y + m0 * ldy;
            /* a constant row count per case, so the accumulators stay in registers, and a
               constant prefetch flag, so a prompt's tiles are the loop they were without it */
#define TILE(R)                                                                    \
    if (pf && m0 == 0) tile(wt, K2, nblocks, xt, ldx, R, bias, nb * 16, N, yt, ldy, 1); \
    else tile(wt, K2, nblocks, xt, ldx, R, bias, nb * 16, N, yt, ldy, 0);               \
    break;
            switch (rows) {
            case 1: TILE(1) case 2: TILE(2) case 3: TILE(3) case 4: TILE(4)
            case 5: TILE(5) case 6: TILE(6) case 7: TILE(7) default: TILE(8)
            }
#undef TILE
        }
    }
}

static void finish(void) {
#ifdef AMX_BUILT
    release_tiles();
#endif
}

/* ---- A helper thread on another core, for boxes where that core is often idle ----

   A decode step's matmuls are bound by one core's memory reads (~15 GB/s on the AMX
   machine this was written on, where two cores read 30); on a 2-core box the prefill
   worker's core idles between prompts. While the caller says so (`linear_bf16_helper_spin`)
   a thread pinned to that core takes weight groups of each call from a shared counter, so
   both cores stream one weight; between calls it polls, and after HELPER_SPIN_NS without
   one it sleeps. The caller never returns before every group is written; a helper held
   up mid-group (the core's owner woke) delays the call by that group's time slice, which
   is why the caller (cpu_kernels/helper_gate.py) lends it a step only while the core's
   owner sleeps, and watches its run-queue wait.

   Claims carry the call's generation in their top 32 bits, so a helper that is late
   cannot take a group of the next call; the call's arguments sit in one of two slots by
   generation, and a helper re-checks the generation after copying them.

   The same helper runs other work of the step split into items (`linear_bf16_parallel`:
   decode_layers.c hands it the attention's sequences), so a lent step shares its KV
   reads as well as its weight reads.

   The helper runs at SCHED_IDLE: it takes only the time its core would idle, and every
   other task there (the prompts, the daemon, a load generator) preempts it at once.
   Preempted inside a group, though, it holds up the call until the core idles again,
   and a prompt runs for tens of milliseconds. So the core's owner hands it back at a
   group's boundary: the prefill worker sets `want` in a page both processes map
   (`linear_bf16_lender_take`) and sleeps until no helper is inside a group (`busy`), at
   most a few milliseconds; a helper claims no group while `want` is set. Each side
   stores its own word before it reads the other's (both sequentially consistent), so
   at least one of them sees the other: either the helper does not claim, or the lender
   waits. Anything else that takes the core mid-group holds the call up too: inside a
   one-call decode step the caller then takes the group back ("Taking a group back",
   below); a call that waits anyway is timed (`linear_bf16_helper_held_ns`), and the
   gate then keeps the helper out of the next steps. */
typedef void (*item_fn)(void* ctx, int64_t item, int worker);
typedef void (*commit_fn)(void* ctx, int64_t item);

struct job {
    const uint16_t* w; int64_t N, K; const uint16_t* x; int64_t M, ldx;
    const float* bias; uint16_t* y; int64_t ldy, groups;
    item_fn fn; commit_fn commit; void* ctx; /* set: items of a `linear_bf16_parallel` call */
    int steal;                          /* the caller may take back a held-up helper's group */
};

static struct job jobs[2];
static _Atomic uint64_t claim;         /* generation << 32 | next group */
static _Atomic int64_t finished;       /* groups written in the current call */
static _Atomic uint32_t spin_word;     /* 1: the helper takes part in calls */
static _Atomic uint32_t wake_seq;      /* futex word the helper sleeps on */
static _Atomic int helper_asleep;
static _Atomic int64_t helper_naps;    /* times the helper went to sleep */
static _Atomic int helper_tid;
static _Atomic int helper_state;       /* 0 starting, 1 running at SCHED_IDLE, -1 could not */
static _Atomic int64_t helper_groups;  /* groups the helper wrote, all calls */
static _Atomic int64_t helper_items;   /* items of `linear_bf16_parallel` calls it ran */
static uint32_t generation;            /* the caller's only */
static int helper_running;
static _Atomic int64_t held_ns;        /* the longest a call waited for the helper's groups */

/* Taking a group back from a helper held up inside it.

   A helper at SCHED_IDLE is preempted by anything else that wakes on its core: the
   daemon streaming tokens, a load generator beside it (aiperf took ~0.2 of a 2-core box,
   waking for every streamed chunk, and Linux prefers to wake tasks on a core that runs
   only an idle-class thread). Preempted inside a group, it held the call up until that
   other task let the core go, while the caller spun. Inside `decode_layers` (between linear_bf16_steal_begin and
   _end) the helper instead writes a group to a buffer of its own (`hscratch`, or the
   item function's) and publishes which group it is on in `hslot`; a caller that has
   waited longer than its own groups take (STEAL_AFTER times its mean, at least
   STEAL_MIN_NS) marks the group stolen, computes it itself into the output, and goes on.
   The helper commits its copy only if the mark is still its own (a compare-and-swap
   RUN -> COMMIT), else drops it: either way each group is written once, by the same
   code on the same inputs, so the outputs stay the same bit for bit. A late helper still
   reads the step's inputs, so `_end` waits until it has left its group before the step
   returns (by then it has usually long finished: bursts are short, steps are not). */
enum { H_RUN = 1, H_COMMIT = 2, H_STOLEN = 3 };
#define SLOT(gen, item, state) ((uint64_t)(gen) << 32 | (uint64_t)(item) << 2 | (uint64_t)(state))
#define STEAL_ROWS_MAX 1024                 /* rows of a call whose groups may be taken back */
#define STEAL_AFTER 3
#define STEAL_MIN_NS 20000
static _Atomic uint64_t hslot;              /* the helper's group of a call that may steal */
static _Atomic int steal_mode;              /* set between linear_bf16_steal_begin and _end */
static _Atomic int64_t steals;              /* groups and items taken back, all calls */
static uint16_t hscratch[STEAL_ROWS_MAX * 32] __attribute__((aligned(64)));

/* The page the core's owner (another process) and its borrowers share: a line for
   `want`, and one `busy` line for each decode worker that may borrow the core (its
   slot, with its pid), so a borrower that restarts clears its own word whatever it died
   doing, and the owner clears the word of one that died and did not come back. */
#define LEND_SLOTS 63
struct lend_line { _Atomic uint32_t word; _Atomic int32_t pid; uint32_t pad[14]; };
struct lend_page { struct lend_line want, busy[LEND_SLOTS]; };
static _Atomic uint32_t* _Atomic lend_busy; /* this process's slot, NULL: no owner to ask */
static _Atomic uint32_t* lend_want;

/* How long the helper polls for the next call before it sleeps: longer than the gap
   between two decode steps (the worker's bookkeeping, ~1 ms), so a busy worker never
   has to wake it (waking an idle vCPU can take a millisecond in a VM). */
#define HELPER_SPIN_NS 3000000

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int claim_group(uint32_t gen, int64_t groups, int64_t* g) {
    uint64_t v = atomic_load_explicit(&claim, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(v >> 32) != gen || (int64_t)(v & 0xffffffffu) >= groups) return 0;
        if (atomic_compare_exchange_weak_explicit(&claim, &v, v + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *g = (int64_t)(v & 0xffffffffu);
            return 1;
        }
    }
}

/* A helper may claim a group: not while the core's owner wants the core back. */
static int lend_enter(_Atomic uint32_t* busy) {
    if (!busy) return 1;
    atomic_store_explicit(busy, 1, memory_order_seq_cst);
    if (!atomic_load_explicit(lend_want, memory_order_seq_cst)) return 1;
    atomic_store_explicit(busy, 0, memory_order_release);
    return 0;
}

static void lend_leave(_Atomic uint32_t* busy) {
    if (busy) atomic_store_explicit(busy, 0, memory_order_release);
}

/* Group (or item) g written where it belongs, by the caller (worker 0). */
static void run_in_place(const struct job* j, int64_t g) {
    if (j->fn)
        j->fn(j->ctx, g, 0);
    else
        run_groups(j->w, j->N, j->K, j->x, j->M, j->ldx, j->bias, j->y, j->ldy, g, g + 1);
}

/* The helper's copy of group g: run_groups writes y + m * ldy + n for the group's columns
   n = g * 32 ...; here rows of 32 in hscratch (the pointer is offset back by the group's
   first column, so the same arithmetic lands there). An item function writes its copy
   where it keeps worker 1's. */
static void run_apart(const struct job* j, int64_t g) {
    if (j->fn) {
        j->fn(j->ctx, g, 1);
        return;
    }
    uint16_t* y = (uint16_t*)((uintptr_t)hscratch - (uintptr_t)(g * NT * 16) * 2);
    run_groups(j->w, j->N, j->K, j->x, j->M, j->ldx, j->bias, y, NT * 16, g, g + 1);
}

/* The helper's copy of group g into the output. */
static void copy_in(const struct job* j, int64_t g) {
    if (j->fn) {
        j->commit(j->ctx, g);
        return;
    }
    const int64_t n0 = g * NT * 16, cols = j->N - n0 < NT * 16 ? j->N - n0 : NT * 16;
    for (int64_t m = 0; m < j->M; m++)
        memcpy(j->y + m * j->ldy + n0, hscratch + m * NT * 16, (size_t)cols * 2);
}

static void note_held(int64_t waited) {
    if (waited > atomic_load_explicit(&held_ns, memory_order_relaxed))
        atomic_store_explicit(&held_ns, waited, memory_order_relaxed);
}

/* Returns the groups this thread wrote. */
static int64_t take_groups(const struct job* j, uint32_t gen, int helper) {
    _Atomic uint32_t* const page = helper ? atomic_load(&lend_busy) : NULL;
    int64_t g, done = 0;
    for (;;) {
        if (!lend_enter(page)) break;
        if (!claim_group(gen, j->groups, &g)) {
            lend_leave(page);
            break;
        }
        int counted = 1;
        if (!helper || !(j->steal || j->fn)) {
            run_in_place(j, g);     /* the caller's; a helper's group of a call that cannot steal */
        } else {
            uint64_t mine = SLOT(gen, g, H_RUN);
            if (j->steal) atomic_store_explicit(&hslot, mine, memory_order_seq_cst);
            run_apart(j, g);
            if (!j->steal || atomic_compare_exchange_strong(&hslot, &mine, SLOT(gen, g, H_COMMIT)))
                copy_in(j, g);
            else
                counted = 0;        /* taken back: the caller wrote and counted it */
            if (j->steal) atomic_store_explicit(&hslot, 0, memory_order_release);
        }
        if (counted) {
            if (helper)
                atomic_fetch_add_explicit(j->fn ? &helper_items : &helper_groups, 1,
                                          memory_order_relaxed);
            atomic_fetch_add_explicit(&finished, 1, memory_order_release);
            done++;
        }
        lend_leave(page);
    }
    return done;
}

static void* helper_main(void* arg) {
    (void)arg;
    /* glibc's thread attributes take no SCHED_IDLE: the thread sets it itself, first */
    const struct sched_param idle = {0};
    if (pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle)) {
        atomic_store(&helper_state, -1);
        return NULL;
    }
    atomic_store(&helper_tid, (int)syscall(SYS_gettid));
    atomic_store(&helper_state, 1);
    uint32_t seen = 0;
    int64_t idle_since = now_ns();
    for (;;) {
        const uint64_t v = atomic_load_explicit(&claim, memory_order_acquire);
        const uint32_t gen = (uint32_t)(v >> 32);
        if (gen != seen) {
            seen = gen;
            const struct job j = jobs[gen & 1];
            if ((uint32_t)(atomic_load_explicit(&claim, memory_order_acquire) >> 32) == gen)
                take_groups(&j, gen, 1);
            finish();
            idle_since = now_ns();
        } else if (atomic_load_explicit(&spin_word, memory_order_relaxed)
                   && now_ns() - idle_since < HELPER_SPIN_NS) {
            _mm_pause();
        } else {
            const uint32_t seq = atomic_load(&wake_seq);
            atomic_fetch_add(&helper_naps, 1);
            atomic_store(&helper_asleep, 1);
            if ((uint32_t)(atomic_load(&claim) >> 32) == seen)
                syscall(SYS_futex, &wake_seq, FUTEX_WAIT_PRIVATE, seq, NULL, NULL, 0);
            atomic_store(&helper_asleep, 0);
            idle_since = now_ns();
        }
    }
    return NULL;
}

/* Start the helper pinned to `cpu` at SCHED_IDLE (once); returns 0, or -1 when it cannot
   be (a helper at the normal priority would take its time from the prompts). */
int linear_bf16_helper_start(int cpu) {
    if (helper_running) return 0;
    if (cpu < 0 || cpu >= CPU_SETSIZE) return -1;
    pthread_t t;
    pthread_attr_t attr;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_attr_init(&attr)) return -1;
    atomic_store(&helper_state, 0);
    int rc = pthread_attr_setaffinity_np(&attr, sizeof set, &set);
    if (!rc) rc = pthread_create(&t, &attr, helper_main, NULL);
    pthread_attr_destroy(&attr);
    if (rc) return -1;
    pthread_detach(t);
    const struct timespec nap = {0, 100000};
    while (!atomic_load(&helper_state)) nanosleep(&nap, NULL);   /* it says at once */
    if (atomic_load(&helper_state) < 0) return -1;
    helper_running = 1;
    return 0;
}

/* on: the helper takes part in calls from now on (woken if asleep); off: it sleeps.
   Returns 1 when the helper was asleep (its wake-up then shows as run-queue wait). */
int linear_bf16_helper_spin(int on) {
    const int asleep = atomic_load(&helper_asleep);
    atomic_store(&spin_word, on ? 1u : 0u);
    if (on && asleep) {
        atomic_fetch_add(&wake_seq, 1);
        syscall(SYS_futex, &wake_seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
    return asleep;
}

/* 1 while the helper sleeps; the times it went to sleep (tests: that it sleeps when
   told, and by itself once calls stop). */
int linear_bf16_helper_asleep(void) { return atomic_load(&helper_asleep); }
int64_t linear_bf16_helper_naps(void) { return atomic_load(&helper_naps); }

/* Weight groups the helper has written, items it has run (tests: that it took part). */
int64_t linear_bf16_helper_groups(void) { return atomic_load(&helper_groups); }
int64_t linear_bf16_helper_items(void) { return atomic_load(&helper_items); }

/* The helper's thread id (for its /proc schedstat), 0 before it runs. */
int linear_bf16_helper_tid(void) { return atomic_load(&helper_tid); }

/* The longest a call waited for the helper to finish its groups since the last ask
   (ns); asking resets it. */
int64_t linear_bf16_helper_held_ns(void) { return atomic_exchange(&held_ns, 0); }

/* Share `page` (4 KB, mapped by the core's owner too) with the owner, as borrower
   `slot`: from now on the helper claims no group while the core is wanted. Returns -1
   for a slot out of range. */
int linear_bf16_helper_lend(void* page, int slot) {
    if (slot < 0 || slot >= LEND_SLOTS) return -1;
    struct lend_page* p = page;
    atomic_store(&p->busy[slot].word, 0);
    atomic_store(&p->busy[slot].pid, (int32_t)getpid());
    lend_want = &p->want.word;
    atomic_store(&lend_busy, &p->busy[slot].word);
    return 0;
}

static int lend_any_busy(struct lend_page* p, memory_order order) {
    for (int i = 0; i < LEND_SLOTS; i++)
        if (atomic_load_explicit(&p->busy[i].word, order)) return 1;
    return 0;
}

/* Clear the words of borrowers that died inside a group (else every later step of the
   owner would wait `max_ns` for them); 1 when any left is busy. */
static int lend_reap(struct lend_page* p) {
    int busy = 0;
    for (int i = 0; i < LEND_SLOTS; i++) {
        if (!atomic_load(&p->busy[i].word)) continue;
        const int32_t pid = atomic_load(&p->busy[i].pid);
        if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH)
            atomic_store(&p->busy[i].word, 0);
        else
            busy = 1;
    }
    return busy;
}

/* The core's owner takes it back: `want` set, then sleep in steps of 50 us until no
   helper is inside a group, at most `max_ns`. Returns the ns waited, -1 when it gave up
   (a helper still inside a group: it was preempted there by something else). */
int64_t linear_bf16_lender_take(void* page, int64_t max_ns) {
    struct lend_page* p = page;
    atomic_store_explicit(&p->want.word, 1, memory_order_seq_cst);
    if (!lend_any_busy(p, memory_order_seq_cst)) return 0;
    const int64_t t0 = now_ns();
    const struct timespec nap = {0, 50000};
    for (;;) {
        const int64_t waited = now_ns() - t0;
        if (!lend_any_busy(p, memory_order_acquire)) return waited;
        if (waited >= max_ns) return lend_reap(p) ? -1 : waited;
        nanosleep(&nap, NULL);
    }
}

/* The core's owner lends it again (it is about to idle). */
void linear_bf16_lender_give(void* page) {
    atomic_store_explicit(&((struct lend_page*)page)->want.word, 0, memory_order_release);
}

/* One call's groups (or items) between the caller and the helper. */
static void share(struct job j) {
    const uint32_t gen = ++generation;
    jobs[gen & 1] = j;
    atomic_store_explicit(&finished, 0, memory_order_relaxed);
    atomic_store_explicit(&claim, (uint64_t)gen << 32, memory_order_release);
    const int64_t t0 = now_ns();
    const int64_t mine = take_groups(&jobs[gen & 1], gen, 0);
    if (atomic_load_explicit(&finished, memory_order_acquire) < j.groups) {
        const int64_t t1 = now_ns();
        int64_t after = STEAL_AFTER * (t1 - t0) / (mine ? mine : 1);
        if (after < STEAL_MIN_NS) after = STEAL_MIN_NS;
        while (atomic_load_explicit(&finished, memory_order_acquire) < j.groups) {
            uint64_t v;
            if (j.steal && now_ns() - t1 > after
                && (uint32_t)((v = atomic_load_explicit(&hslot, memory_order_acquire)) >> 32) == gen
                && (v & 3) == H_RUN
                && atomic_compare_exchange_strong(&hslot, &v, (v & ~(uint64_t)3) | H_STOLEN)) {
                run_in_place(&j, (int64_t)((v & 0xffffffffu) >> 2));
                atomic_fetch_add_explicit(&steals, 1, memory_order_relaxed);
                atomic_fetch_add_explicit(&finished, 1, memory_order_release);
                continue;
            }
            _mm_pause();
        }
        note_held(now_ns() - t1);
    }
    finish();
}

/* Calls from here on may take a held-up helper's group back (decode_layers.c: the
   step's buffers outlive every call in it). */
void linear_bf16_steal_begin(void) { atomic_store(&steal_mode, 1); }

/* The step is over: no more taking back, and once the helper has left a group it was
   held up in (it still reads the step's inputs), the caller may free them. */
void linear_bf16_steal_end(void) {
    atomic_store(&steal_mode, 0);
    if (!atomic_load_explicit(&hslot, memory_order_acquire)) return;
    const int64_t t0 = now_ns();
    while (atomic_load_explicit(&hslot, memory_order_acquire)) _mm_pause();
    note_held(now_ns() - t0);
}

/* Groups and items the callers took back from a held-up helper, all calls. */
int64_t linear_bf16_helper_steals(void) { return atomic_load(&steals); }

/* Returns 0, or -1 for an odd K. */
int linear_bf16(const uint16_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M,
                int64_t ldx, const float* bias, uint16_t* y, int64_t ldy) {
    if (K % 2) return -1;
    const int64_t groups = ((N + 15) / 16 + NT - 1) / NT;
    if (!helper_running || !atomic_load_explicit(&spin_word, memory_order_relaxed) || groups < 4) {
        run_groups(w, N, K, x, M, ldx, bias, y, ldy, 0, groups);
        finish();
        return 0;
    }
    share((struct job){w, N, K, x, M, ldx, bias, y, ldy, groups, NULL, NULL, NULL,
                       atomic_load(&steal_mode) && M <= STEAL_ROWS_MAX});
    return 0;
}

/* Run fn(ctx, item, worker) for every item in [0, items): worker 0 is the caller, writing
   the item's output where it belongs; 1 the helper when it takes part (as for the
   matmuls: while the caller lets it spin), writing it to a place of its own, from which
   commit(ctx, item) then copies it (unless the caller took the item back meanwhile: see
   "Taking a group back"), so fn keeps per-worker state apart by `worker`. Returns once
   every item is written. Returns 1 when the helper could take part, 0 when the caller
   ran them all. */
int linear_bf16_parallel(item_fn fn, commit_fn commit, void* ctx, int64_t items) {
    if (!helper_running || !atomic_load_explicit(&spin_word, memory_order_relaxed) || items < 2) {
        for (int64_t i = 0; i < items; i++) fn(ctx, i, 0);
        return 0;
    }
    share((struct job){NULL, 0, 0, NULL, 0, 0, NULL, NULL, 0, items, fn, commit, ctx,
                       atomic_load(&steal_mode)});
    return 1;
}
