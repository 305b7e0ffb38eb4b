// Shared-memory load wrappers: ldmatrix (warp-wide fragment loads, sm_75+), and one thread's
// 16-byte vector load (ld_shared_v4). Each ldmatrix 8x8 b16 matrix is 8 rows of 16 bytes; lane l
// supplies the row address of matrix l/8, row l%8, and receives in each register the 4 bytes (row
// l/4, bytes 4(l%4)..4(l%4)+3) of one matrix — exactly the mma.sync B-operand fragment of 8-bit
// (k32) and 4-bit (k64) types when rows are the n dimension.
#pragma once

#include <cstdint>

namespace sage::ptx {

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (sm_75+).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// ldmatrix.sync.aligned.m8n8.x2.shared.b16 (sm_75+): lanes 0-15 supply the addresses.
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(a));
}

// ld.volatile.shared.v4.b32: four registers from 16 bytes of shared memory in one instruction
// (volatile: ptxas merges plain loads of one address into one load and a move per register).
__device__ __forceinline__ void ld_shared_v4(uint32_t addr, int& a, int& b, int& c, int& d) {
  asm volatile("ld.volatile.shared.v4.b32 {%0,%1,%2,%3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
               : "r"(addr));
}

}  // namespace sage::ptx
