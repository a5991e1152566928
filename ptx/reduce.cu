// Reductions into global memory and the release/acquire pair that orders them between CTAs
// (sm_80+). One inline-asm statement per function; every function is inlined by LTO.

// Generic address of a float32 / int32 global array, as a 64-bit integer to step.
extern "C" __device__ long long global_address_f32(const float* p) { return (long long)p; }
extern "C" __device__ long long global_address_i32(const int* p) { return (long long)p; }
// *addr += v in global memory, with no result (red: the add happens in L2; relaxed order).
extern "C" __device__ void red_global_add_f32(long long addr, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" :: "l"(addr), "f"(v) : "memory");
}
// *addr at GPU scope with acquire order: later reads see what the releasing CTA wrote before.
extern "C" __device__ int ld_acquire_gpu_s32(long long addr) {
  int r; asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(r) : "l"(addr) : "memory"); return r;
}
// *addr += v at GPU scope with release order: what this thread saw before is visible first.
extern "C" __device__ void red_release_gpu_add_s32(long long addr, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(addr), "r"(v) : "memory");
}
// addr[0..3] += (a, b, c, d), float32, addr 16-byte aligned, no result, relaxed (sm_90 on).
extern "C" __device__ void red_global_add_v4_f32(long long addr, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
// old = *addr; *addr += v, at GPU scope with acquire and release order (a ticket: what this thread
// saw before is visible first, and what the CTAs that took earlier tickets wrote is seen after).
extern "C" __device__ int atom_add_acq_rel_gpu_s32(long long addr, int v) {
  int r; asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(r) : "l"(addr), "r"(v) : "memory"); return r;
}
// r[0..3] = addr[0..3], float32, addr 16-byte aligned, a relaxed load at GPU scope: it reads L2,
// so that after an acquire it sees what other CTAs reduced there (never a stale L1 line).
extern "C" __device__ void ld_relaxed_gpu_v4_f32(float* r, long long addr) {
  asm volatile("ld.relaxed.gpu.global.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(r[0]), "=f"(r[1]), "=f"(r[2]), "=f"(r[3]) : "l"(addr) : "memory");
}
