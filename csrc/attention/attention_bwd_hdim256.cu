// One head dim per translation unit: the backward kernels build in parallel.
#include "attention/attention_launch.cuh"

namespace fusedattn {
template void run_attention_backward<__half, 256>(const AttentionParams&, cudaStream_t);
template void run_attention_backward<__nv_bfloat16, 256>(const AttentionParams&, cudaStream_t);
template int fused_backward_dq_splits<__half, 256>(const AttentionParams&);
template int fused_backward_dq_splits<__nv_bfloat16, 256>(const AttentionParams&);
}  // namespace fusedattn
