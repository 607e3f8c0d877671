/* The floors under a served request of the 82m shape on this core: how fast the bf16
   matmul kernel (appliance/engines/cpu_kernels/linear_bf16.c, included as it is built)
   streams the layers' weights at a decode step's few rows, and how many GFLOPS it makes
   at a prefill step's 512 rows (two 256-token prompts); first, a plain read of the same
   weights in the same order with no arithmetic, the stream's own floor.

   Why: against vLLM the rate follows the CPU a request costs, and that cost is mostly a
   prompt (compute-bound) plus 64 decode steps of a few rows (bound by reading the
   weights). With bench/bf16_peak.c this tells how far a served figure is from what the
   kernels reach on this host, without Python or torch around the calls (torch's output
   allocation per call costs a 512-row call ~25% in bench_linear_kernel.py).

   The 82m layers: 12 x (qkv 1280x768, o 768x768, gate/up 4096x768, down 768x2048), 151 MB
   of bf16, each matrix on its own memory advised for huge pages, as the engine keeps
   them; every pass multiplies every matrix once, in a forward pass's order. With a CPU
   number as the second argument, a neighbour thread pinned there streams its own copy of
   the weights at 4 rows the whole time, as a decode worker beside a prefill worker does.
   Where the CPU has AMX it runs on AMX's tiles, as the engine does (it asks Linux for the
   tile state at load); without asking, the same calls take the AVX512-BF16 path.

       gcc -O3 -march=native -ffp-contract=off -o /tmp/kernel_floors bench/kernel_floors.c -lpthread
       taskset -c 1 /tmp/kernel_floors 30          # passes per row count
       taskset -c 1 /tmp/kernel_floors 30 0        # ... with the neighbour on core 0 */
#include "../appliance/engines/cpu_kernels/linear_bf16.c"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#define LAYERS 12
static const int64_t SHAPES[4][2] = {{1280, 768}, {768, 768}, {4096, 768}, {768, 2048}};

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

struct model {
    uint16_t* w[LAYERS][4];
    uint16_t *x, *y; /* [rows, 4096] at most */
};

static void model_init(struct model* m, int64_t max_rows) {
    for (int l = 0; l < LAYERS; l++)
        for (int s = 0; s < 4; s++) {
            const size_t n = (size_t)(SHAPES[s][0] * SHAPES[s][1]);
            const size_t bytes = (n * 2 + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
            uint16_t* w = aligned_alloc(2u << 20, bytes);
            if (!w) { perror("kernel_floors"); exit(1); }
            madvise(w, bytes, MADV_HUGEPAGE);
            for (size_t i = 0; i < n; i++) w[i] = (uint16_t)(0x3c00 + (i * 2654435761u >> 25));
            m->w[l][s] = w;
        }
    m->x = aligned_alloc(64, (size_t)max_rows * 4096 * 2);
    m->y = aligned_alloc(64, (size_t)max_rows * 4096 * 2);
    for (int64_t i = 0; i < max_rows * 4096; i++) m->x[i] = (uint16_t)(0x3c00 + (i * 40503u >> 24));
}

static void pass(const struct model* m, int64_t rows) {
    for (int l = 0; l < LAYERS; l++)
        for (int s = 0; s < 4; s++)
            linear_bf16(m->w[l][s], SHAPES[s][0], SHAPES[s][1], m->x, rows, SHAPES[s][1], NULL,
                        m->y, SHAPES[s][0]);
}

static volatile float sink; /* keeps plain_read's loads */

/* every weight byte read once in the same order, no arithmetic: the stream's own floor */
static void plain_read(const struct model* m) {
    __m512 a = _mm512_setzero_ps(), b = a;
    for (int l = 0; l < LAYERS; l++)
        for (int s = 0; s < 4; s++) {
            const __m512i* w = (const __m512i*)m->w[l][s];
            const int64_t n = SHAPES[s][0] * SHAPES[s][1] / 32;
            for (int64_t i = 0; i + 1 < n; i += 2) {
                a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_load_si512(w + i)));
                b = _mm512_add_ps(b, _mm512_castsi512_ps(_mm512_load_si512(w + i + 1)));
            }
        }
    sink = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}

static void* neighbour(void* arg) {
    const struct model* m = arg;
    for (;;) pass(m, 4);
    return NULL;
}

static int cmp(const void* a, const void* b) {
    const double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

int main(int argc, char** argv) {
    const int passes = argc > 1 ? atoi(argv[1]) : 30;
    if (passes < 1) { fprintf(stderr, "kernel_floors: passes must be >= 1\n"); return 2; }
    struct model m;
    model_init(&m, 512);
    printf("path: %s\n", linear_bf16_amx() ? "AMX tiles" : "AVX512-BF16 (no AMX here)");
    if (argc > 2) {
        static struct model other;
        model_init(&other, 4);
        pthread_attr_t attr;
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(atoi(argv[2]), &set);
        pthread_attr_init(&attr);
        pthread_attr_setaffinity_np(&attr, sizeof set, &set);
        pthread_t t;
        if (pthread_create(&t, &attr, neighbour, &other)) {
            fprintf(stderr, "kernel_floors: no neighbour thread on CPU %s\n", argv[2]);
            return 2;
        }
        printf("a neighbour streams its own weights at 4 rows on CPU %s\n", argv[2]);
    }
    double weights = 0;
    for (int s = 0; s < 4; s++) weights += (double)LAYERS * SHAPES[s][0] * SHAPES[s][1];
    /* bf16: two bytes a weight; a multiply-add a weight per row */
    const double bytes = 2 * weights, flops_per_row = 2 * weights;
    {
        double t[10];
        plain_read(&m);
        for (int i = 0; i < 10; i++) {
            const double t0 = seconds();
            plain_read(&m);
            t[i] = seconds() - t0;
        }
        qsort(t, 10, sizeof *t, cmp);
        printf("plain read: best %7.2f ms, median %7.2f ms a pass of %.0f MB: %5.1f / %5.1f GB/s\n",
               t[0] * 1e3, t[5] * 1e3, bytes / 1e6, bytes / t[0] / 1e9, bytes / t[5] / 1e9);
    }
    const int64_t rows[] = {1, 3, 5, 8, 32, 512};
    for (size_t r = 0; r < sizeof rows / sizeof *rows; r++) {
        const int n = rows[r] > 16 ? (passes + 9) / 10 + 2 : passes;
        double* t = malloc(sizeof(double) * n);
        pass(&m, rows[r]); /* warm: first touch, the kernel's paths */
        for (int i = 0; i < n; i++) {
            const double t0 = seconds();
            pass(&m, rows[r]);
            t[i] = seconds() - t0;
        }
        qsort(t, n, sizeof *t, cmp);
        const double best = t[0], med = t[n / 2];
        printf("%3ld rows: best %7.2f ms, median %7.2f ms a pass of %.0f MB: %5.1f / %5.1f GB/s, "
               "%5.1f / %5.1f GFLOPS\n",
               (long)rows[r], best * 1e3, med * 1e3, bytes / 1e6, bytes / best / 1e9,
               bytes / med / 1e9, flops_per_row * rows[r] / best / 1e9,
               flops_per_row * rows[r] / med / 1e9);
        free(t);
    }
    return 0;
}
