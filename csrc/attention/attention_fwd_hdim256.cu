// One head dim per translation unit: the forward kernels build in parallel.
#include "attention/attention_launch.cuh"

namespace fusedattn {
template void run_attention_forward<__half, 256>(const AttentionParams&, cudaStream_t);
template void run_attention_forward<__nv_bfloat16, 256>(const AttentionParams&, cudaStream_t);
}  // namespace fusedattn
