// record: eager's C++ meta kernels where torch's Python meta kernels shadow them.
//
// `import torch` registers Python meta kernels (torch._meta_registrations: references from
// torch._refs and torch._decomp) on the Meta key of every op in its decomposition tables, over the
// C++ ones generated for structured ops (RegisterMeta*.cpp), which stay registered but inactive. A
// Python meta kernel costs about 200 us a call (and its first call imports torch._dynamo, 828 modules,
// about 2 s); the C++ one about 5 us, and it is exactly eager's: the structured op's meta function,
// with eager's checks and messages. Meta inference runs it for every op the meta cache has not seen
// (a first step, a new shape: a sequence that grows).
#pragma once

#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace lazymem {

// The C++ Meta kernel registered for `op` by ATen's generated RegisterMeta*.cpp when another (a
// Python one) is active over it; nullptr when none is shadowed (the Meta key already runs C++, or
// the op has none). Looked up once per op. Off with LAZYMEM_CPP_META=0.
const c10::KernelFunction* shadowed_cpp_meta_kernel(const c10::OperatorHandle& op);

} // namespace lazymem
