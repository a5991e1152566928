// Named CTA barriers (sm_70+): barrier `id` (0..15; 0 is __syncthreads) completes when `count`
// threads (a multiple of 32) have arrived. Lets a subset of warps synchronise, and lets one
// warpgroup signal another without waiting (bar.arrive), as in producer/consumer hand-offs.

// Arrive and wait until `count` threads have arrived at barrier `id`.
extern "C" __device__ void named_barrier_sync(unsigned id, unsigned count) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
// Arrive at barrier `id` (expecting `count` threads in all) without waiting.
extern "C" __device__ void named_barrier_arrive(unsigned id, unsigned count) {
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}
