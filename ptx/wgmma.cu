// Warpgroup MMA (sm_90a): wgmma.fence / commit_group / wait_group and wgmma.mma_async
// m64nNk16 with f32 accumulators and f16 or bf16 inputs, and m64nNk32 with e4m3 inputs. One asm
// statement per function; the macros below only spell out the long operand lists.
//
// A warpgroup (4 consecutive warps, the first warp index a multiple of 4) issues each
// instruction together. d points at this thread's N/2 f32 accumulators (a local array that
// stays in registers); they are updated in place: d = A*B + (scale_d != 0 ? d : 0).
// B (and A in the _ss forms) is read from shared memory through a 64-bit matrix descriptor;
// in the _rs forms A is 4 registers of packed 16-bit pairs (the m16n8k16 A-fragment layout,
// one 16-row slice per warp). Suffix _tb: B is MN-major (transposed, imm-trans-b = 1);
// suffix _ta_tb (the _ss forms): A and B both MN-major (imm-trans-a = imm-trans-b = 1);
// without them both operands are K-major. The e4m3 forms (k32: 32 elements, 32 bytes, a k-step)
// take no transpose: 8-bit operands are K-major only; their A fragment (_rs) is 4 registers of
// four e4m3 each, the mma.sync m16n8k32 A-fragment layout.

extern "C" __device__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
extern "C" __device__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
extern "C" __device__ void wgmma_wait_group_0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
extern "C" __device__ void wgmma_wait_group_1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
extern "C" __device__ void wgmma_wait_group_2() { asm volatile("wgmma.wait_group.sync.aligned 2;" ::: "memory"); }
extern "C" __device__ void wgmma_wait_group_3() { asm volatile("wgmma.wait_group.sync.aligned 3;" ::: "memory"); }

// Operand numbers %0..%127 of the accumulators, eight at a time.
#define R8_0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define R8_1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define R8_2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define R8_3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define R8_4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define R8_5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define R8_6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define R8_7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define R8_8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define R8_9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define R8_10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define R8_11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define R8_12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define R8_13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define R8_14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define R8_15 "%120, %121, %122, %123, %124, %125, %126, %127"

// "{%0, ..., %(n-1)}" for n accumulators.
#define REGS_4 "{%0, %1, %2, %3}"
#define REGS_8 "{" R8_0 "}"
#define REGS_16 "{" R8_0 ", " R8_1 "}"
#define REGS_24 "{" R8_0 ", " R8_1 ", " R8_2 "}"
#define REGS_32 "{" R8_0 ", " R8_1 ", " R8_2 ", " R8_3 "}"
#define REGS_40 "{" R8_0 ", " R8_1 ", " R8_2 ", " R8_3 ", " R8_4 "}"
#define REGS_48 "{" R8_0 ", " R8_1 ", " R8_2 ", " R8_3 ", " R8_4 ", " R8_5 "}"
#define REGS_64 "{" R8_0 ", " R8_1 ", " R8_2 ", " R8_3 ", " R8_4 ", " R8_5 ", " R8_6 ", " R8_7 "}"
#define REGS_88 "{" R8_0 ", " R8_1 ", " R8_2 ", " R8_3 ", " R8_4 ", " R8_5 ", " R8_6 ", " R8_7 ", " \
  R8_8 ", " R8_9 ", " R8_10 "}"
#define REGS_96 "{" R8_0 ", " R8_1 ", " R8_2 ", " R8_3 ", " R8_4 ", " R8_5 ", " R8_6 ", " R8_7 ", " \
  R8_8 ", " R8_9 ", " R8_10 ", " R8_11 "}"
#define REGS_128 "{" R8_0 ", " R8_1 ", " R8_2 ", " R8_3 ", " R8_4 ", " R8_5 ", " R8_6 ", " R8_7 ", " \
  R8_8 ", " R8_9 ", " R8_10 ", " R8_11 ", " R8_12 ", " R8_13 ", " R8_14 ", " R8_15 "}"

