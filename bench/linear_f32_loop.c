/* The fp32 matmul kernel (appliance/engines/cpu_kernels/linear_f32.c) alone, called from C:
   one decode step's matmuls over 12 layers of the 82m shape (qkv 1280 x 768, o 768 x 768,
   gate/up 4096 x 768, down 768 x 2048: 302 MB of fp32 weights, so no cache holds them),
   ROWS input rows each. Prints the best and the median pass and a checksum of the outputs
   (equal across kernel versions that sum each output in the same order). Without Python
   between calls, so two versions of the file can be timed against each other by turns.
   Not built by the project: a probe for docs/benchmarks.md (session 67).

       cc -O3 -march=native -ffp-contract=off bench/linear_f32_loop.c \
          appliance/engines/cpu_kernels/linear_f32.c -o /tmp/lfl
       taskset -c 1 /tmp/lfl 4        # ROWS [PASSES]
*/
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int linear_f32(const float* packed, int64_t N, int64_t K, const float* x, int64_t M,
               int64_t ldx, const float* bias, float* y, int64_t ldy);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float* random_floats(size_t n) {
    float* p = aligned_alloc(4096, (n * sizeof(float) + 4095) / 4096 * 4096);
    for (size_t i = 0; i < n; i++) p[i] = (rand() % 1000 - 500) * 1e-4f;
    return p;
}

static int cmp(const void* a, const void* b) {
    const double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

int main(int argc, char** argv) {
    const int M = argc > 1 ? atoi(argv[1]) : 0;
    const int passes = argc > 2 ? atoi(argv[2]) : 20;
    if (M < 1 || M > 512 || passes < 1) {
        fprintf(stderr, "usage: %s ROWS [PASSES]   (ROWS 1-512)\n", argv[0]);
        return 2;
    }
    enum { L = 12, PER = 4 };
    const int64_t shape[PER][2] = {{1280, 768}, {768, 768}, {4096, 768}, {768, 2048}};
    float* w[L][PER];
    size_t bytes = 0;
    srand(1);
    for (int l = 0; l < L; l++)
        for (int i = 0; i < PER; i++) {
            /* the packed layout: ceil(N/16) panels of K lines of 16 */
            const size_t n = (size_t)((shape[i][0] + 15) / 16) * 16 * shape[i][1];
            w[l][i] = random_floats(n);
            bytes += n * sizeof(float);
        }
    float* x = random_floats((size_t)M * 4096);
    float* y = random_floats((size_t)M * 4096);
    double* t = malloc(passes * sizeof(double));
    double sum = 0;
    for (int p = 0; p < passes; p++) {
        const double t0 = now();
        for (int l = 0; l < L; l++)
            for (int i = 0; i < PER; i++) {
                const int64_t N = shape[i][0], K = shape[i][1];
                if (linear_f32(w[l][i], N, K, x, M, 4096, 0, y, 4096)) {
                    fprintf(stderr, "linear_f32 refused N=%ld K=%ld\n", (long)N, (long)K);
                    return 1;
                }
                if (p == 0)
                    for (int r = 0; r < M; r++)
                        for (int64_t c = 0; c < N; c++) sum += y[(size_t)r * 4096 + c] * (c % 7 + 1);
            }
        t[p] = now() - t0;
    }
    qsort(t, passes, sizeof(double), cmp);
    printf("%3d rows: best %6.2f ms (%4.1f GB/s), median %6.2f ms, checksum %.9g\n", M,
           t[0] * 1e3, bytes / t[0] / 1e9, t[passes / 2] * 1e3, sum);
    return 0;
}
