// Asynchronous global->shared copies (sm_80+) and 16-byte vector moves.
// One inline-asm statement per function; every function is inlined by LTO.

// Generic pointer to a shared array -> 32-bit shared-window address (cvta.to.shared).
extern "C" __device__ unsigned cvta_to_shared_u16(const unsigned short* p) {
  unsigned a; asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p)); return a;
}
extern "C" __device__ unsigned cvta_to_shared_u32(const unsigned* p) {
  unsigned a; asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p)); return a;
}
extern "C" __device__ unsigned cvta_to_shared_f32(const float* p) {
  unsigned a; asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p)); return a;
}
extern "C" __device__ unsigned cvta_to_shared_u64(const unsigned long long* p) {
  unsigned a; asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p)); return a;
}

// 16 bytes global -> shared, cached in L2 only. Source: base + offset (16-bit elements).
extern "C" __device__ void cp_async_cg_shared_global_16(unsigned dst, const unsigned short* base,
                                                        long long offset) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(base + offset) : "memory");
}
// Same with a source size: bytes past src_bytes (0 or 16) are written as zeros, nothing is read.
extern "C" __device__ void cp_async_cg_shared_global_16_zfill(unsigned dst, const unsigned short* base,
                                                             long long offset, unsigned src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(base + offset), "r"(src_bytes) : "memory");
}
// The same two copies from a global byte address (a generic address of global memory): the
// kernel keeps one 64-bit address a thread and steps it, instead of base + index each copy.
extern "C" __device__ long long global_address_u16(const unsigned short* p) { return (long long)p; }
extern "C" __device__ void cp_async_cg_16_at(unsigned dst, long long src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
extern "C" __device__ void cp_async_cg_16_zfill_at(unsigned dst, long long src, unsigned src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
extern "C" __device__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;" ::: "memory"); }
extern "C" __device__ void cp_async_wait_group_0() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
extern "C" __device__ void cp_async_wait_group_1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
extern "C" __device__ void cp_async_wait_group_2() { asm volatile("cp.async.wait_group 2;" ::: "memory"); }
extern "C" __device__ void cp_async_wait_group_3() { asm volatile("cp.async.wait_group 3;" ::: "memory"); }

// 16-byte vector load from shared memory into four 32-bit registers.
extern "C" __device__ void ld_shared_v4_b32(unsigned* r, unsigned addr) {
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
// 16-byte vector store of four 32-bit registers to shared memory.
extern "C" __device__ void st_shared_v4_b32(unsigned addr, const unsigned* r) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
// 16-byte vector store of four floats to shared memory (a dQ fragment staged for a bulk reduce).
extern "C" __device__ void st_shared_v4_f32(unsigned addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
// 32-bit load of a float from shared memory (a byte address in the shared window).
extern "C" __device__ float ld_shared_f32(unsigned addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
// 32-bit load of a word from shared memory (a byte address in the shared window).
extern "C" __device__ unsigned ld_shared_b32(unsigned addr) {
  unsigned v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// 32-bit store to shared memory (one packed pair of 16-bit values).
extern "C" __device__ void st_shared_b32(unsigned addr, unsigned v) {
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}
// 16-byte vector store of four 32-bit registers to global memory at base + offset (16-bit elements).
extern "C" __device__ void st_global_v4_b32(unsigned short* base, long long offset, const unsigned* r) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
               :: "l"(base + offset), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
// 16-byte vector load from the global byte address addr through the read-only (non-coherent)
// path: only for memory that no thread writes while the kernel runs.
extern "C" __device__ void ld_global_nc_v4_b32_at(unsigned* r, long long addr) {
  asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(addr));
}
// 16-byte vector store to the global byte address addr.
extern "C" __device__ void st_global_v4_b32_at(long long addr, const unsigned* r) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
               :: "l"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