// Read-write operand constraints d[i], d[i+1], ... for n accumulators.
#define ACC4(i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define ACC8(i) ACC4(i), ACC4((i) + 4)
#define ACC16(i) ACC8(i), ACC8((i) + 8)
#define ACC32(i) ACC16(i), ACC16((i) + 16)
#define ACC64(i) ACC32(i), ACC32((i) + 32)
#define ACC_4 ACC4(0)
#define ACC_8 ACC8(0)
#define ACC_16 ACC16(0)
#define ACC_24 ACC16(0), ACC8(16)
#define ACC_32 ACC32(0)
#define ACC_40 ACC32(0), ACC8(32)
#define ACC_48 ACC32(0), ACC16(32)
#define ACC_64 ACC64(0)
#define ACC_88 ACC64(0), ACC16(64), ACC8(80)
#define ACC_96 ACC64(0), ACC32(64)
#define ACC_128 ACC64(0), ACC64(64)

// A from shared memory: operands %NACC = desc_a, %NACC+1 = desc_b, %NACC+2 = scale_d.
#define WGMMA_SS(NAME, N, AB, TA, TB, NACC, IA, IB, IS)                                            \
  extern "C" __device__ void NAME(float* d, unsigned long long desc_a, unsigned long long desc_b,   \
                                  unsigned scale_d) {                                              \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %" IS ", 0; "                                     \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." AB "." AB " " REGS_##NACC        \
                 ", %" IA ", %" IB ", p, 1, 1, " #TA ", " #TB "; }"                               \
                 : ACC_##NACC : "l"(desc_a), "l"(desc_b), "r"(scale_d) : "memory");                 \
  }

// A from registers: %NACC..%NACC+3 = a[0..3], %NACC+4 = desc_b, %NACC+5 = scale_d.
#define WGMMA_RS(NAME, N, AB, TB, NACC, IA0, IA1, IA2, IA3, IB, IS)                                \
  extern "C" __device__ void NAME(float* d, const unsigned* a, unsigned long long desc_b,          \
                                  unsigned scale_d) {                                              \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %" IS ", 0; "                                     \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." AB "." AB " " REGS_##NACC        \
                 ", {%" IA0 ", %" IA1 ", %" IA2 ", %" IA3 "}, %" IB ", p, 1, 1, " #TB "; }"         \
                 : ACC_##NACC                                                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)            \
                 : "memory");                                                                      \
  }

// The e4m3 forms: m64nNk32, both operands K-major (no imm-trans arguments for 8-bit types).
#define WGMMA_SS_E4M3(NAME, N, NACC, IA, IB, IS)                                                   \
  extern "C" __device__ void NAME(float* d, unsigned long long desc_a, unsigned long long desc_b,   \
                                  unsigned scale_d) {                                              \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %" IS ", 0; "                                     \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS_##NACC            \
                 ", %" IA ", %" IB ", p, 1, 1; }"                                                 \
                 : ACC_##NACC : "l"(desc_a), "l"(desc_b), "r"(scale_d) : "memory");                 \
  }
#define WGMMA_RS_E4M3(NAME, N, NACC, IA0, IA1, IA2, IA3, IB, IS)                                   \
  extern "C" __device__ void NAME(float* d, const unsigned* a, unsigned long long desc_b,          \
                                  unsigned scale_d) {                                              \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %" IS ", 0; "                                     \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS_##NACC            \
                 ", {%" IA0 ", %" IA1 ", %" IA2 ", %" IA3 "}, %" IB ", p, 1, 1; }"                  \
                 : ACC_##NACC                                                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)            \
                 : "memory");                                                                      \
  }

// An empty asm that "reads and writes" every accumulator: keeps the compiler from moving
// accumulator reads or writes across wgmma fence/commit/wait (the hardware updates them
// asynchronously, between mma_async and wait_group).
#define WGMMA_FENCE_OPERAND(NACC)                                                                  \
  extern "C" __device__ void wgmma_fence_operand_##NACC(float* d) { asm volatile("" : ACC_##NACC :: "memory"); }

