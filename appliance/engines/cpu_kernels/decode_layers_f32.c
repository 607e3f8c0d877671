/* decode_layers.c in fp32: a decode step's layers in one call through linear_f32,
   paged_decode_f32 and layer_glue_f32, for a CPU without AVX-512 whose workers hold fp32
   weights and KV. That file says why; here only the element type differs. There is no
   helper thread for these kernels, so `decode_layers_bind` is given none and every
   layer's attention runs on the caller.
   Built by appliance/engines/cpu_kernels/builder.py, which hashes the file included here
   into this kernel's cache key. */
#define DECODE_LAYERS_F32 1
#include "decode_layers.c"
