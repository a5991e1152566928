// ldmatrix (sm_75+): a warp loads 1, 2 or 4 8x8 matrices of 16-bit elements from shared memory.
// Lanes 8i..8i+7 give the row addresses of matrix i; register i of every lane receives
// elements (lane/4, 2*(lane%4) .. +1) of matrix i (transposed with .trans).
#define LDSM_X1(NAME, QUAL) \
extern "C" __device__ void NAME(unsigned* r, unsigned addr) { \
  asm volatile("ldmatrix.sync.aligned.m8n8.x1" QUAL ".shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(addr) : "memory"); }
#define LDSM_X2(NAME, QUAL) \
extern "C" __device__ void NAME(unsigned* r, unsigned addr) { \
  asm volatile("ldmatrix.sync.aligned.m8n8.x2" QUAL ".shared.b16 {%0, %1}, [%2];" \
               : "=r"(r[0]), "=r"(r[1]) : "r"(addr) : "memory"); }
#define LDSM_X4(NAME, QUAL) \
extern "C" __device__ void NAME(unsigned* r, unsigned addr) { \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4" QUAL ".shared.b16 {%0, %1, %2, %3}, [%4];" \
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory"); }

LDSM_X1(ldmatrix_x1, "")
LDSM_X2(ldmatrix_x2, "")
LDSM_X4(ldmatrix_x4, "")
LDSM_X1(ldmatrix_x1_trans, ".trans")
LDSM_X2(ldmatrix_x2_trans, ".trans")
LDSM_X4(ldmatrix_x4_trans, ".trans")