// Every variant of one N. I0..I5 are the operand numbers NACC..NACC+5 as strings.
// With WGMMA_SOME_N defined, only the N whose WGMMA_N<N> is defined are built: the compiler
// (runtime/compiler.py) defines those a kernel calls, as the other 100-odd functions cost
// NVRTC a quarter of a second.
#define WGMMA_N(N, NACC, I0, I1, I2, I3, I4, I5)                                                   \
  WGMMA_SS(wgmma_m64n##N##k16_f32_f16_ss, N, "f16", 0, 0, NACC, I0, I1, I2)                       \
  WGMMA_SS(wgmma_m64n##N##k16_f32_f16_ss_tb, N, "f16", 0, 1, NACC, I0, I1, I2)                    \
  WGMMA_SS(wgmma_m64n##N##k16_f32_f16_ss_ta_tb, N, "f16", 1, 1, NACC, I0, I1, I2)                 \
  WGMMA_SS(wgmma_m64n##N##k16_f32_bf16_ss, N, "bf16", 0, 0, NACC, I0, I1, I2)                     \
  WGMMA_SS(wgmma_m64n##N##k16_f32_bf16_ss_tb, N, "bf16", 0, 1, NACC, I0, I1, I2)                  \
  WGMMA_SS(wgmma_m64n##N##k16_f32_bf16_ss_ta_tb, N, "bf16", 1, 1, NACC, I0, I1, I2)               \
  WGMMA_RS(wgmma_m64n##N##k16_f32_f16_rs, N, "f16", 0, NACC, I0, I1, I2, I3, I4, I5)              \
  WGMMA_RS(wgmma_m64n##N##k16_f32_f16_rs_tb, N, "f16", 1, NACC, I0, I1, I2, I3, I4, I5)           \
  WGMMA_RS(wgmma_m64n##N##k16_f32_bf16_rs, N, "bf16", 0, NACC, I0, I1, I2, I3, I4, I5)            \
  WGMMA_RS(wgmma_m64n##N##k16_f32_bf16_rs_tb, N, "bf16", 1, NACC, I0, I1, I2, I3, I4, I5)         \
  WGMMA_SS_E4M3(wgmma_m64n##N##k32_f32_e4m3_ss, N, NACC, I0, I1, I2)                               \
  WGMMA_RS_E4M3(wgmma_m64n##N##k32_f32_e4m3_rs, N, NACC, I0, I1, I2, I3, I4, I5)                   \
  WGMMA_FENCE_OPERAND(NACC)

#if !defined(WGMMA_SOME_N) || defined(WGMMA_N8)
WGMMA_N(8, 4, "4", "5", "6", "7", "8", "9")
#endif
#if !defined(WGMMA_SOME_N) || defined(WGMMA_N16)
WGMMA_N(16, 8, "8", "9", "10", "11", "12", "13")
#endif
#if !defined(WGMMA_SOME_N) || defined(WGMMA_N32)
WGMMA_N(32, 16, "16", "17", "18", "19", "20", "21")
#endif
#if !defined(WGMMA_SOME_N) || defined(WGMMA_N48)
WGMMA_N(48, 24, "24", "25", "26", "27", "28", "29")
#endif
#if !defined(WGMMA_SOME_N) || defined(WGMMA_N64)
WGMMA_N(64, 32, "32", "33", "34", "35", "36", "37")
#endif
#if !defined(WGMMA_SOME_N) || defined(WGMMA_N80)
WGMMA_N(80, 40, "40", "41", "42", "43", "44", "45")
#endif
#if !defined(WGMMA_SOME_N) || defined(WGMMA_N96)
WGMMA_N(96, 48, "48", "49", "50", "51", "52", "53")
#endif
#if !defined(WGMMA_SOME_N) || defined(WGMMA_N128)
WGMMA_N(128, 64, "64", "65", "66", "67", "68", "69")
#endif
#if !defined(WGMMA_SOME_N) || defined(WGMMA_N176)
WGMMA_N(176, 88, "88", "89", "90", "91", "92", "93")
#endif
#if !defined(WGMMA_SOME_N) || defined(WGMMA_N192)
WGMMA_N(192, 96, "96", "97", "98", "99", "100", "101")
#endif
#if !defined(WGMMA_SOME_N) || defined(WGMMA_N256)
WGMMA_N(256, 128, "128", "129", "130", "131", "132", "133")
#endif
