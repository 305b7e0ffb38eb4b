// What a PTX wrapper does in a device pass for an architecture without its instruction.
//
// The library compiles each .cu file for every architecture it builds (89, 90a, 120a by
// default), and the kernels of one architecture share headers with the others; a kernel for
// sm_90a guards its body with the architecture's macro, so the other passes compile it empty and
// call none of its wrappers. A wrapper whose instruction an architecture lacks is therefore
// declared in every pass, as a function template, and where a pass of such an architecture
// instantiates it (a kernel meant for it calls it) SAGE_PTX_REQUIRE stops the build, rather than
// the wrapper compiling to nothing and the kernel silently skipping the instruction.
#pragma once

namespace sage::ptx {

// false, but only once kInst is known: a static_assert on it fires where the template holding it
// is instantiated, not where it is defined.
template <int kInst>
inline constexpr bool kArchLacksInstruction = false;

}  // namespace sage::ptx

// In a wrapper template's body, in the branch of the passes whose architecture lacks `what`.
#define SAGE_PTX_REQUIRE(kInst, what)                                        \
  static_assert(::sage::ptx::kArchLacksInstruction<(kInst)>, what            \
                " is not available on the architecture of this device pass " \
                "(__CUDA_ARCH__): guard the calling kernel's body")
