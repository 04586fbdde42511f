// device: eager CUDA autograd beside a registered PrivateUse1 backend (pytorch issue 161129).
//
// Once a PrivateUse1 backend's name is registered, at::getAccelerator() returns PrivateUse1, and the
// autograd engine looks up a node's stream only among its inputs on that device type
// (Node::stream()). A node over CUDA tensors then has no stream, and the engine's stream
// bookkeeping asserts (engine.cpp: "opt_ready_stream && opt_parent_stream") on every CUDA backward.
// The engine reads the accelerator only through c10::is_privateuse1_backend_registered(), a flag
// with no public setter. While a backward whose graph holds CUDA nodes and no lazymem node runs,
// lazymem clears that flag (found in libc10's symbol table and verified by toggling it once), so
// the engine sees CUDA as the accelerator, exactly as without the import; it is set again when the
// last such backward returns.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace lazymem {

// What a backward from these roots runs through (the autograd graph, walked once).
enum class BackwardDevices { kNoCuda, kCudaOnly, kCudaAndLazy };
BackwardDevices backward_devices(const std::vector<at::Tensor>& roots);

// Whether lazymem can hide its registration from the engine (the flag was found and verified).
bool cuda_autograd_guard_available();

// While alive (and nested ones), the engine sees the accelerator it would see without lazymem.
// Raises a lazymem error when the guard is unavailable.
class CudaBackwardScope {
 public:
  CudaBackwardScope();
  ~CudaBackwardScope();
  CudaBackwardScope(const CudaBackwardScope&) = delete;
  CudaBackwardScope& operator=(const CudaBackwardScope&) = delete;
};

} // namespace lazymem
