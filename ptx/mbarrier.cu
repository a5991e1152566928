// mbarrier (sm_80+; expect_tx and try_wait sm_90): 64-bit barrier objects in shared memory.
// `bar` is the barrier's 32-bit shared-window byte address (8-byte aligned).
// A phase completes when its pending arrival count reaches zero and its expected
// transaction bytes (expect_tx, completed by TMA with complete_tx::bytes) are all in.

// Initialise with the number of arrivals that complete each phase (phase 0, parity 0).
extern "C" __device__ void mbarrier_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
// Make barrier initialisation visible to the async proxy and the cluster (before TMA uses it).
extern "C" __device__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival (release semantics at CTA scope); the state token is discarded.
extern "C" __device__ void mbarrier_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// One arrival that also raises the expected transaction count of the current phase by tx bytes.
extern "C" __device__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned tx) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(tx) : "memory");
}
// Raise the expected transaction count by tx bytes without arriving.
extern "C" __device__ void mbarrier_expect_tx(unsigned bar, unsigned tx) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(tx) : "memory");
}
// 1 when the phase with the given parity (0 or 1) has completed, else 0 after a
// system-dependent time limit (the thread may be suspended meanwhile). Acquire semantics.
extern "C" __device__ unsigned mbarrier_try_wait_parity(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done;
}
