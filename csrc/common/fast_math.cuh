// Fast math shared by the kernels.
#pragma once

namespace fusedattn {

// 2^x in one MUFU instruction (2 ulp; denormal results flush to 0); ex2(-inf) = +0, so masked
// scores vanish exactly. exp2f without fast-math adds a range check and two multiplies.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace fusedattn
