/* How fast one core reads scattered chunks, as one stream or several: the ceiling under
   the decode-attention kernel (paged_decode.c), which reads each sequence's K and V
   blocks (8 KB each at the 82m shape) in an order the hardware cannot guess.

   A buffer of MB megabytes is cut into CHUNK-byte pieces visited in a random order;
   STREAMS pieces are read side by side (a line of each in turn), or, with a PREFETCH
   distance, one at a time with every line of the piece that many places ahead prefetched
   into L2 as it goes (what the kernel does 16 positions ahead). Prints the best of five
   passes in GB/s. Not built by the project: a probe for docs/benchmarks.md (session 37).

       cc -O2 -mavx512f bench/read_streams.c -o /tmp/read_streams   # -mavx2 without AVX-512
       taskset -c 1 /tmp/read_streams 8192 1 256      # CHUNK STREAMS MB
       taskset -c 1 /tmp/read_streams 8192 4 256
       taskset -c 1 /tmp/read_streams 8192 1 256 2    # ... PREFETCH (pieces ahead)
*/
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* a line's 64 bytes in one 512-bit load, or two 256-bit ones on a CPU without AVX-512
   (session 63's Zen 3) */
#ifdef __AVX512F__
#define VEC __m512i
#define ZERO() _mm512_setzero_si512()
#define ADD(a, b) _mm512_add_epi32(a, b)
#define LINE(p) _mm512_load_si512(p)
#define FIRST(v) _mm512_reduce_add_epi32(v)
#else
#define VEC __m256i
#define ZERO() _mm256_setzero_si256()
#define ADD(a, b) _mm256_add_epi32(a, b)
#define LINE(p) _mm256_add_epi32(_mm256_load_si256((const __m256i*)(p)), \
                                 _mm256_load_si256((const __m256i*)((p) + 32)))
#define FIRST(v) _mm256_extract_epi32(v, 0)
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s CHUNK STREAMS MB [PREFETCH]\n", argv[0]);
        return 2;
    }
    const size_t chunk = (size_t)atol(argv[1]), streams = (size_t)atol(argv[2]);
    const size_t total = (size_t)atol(argv[3]) << 20;
    const size_t ahead = argc > 4 ? (size_t)atol(argv[4]) : 0;
    if (chunk < 64 || chunk % 64 || streams < 1 || streams > 8 || total < chunk * streams) {
        fprintf(stderr, "CHUNK a multiple of 64, STREAMS 1-8, MB at least CHUNK x STREAMS\n");
        return 2;
    }
    char* buf = aligned_alloc(4096, total);
    if (!buf) return 1;
    memset(buf, 1, total);   /* touched: not the shared zero page */
    const size_t pieces = total / chunk, lines = chunk / 64;
    uint32_t* order = malloc(pieces * sizeof *order);
    for (size_t i = 0; i < pieces; i++) order[i] = (uint32_t)i;
    srand(1);
    for (size_t i = pieces - 1; i > 0; i--) {
        const size_t j = (size_t)rand() % (i + 1);
        const uint32_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    double best = 0;
    int64_t keep = 0;
    for (int pass = 0; pass < 5; pass++) {
        VEC acc[8];
        for (int s = 0; s < 8; s++) acc[s] = ZERO();
        const double t0 = now();
        for (size_t p = 0; p + streams <= pieces; p += streams) {
            const char* next = ahead && p + ahead < pieces ? buf + (size_t)order[p + ahead] * chunk : NULL;
            for (size_t l = 0; l < lines; l++) {
                if (next) _mm_prefetch(next + l * 64, _MM_HINT_T1);
                for (size_t s = 0; s < streams; s++)
                    acc[s] = ADD(acc[s], LINE(buf + (size_t)order[p + s] * chunk + l * 64));
            }
        }
        const double gbs = (double)(pieces / streams * streams * chunk) / (now() - t0) / 1e9;
        if (gbs > best) best = gbs;
        for (int s = 1; s < 8; s++) acc[0] = ADD(acc[0], acc[s]);
        keep += FIRST(acc[0]);
    }
    printf("%zu MB in %zu-byte pieces, %zu stream(s), prefetch %zu ahead: %.2f GB/s (%lld)\n",
           total >> 20, chunk, streams, ahead, best, (long long)(keep & 1));
    free(order);
    free(buf);
    return 0;
}
