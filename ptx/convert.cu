// Conversions and special functions. 16-bit results are returned as bits (never as half by value).

// Two f32 -> packed f16x2 (round to nearest even); lo goes to the low half.
extern "C" __device__ unsigned cvt_rn_f16x2_f32(float lo, float hi) {
  unsigned r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
// Two f32 -> packed bf16x2 (round to nearest even); lo goes to the low half.
extern "C" __device__ unsigned cvt_rn_bf16x2_f32(float lo, float hi) {
  unsigned r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
// 2^x, approximate (about 2 ulp), subnormals flushed to zero; ex2(-inf) = 0.
extern "C" __device__ float ex2_approx_ftz_f32(float x) {
  float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}
// 1/x, approximate (rcp.approx.ftz.f32, max error ~1 ulp).
extern "C" __device__ float rcp_approx_ftz_f32(float x) {
  float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}
// log2(x), approximate (lg2.approx.ftz.f32); lg2(0) = -inf.
extern "C" __device__ float lg2_approx_ftz_f32(float x) {
  float r; asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}
