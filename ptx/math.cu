// Special functions of the MUFU unit not in convert.cu. One inline-asm statement per function;
// every function is inlined by LTO.

// tanh(x), approximate (tanh.approx.f32, sm_75+): maximum relative error about 2^-11 over the
// whole range; tanh(+-inf) = +-1, tanh(+-0) = +-0, tanh(NaN) = NaN. Softcapping's tanh.
extern "C" __device__ float tanh_approx_f32(float x) {
  float r; asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}
