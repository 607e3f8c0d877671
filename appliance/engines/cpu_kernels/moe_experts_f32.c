/* moe_experts.c in fp32: a mixture of experts' SwiGLU experts for one step in one call
   through linear_f32 and layer_glue_f32, for a CPU without AVX-512 whose workers hold fp32
   weights. That file says why; here only the element type differs.
   Built by appliance/engines/cpu_kernels/builder.py, which hashes the file included here
   into this kernel's cache key. */
#define MOE_EXPERTS_F32 1
#include "moe_experts.c"
