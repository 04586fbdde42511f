// dist: torch.distributed on lazymem tensors (issue 22). A c10d::Backend for the lazymem device
// whose collectives are recorded, not run: each is one node of the pending program (an op
// lazymem::c10d_*, effectful, so never eliminated, recomputed or put in a chunk loop), ordered after
// the backend's previous collective by a token every one of them writes, and run at materialization
// through the backing device's real backend (gloo for CPU, NCCL for CUDA) on the real tensors.
// torch_lazymem/distributed.py registers it with c10d (Backend.register_backend, devices=["lazymem"]).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace lazymem {

// A backend for a process group of `size` ranks whose lazymem collectives run through `inner`, a
// backend of the backing device made over the same store.
c10::intrusive_ptr<c10d::Backend> make_dist_backend(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size);

} // namespace lazymem
