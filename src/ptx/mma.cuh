// mma.sync wrappers (warp-wide tensor-core MMA). Each names its PTX and minimum architecture.
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k32"), lane l, g = l/4, t = l%4:
//   C/D f32 x4: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
//   A 8-bit x16 (4 regs): reg0 row g, reg1 row g+8, reg2 row g, reg3 row g+8; byte j of reg0/1
//     is k = 4t+j, of reg2/3 k = 16+4t+j
//   B 8-bit x8 (2 regs): column g; byte j of reg0 is k = 4t+j, of reg1 k = 16+4t+j
// For m16n8k64 with 4-bit operands the same registers hold 8 elements each (k = 8t.. in reg0,
// 32+8t.. in reg2 / reg1 of B), i.e. the same BYTE offsets: lower k in the lower nibble.
#pragma once

#include <cstdint>

namespace sage::ptx {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
// mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 (sm_89+): d = a·b + c.
__device__ __forceinline__ void mma_m16n8k32_e4m3(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// mma.sync.aligned.m16n8k64.row.col.s32.s4.s4.s32 (sm_80+; emulated, slow, on sm_90).
__device__ __forceinline__ void mma_m16n8k64_s4(int (&d)[4], const uint32_t (&a)[4],
                                                const uint32_t (&b)[2], const int (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k64.row.col.s32.s4.s4.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]),
        "r"(c[2]), "r"(c[3]));
}
#endif

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (sm_80+): d = a·b + c, exact int32.
__device__ __forceinline__ void mma_m16n8k32_s8(int (&d)[4], const uint32_t (&a)[4],
                                                const uint32_t (&b)[2], const int (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]),
        "r"(c[2]), "r"(c[3]));
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (sm_80+): d = a·b + c.
// A (4 regs, 2 elements each): reg0 (g, 2t..2t+1), reg1 (g+8, 2t..), reg2 (g, 8+2t..), reg3
// (g+8, 8+2t..); B (2 regs): reg0 (k 2t..2t+1, n g), reg1 (k 8+2t.., n g); C as above.
template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
  if constexpr (kBf16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
#endif

}  // namespace sage::ptx
