// stmatrix (sm_90): a warp stores 1, 2 or 4 8x8 matrices of 16-bit elements to shared memory,
// the inverse of ldmatrix. Lanes 8i..8i+7 give the row addresses of matrix i; register i of
// every lane holds elements (lane/4, 2*(lane%4) .. +1) of matrix i (stored transposed with .trans).
#define STSM_X1(NAME, QUAL) \
extern "C" __device__ void NAME(unsigned addr, const unsigned* r) { \
  asm volatile("stmatrix.sync.aligned.m8n8.x1" QUAL ".shared.b16 [%0], {%1};" :: "r"(addr), "r"(r[0]) : "memory"); }
#define STSM_X2(NAME, QUAL) \
extern "C" __device__ void NAME(unsigned addr, const unsigned* r) { \
  asm volatile("stmatrix.sync.aligned.m8n8.x2" QUAL ".shared.b16 [%0], {%1, %2};" \
               :: "r"(addr), "r"(r[0]), "r"(r[1]) : "memory"); }
#define STSM_X4(NAME, QUAL) \
extern "C" __device__ void NAME(unsigned addr, const unsigned* r) { \
  asm volatile("stmatrix.sync.aligned.m8n8.x4" QUAL ".shared.b16 [%0], {%1, %2, %3, %4};" \
               :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory"); }

STSM_X1(stmatrix_x1, "")
STSM_X2(stmatrix_x2, "")
STSM_X4(stmatrix_x4, "")
STSM_X1(stmatrix_x1_trans, ".trans")
STSM_X2(stmatrix_x2_trans, ".trans")
STSM_X4(stmatrix_x4_trans, ".trans")
