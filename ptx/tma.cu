// Tensor memory access (sm_90): cp.async.bulk.tensor tile copies described by a tensor map.
// `tmap` points at a 128-byte CUtensorMap in global memory (64-byte aligned, written by the
// host before the launch); `dst`/`src`/`bar` are 32-bit shared-window byte addresses (dst/src
// 128-byte aligned, 1024 for the 128B swizzle); coordinates are element indices, innermost
// dimension first, and may lie partly outside the tensor (out-of-bounds elements read as 0).

// Bring a tensor map into the cache ahead of its first use.
extern "C" __device__ void prefetch_tensormap(const unsigned long long* tmap) {
  asm volatile("prefetch.tensormap [%0];" :: "l"(tmap) : "memory");
}

// Global -> shared tile loads; completion adds the box's bytes to the mbarrier's tx count.
extern "C" __device__ void tma_load_2d(unsigned dst, const unsigned long long* tmap, unsigned bar, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
               :: "r"(dst), "l"(tmap), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
extern "C" __device__ void tma_load_3d(unsigned dst, const unsigned long long* tmap, unsigned bar, int c0, int c1,
                                       int c2) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
               :: "r"(dst), "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
extern "C" __device__ void tma_load_4d(unsigned dst, const unsigned long long* tmap, unsigned bar, int c0, int c1,
                                       int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
               :: "r"(dst), "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

// Shared -> global tile stores, tracked by bulk async-groups (commit, then wait).
extern "C" __device__ void tma_store_2d(const unsigned long long* tmap, unsigned src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
               :: "l"(tmap), "r"(src), "r"(c0), "r"(c1) : "memory");
}
extern "C" __device__ void tma_store_3d(const unsigned long long* tmap, unsigned src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
               :: "l"(tmap), "r"(src), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
extern "C" __device__ void tma_store_4d(const unsigned long long* tmap, unsigned src, int c0, int c1, int c2,
                                        int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
               :: "l"(tmap), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// Add `bytes` (a multiple of 16) of float32 at shared address `src` into global `dst`, element by
// element (a bulk reduce by the copy engine; both 16-byte aligned), in the thread's open bulk group.
extern "C" __device__ void bulk_reduce_add_f32(long long dst, unsigned src, unsigned bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
extern "C" __device__ void cp_async_bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until at most 0 committed bulk groups are pending (writes to global done).
extern "C" __device__ void cp_async_bulk_wait_group_0() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Wait until the shared-memory sources of all committed bulk groups have been read.
extern "C" __device__ void cp_async_bulk_wait_group_read_0() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
