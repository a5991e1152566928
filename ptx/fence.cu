// Proxy fences and register reallocation (sm_90 / sm_90a).

// Order this thread's generic-proxy shared-memory accesses (ordinary stores, stmatrix)
// before later async-proxy accesses (wgmma operand reads, TMA stores), and vice versa.
// Each writing thread executes it, then the threads synchronise (barrier or mbarrier).
extern "C" __device__ void fence_proxy_async_shared_cta() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// A CTA-scope acquire-release fence (MEMBAR.ALL.CTA) once a and b are computed. The forward's
// consumers use it where no memory needs ordering, as a fence for the compilers' schedulers:
// passed the row sums, it comes after every exponential that feeds them (NVVM may not sink them
// below it), and ptxas does not hoist a wgmma.wait_group above it, so the wait that retires the
// PV product stays below the softmax's exponentials, which then run beside PV
// (WsConfig.late_pv_wait; docs/PERFORMANCE.md [WAITPOS]). The fence names no register, so
// ptxas may still move it, and the wait, above ALU work where nothing else orders them.
extern "C" __device__ void fence_acq_rel_cta_after(float a, float b) {
  asm volatile("fence.acq_rel.cta;" :: "f"(a), "f"(b) : "memory");
}
// Acquire a 128-byte tensor map in global memory for the tensormap proxy (needed only when
// the map was written after the launch began, e.g. by device code).
extern "C" __device__ void fence_proxy_tensormap_acquire(const unsigned long long* tmap) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(tmap) : "memory");
}

// setmaxnreg (sm_90a): change this warpgroup's per-thread register budget; all 4 warps of
// the warpgroup execute the same one. dec returns registers to the CTA pool; inc blocks
// until the pool has enough. Takes effect only when the kernel has a register cap at entry
// (launch bounds with min blocks, or a max-register count).
extern "C" __device__ void setmaxnreg_dec_24() { asm volatile("setmaxnreg.dec.sync.aligned.u32 24;" ::: "memory"); }
extern "C" __device__ void setmaxnreg_dec_32() { asm volatile("setmaxnreg.dec.sync.aligned.u32 32;" ::: "memory"); }
extern "C" __device__ void setmaxnreg_dec_40() { asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory"); }
extern "C" __device__ void setmaxnreg_dec_56() { asm volatile("setmaxnreg.dec.sync.aligned.u32 56;" ::: "memory"); }
extern "C" __device__ void setmaxnreg_inc_160() { asm volatile("setmaxnreg.inc.sync.aligned.u32 160;" ::: "memory"); }
extern "C" __device__ void setmaxnreg_inc_224() { asm volatile("setmaxnreg.inc.sync.aligned.u32 224;" ::: "memory"); }
extern "C" __device__ void setmaxnreg_inc_232() { asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory"); }
extern "C" __device__ void setmaxnreg_inc_240() { asm volatile("setmaxnreg.inc.sync.aligned.u32 240;" ::: "memory"); }
