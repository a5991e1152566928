// Conversions and special functions. 16-bit results are returned as bits (never as half by value).

// Two f32 -> packed f16x2 (round to nearest even); lo goes to the low half.
extern "C" __device__ unsigned cvt_rn_f16x2_f32(float lo, float hi) {
  unsigned r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
// Two f32 -> packed bf16x2 (round to nearest even); lo goes to the low half.
extern "C" __device__ unsigned cvt_rn_bf16x2_f32(float lo, float hi) {
  unsigned r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
// Four f32 -> four e4m3 (sm_89+: round to nearest even, finite values past +-448 saturate to
// +-448, NaN stays NaN), packed in one register: a0 in bits 0-7, a1 in 8-15, a2 in 16-23, a3 in
// 24-31 (the byte order of an 8-bit mma.sync operand register: a0 is the lowest column).
extern "C" __device__ unsigned cvt_rn_satfinite_e4m3x4_f32(float a0, float a1, float a2, float a3) {
  unsigned r;
  asm("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1; cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;"
      " mov.b32 %0, {lo, hi}; }" : "=r"(r) : "f"(a0), "f"(a1), "f"(a2), "f"(a3));
  return r;
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
// 2^x without the MUFU unit (FMA and integer pipes only), so that a kernel bound by the
// exponential unit can move part of its exponentials elsewhere (FlashAttention-4's idea):
// x + 1.5*2^23 rounds x to an integer n in the low mantissa bits; 2^(x-n), x-n in [-0.5, 0.5],
// is a degree-3 polynomial (relative error < 8e-5, minimax fit); n is added to the exponent
// field. x < -126 gives 0 (so -inf gives exactly 0, as ex2 does); x must be <= 127.
extern "C" __device__ float ex2_poly3_f32(float x) {
  const float shifter = 12582912.0f;
  float t = __fadd_rn(x, shifter);
  float f = __fsub_rn(x, __fsub_rn(t, shifter));
  float p = fmaf(fmaf(fmaf(0.0551716573536396f, f, 0.2426111400127411f), f, 0.6932609677314758f), f,
                 0.9999280571937561f);
  int bits = __float_as_int(p) + (__float_as_int(t) << 23);
  return x < -126.0f ? 0.0f : __int_as_float(bits);
}
// f16 bits (the low half of h) -> f32, exactly.
extern "C" __device__ float cvt_f32_f16_bits(unsigned h) {
  float r; asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.f32.f16 %0, t; }" : "=f"(r) : "r"(h)); return r;
}
// bf16 bits (the low half of h) -> f32, exactly: they are the f32's high half.
extern "C" __device__ float cvt_f32_bf16_bits(unsigned h) {
  float r; asm("{ .reg .b32 t; shl.b32 t, %1, 16; mov.b32 %0, t; }" : "=f"(r) : "r"(h)); return r;
}
// Byte permute (prmt.b32, default mode): byte i of the result is byte (selector >> 4i) & 7 of the
// eight bytes {b, a} (a's bytes 0-3, then b's 4-7); four bytes of two registers in one instruction.
extern "C" __device__ unsigned prmt_b32(unsigned a, unsigned b, unsigned selector) {
  unsigned r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector)); return r;
}
