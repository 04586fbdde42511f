// python: bindings only. The torch_lazymem._C module exposes the device-module primitives, memory
// accounting, configuration and introspection; everything else is registered with the dispatcher
// by the core library when it loads.
#include <Python.h>
#include <frameobject.h>

#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/extension.h>

#include <ATen/Context.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "core/check.h"
#include "core/config.h"
#include "core/cuda_backend.h"
#include "core/runtime.h"
#include "distributed/collectives.h"
#include "device/cuda_autograd.h"
#include "device/generator.h"
#include "device/phantom.h"
#include "execute/graphs.h"
#include "execute/memory.h"
#include "execute/transfer.h"
#include "plan/timing.h"
#include "ir/program.h"
#include "plan/reuse.h"
#include "plan/workspace.h"
#include "record/meta.h"
#include "record/recorder.h"
#include "sync/pipeline_trace.h"
#include "sync/sync.h"

namespace py = pybind11;
using namespace lazymem;

namespace {

bool is_internal(const std::string& file) {
  return file.find("/torch/") != std::string::npos || file.find("/torch_lazymem/") != std::string::npos ||
      file.find("<frozen") != std::string::npos;
}

// Innermost Python frame outside torch and torch_lazymem: "file:line in function".
std::string python_site() {
  if (!Py_IsInitialized()) return "";
  py::gil_scoped_acquire gil;
  PyFrameObject* frame = PyEval_GetFrame();
  Py_XINCREF(frame);
  std::string site;
  while (frame) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    std::string file = py::str(code->co_filename);
    if (!is_internal(file)) {
      site = file + ":" + std::to_string(PyFrame_GetLineNumber(frame)) + " in " +
          std::string(py::str(code->co_name));
      Py_DECREF(code);
      break;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return site.empty() ? "an internal frame (no user frame on the Python stack)" : site;
}

thread_local std::vector<std::unique_ptr<ModuleStateScope>> t_module_scopes;

bool backing_is_cpu() {
  return backing_device().is_cpu();
}

int64_t memory_allocated() {
  // Pending work whose results nobody can read frees what it pins now, not at the next sync.
  Program::get().collect_dead();
  return backing_is_cpu() ? device_counter().allocated() : resident_bytes();
}

void synchronize() {
  {
    py::gil_scoped_release no_gil;
    synchronize_program();
  }
  c10::Device d = backing_device();
  if (!d.is_cpu()) c10::impl::VirtualGuardImpl(d.type()).synchronizeDevice(d.index());
}

// Waits, without the GIL, until the pipeline's worker has run what it was handed.
void drain_pipeline() {
  py::gil_scoped_release nogil;
  pipeline_drain();
}

void set_backing_device(const std::string& name) {
  c10::Device d(name);
  LAZYMEM_CHECK_VALUE(d.is_cpu() || d.is_cuda(), "the backing device must be 'cpu' or 'cuda[:N]', got '", name, "'");
  if (d.is_cuda()) {
    LAZYMEM_CHECK(at::globalContext().hasCUDA(), "set_backing_device('", name,
                  "'): CUDA is not available in this PyTorch build or on this machine");
    if (!d.has_index()) d = c10::Device(c10::kCUDA, 0);
  } else {
    d = c10::Device(c10::kCPU);
  }
  c10::Device cur = backing_device();
  if (d != cur) {
    int64_t n = buffers_with_real_data();
    LAZYMEM_CHECK(n == 0, "cannot change the backing device from ", cur, " to ", d, " while ", n,
                  " lazymem buffers hold data on ", cur,
                  "; choose the backing device before creating lazymem tensors, or drop them (move what you "
                  "need to the CPU with .cpu()) and try again");
    drop_cuda_graphs(); // their addresses are on the old device
  }
  set_backing_device_unchecked(d);
}

std::string backing_device_name() {
  c10::Device d = backing_device();
  return d.is_cpu() ? std::string("cpu") : d.str();
}

void mark_batch(const at::Tensor& t, std::optional<int64_t> dim) {
  LAZYMEM_CHECK_VALUE(t.layout() == c10::kStrided, "mark_batch expects a strided lazymem tensor, got layout ",
                      t.layout());
  LazyBuffer* b = buffer_of(t);
  LAZYMEM_CHECK_VALUE(b != nullptr, "mark_batch expects a lazymem tensor, got a tensor on ", t.device(),
                      "; move it with .to('lazymem') first");
  if (!dim) {
    Program::get().set_batch_hint(*b, LazyBuffer::BatchHint::kNever);
    return;
  }
  int64_t d = *dim < 0 ? *dim + t.dim() : *dim;
  LAZYMEM_CHECK_VALUE(d >= 0 && d < t.dim(), "mark_batch: dim ", *dim, " is out of range for a tensor of ", t.dim(),
                      " dims");
  LAZYMEM_CHECK_VALUE(t.size(d) >= 2, "mark_batch: dim ", d, " has size ", t.size(d),
                      "; a batch needs at least 2 rows");
  // The mark is the storage's: the tensor must cover it exactly, laid out [outer][batch][row].
  const int64_t stride_bytes = t.stride(d) * static_cast<int64_t>(t.element_size());
  const int64_t block = t.size(d) * stride_bytes;
  const bool covers = TensorMeta::of(*t.unsafeGetTensorImpl()).covers(b->nbytes.load());
  LAZYMEM_CHECK_VALUE(covers && stride_bytes > 0 && block > 0 && static_cast<int64_t>(b->nbytes.load()) % block == 0,
                      "mark_batch: dim ", d, " of this view does not cover its storage's rows (sizes ", t.sizes(),
                      ", strides ", t.strides(), "); mark the tensor the view was taken from");
  Program::get().set_batch_hint(*b, LazyBuffer::BatchHint::kMarked, t.size(d), stride_bytes);
}

py::dict buffer_info(const at::Tensor& t) {
  LazyBuffer* b = buffer_of(t);
  LAZYMEM_CHECK(b != nullptr, "buffer_info expects a lazymem tensor, got a tensor on ", t.device());
  py::dict d;
  d["id"] = b->id;
  d["nbytes"] = b->nbytes.load();
  d["version"] = b->version;
  d["real_version"] = b->real_version;
  d["has_real"] = b->has_real();
  d["poisoned"] = static_cast<bool>(b->poison);
  d["pending_writer"] = Program::get().pending_writer(*b);
  return d;
}

template <typename F>
auto wrap(F&& f) {
  return torch::wrap_pybind_function(std::forward<F>(f));
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_lazymem native bindings";
  flush_hooks().recording_site = python_site;

  m.def("_device_count", [] { return 1; });
  m.def("_synchronize", wrap(synchronize));
  m.def("_default_generator", [](int64_t index) {
    return py::reinterpret_steal<py::object>(
        THPGenerator_initDefaultGenerator(default_lazy_generator(static_cast<c10::DeviceIndex>(index))));
  });

  m.def("_memory_allocated", memory_allocated);
  // What the planner counts as held before a program runs: values, and on a CUDA-like device the
  // workspaces lazymem's kernels left (cuBLAS's, one per thread and stream).
  m.def("_device_bytes_held", [] {
    return backing_is_cpu() ? device_counter().allocated() - cuda_graph_unheld_bytes() : lazymem_device_bytes();
  });
  m.def("_max_memory_allocated", [] { return backing_is_cpu() ? device_counter().peak() : resident_bytes(); });
  m.def("_reset_peak_memory_stats", [] { device_counter().reset_peak(); });
  m.def("_device_capacity", [] { return device_counter().capacity(); });
  m.def("_set_device_capacity", [](int64_t bytes) {
    drain_pipeline(); // a pipelined batch planned under the old capacity ends first
    if (bytes >= 0) {
      LAZYMEM_CHECK(install_counting_cpu_allocator(), "the simulated device needs lazymem's counting CPU allocator, ",
                    "but another CPU allocator with a higher priority is installed");
    }
    device_counter().set_capacity(bytes);
    trim_device_pool();
  });
  m.def("_device_pool_bytes", [] { return backing_is_cpu() ? device_pool_bytes() : int64_t{0}; });
  m.def("_empty_device_pool", [] { return empty_device_pool(); });
  m.def("_device_pool_enabled", [] { return backing_is_cpu() && device_pool_enabled(); });
  m.def("_counting_active", counting_cpu_allocator_active);
  m.def("_link_bandwidth", link_bandwidth);
  m.def("_clear_node_times", clear_node_times);
  m.def("_predicted_copy_seconds", predicted_copy_seconds); // (what the planner prices a copy of n bytes at)
  m.def("_set_link_bandwidth", set_link_bandwidth);
  m.def("_host_memory_allocated", [] { return host_counter().allocated(); });
  m.def("_max_host_memory_allocated", [] { return host_counter().peak(); });
  m.def("_eager_cap_push", [](int64_t bytes) {
    LAZYMEM_CHECK(install_counting_cpu_allocator(), "memory_cap needs lazymem's counting CPU allocator, but ",
                  "another CPU allocator with a higher priority is installed");
    eager_counter().set_capacity(bytes);
    eager_counter().reset_peak();
    push_counting_scope(&eager_counter());
  });
  m.def("_eager_cap_pop", [] {
    pop_counting_scope();
    eager_counter().set_capacity(-1);
  });
  m.def("_eager_allocated", [] { return eager_counter().allocated(); });
  m.def("_eager_peak", [] { return eager_counter().peak(); });
  m.def("_parse_bytes", wrap([](const std::string& s) { return parse_bytes(s); }));
  m.def("_parse_flag", [](const std::string& s) { return parse_flag(s); });
  m.def("_env_flag", [](const std::string& name) { return env_flag(name.c_str()); });
  m.def("_format_bytes", [](int64_t n) { return format_bytes(n); });

  m.def("_dist_backend", wrap([](c10::intrusive_ptr<c10d::Backend> inner, int rank, int size) {
    return make_dist_backend(std::move(inner), rank, size);
  }));
  m.def("_set_backing_device", wrap(set_backing_device));
  m.def("_backing_device", backing_device_name);

  m.def("_stats", [] { return stats().snapshot(); });
  m.def("_reset_stats", [] { stats().reset(); });
  m.def("_set_debug", [](int level) { config().debug = level; });
  m.def("_debug", [] { return config().debug.load(); });
  m.def("_set_flush_threshold", [](uint64_t nodes, uint64_t bytes) {
    config().flush_threshold_nodes = nodes;
    config().flush_threshold_bytes = bytes;
  });
  m.def("_set_pipeline", [](int on) { config().pipeline = on > 0 ? 1 : on < 0 ? -1 : 0; });
  m.def("_pipeline", [] {
    const int on = config().pipeline.load();
    return on > 0 || (on < 0 && !backing_device().is_cpu());
  });
  m.def("_pipeline_drain", drain_pipeline);
  m.def("_pipeline_hold", pipeline_hold);
  // The pipeline's timeline (sync/pipeline_trace.h): on/off (clears it), and the events since the
  // last call as (event, steady-clock ns = time.monotonic_ns(), nodes).
  m.def("_set_pipeline_trace", set_pipeline_trace);
  m.def("_pipeline_trace", [] {
    std::vector<std::tuple<std::string, int64_t, uint64_t>> out;
    for (const PipeTraceEntry& e : take_pipeline_trace()) out.emplace_back(pipe_event_name(e.event), e.t_ns, e.nodes);
    return out;
  });
  m.def("_set_cuda_graphs", [](bool on) {
    config().cuda_graphs = on;
    if (!on) {
      py::gil_scoped_release nogil;
      drop_cuda_graphs();
    }
  });
  m.def("_cuda_graphs", [] {
    if (backing_device().is_cuda()) init_backing_device(); // (loads the CUDA backend)
    return config().cuda_graphs.load() && (backing_device().is_cuda() ? cuda_backend() != nullptr : graph_emulation());
  });
  m.def("_set_fusion", [](bool on) { config().fusion = on; });
  m.def("_fusion", [] { return config().fusion.load() && backing_device().is_cpu(); });
  m.def("_set_graph_emulation", [](bool on) {
    py::gil_scoped_release nogil;
    set_graph_emulation(on);
  });
  m.def("_set_pipeline_batch", [](uint64_t n) { config().pipeline_batch = n; }); // 0: the default
  m.def("_set_chunk_node_ns", [](int64_t ns) { config().chunk_node_ns = ns; });    // -1: the device's
  m.def("_set_async_copy_out", [](int on) { config().async_copy_out = on < 0 ? -1 : on > 0; }); // -1: the device's
  flush_hooks().without_gil = [](const std::function<void()>& wait) {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      wait();
    } else {
      wait();
    }
  };
  m.def("_flush_threshold", [] {
    return std::make_pair(config().flush_threshold_nodes.load(), config().flush_threshold_bytes.load());
  });

  m.def("_set_memory_budget", [](int64_t bytes) {
    drain_pipeline(); // a pipelined batch planned under the old budget ends first
    config().memory_budget = bytes;
  });
  m.def("_user_memory_budget", [] { return config().memory_budget.load(); });
  m.def("_memory_budget", [] { return memory_budget(); });
  m.def("_set_force_chunks", [](int64_t n) { config().force_chunks = n; });
  m.def("_set_plan_cache", [](bool on) {
    config().plan_cache = on;
    if (!on) clear_plan_cache();
  });
  m.def("_plan_cache", [] { return config().plan_cache.load(); });
  m.def("_set_recompute", [](int v) { config().recompute = v < 0 ? -1 : (v ? 1 : 0); });
  m.def("_recompute", [] { return config().recompute.load(); });
  m.def("_set_force_recompute", [](bool on) { config().force_recompute = on; });
  m.def("_force_recompute", [] { return config().force_recompute.load(); });
  m.def("_set_workspace_probes", [](bool on) { config().workspace_probes = on; });
  m.def("_workspace_probes", [] { return config().workspace_probes.load(); });
  m.def("_plan_cache_size", [] { return plan_cache_size(); });
  m.def("_force_chunks", [] { return config().force_chunks.load(); });
  m.def("_worker_allocations", worker_allocations);
  m.def("_workspace_entries", [] { return Workspace::get().size(); });
  m.def("_clear_workspace", [] { Workspace::get().clear(); });
  m.def("_set_progress_callback", [](py::object fn) {
    static py::object* callback = new py::object(); // never destroyed: called until exit
    *callback = fn;
    if (fn.is_none()) {
      flush_hooks().progress = nullptr;
      return;
    }
    flush_hooks().progress = [](int64_t done, int64_t total, bool finished) {
      if (!Py_IsInitialized()) return;
      py::gil_scoped_acquire gil;
      try {
        (*callback)(done, total, finished);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("torch_lazymem progress callback");
      }
    };
  });
  // Eager CUDA autograd beside the registered lazymem device (device/cuda_autograd.h).
  m.def("_backward_devices", [](const std::vector<at::Tensor>& roots) {
    switch (backward_devices(roots)) {
      case BackwardDevices::kCudaOnly:
        return "cuda";
      case BackwardDevices::kCudaAndLazy:
        return "cuda+lazymem";
      default:
        return "other";
    }
  });
  m.def("_cuda_autograd_guard_available", cuda_autograd_guard_available);
  m.def("_run_hiding_registration", wrap([](const py::function& fn) {
    CudaBackwardScope scope;
    return fn();
  }));
  m.def("_set_device_memory_fraction", wrap(set_device_memory_fraction));
  m.def("_set_backing_initialized_callback", [](py::object fn) {
    static py::object* callback = new py::object(); // never destroyed: called until exit
    *callback = fn;
    flush_hooks().backing_initialized = [](c10::Device d) {
      if (!Py_IsInitialized()) return;
      py::gil_scoped_acquire gil;
      try {
        (*callback)(py::cast(d));
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("torch_lazymem: reading the CUDA memory fraction");
      }
    };
  });
  m.def("_set_allocator_fraction_callback", [](py::object fn) {
    static py::object* callback = new py::object(); // never destroyed: called until exit
    *callback = fn;
    flush_hooks().set_allocator_fraction = [](c10::Device d, double fraction) {
      if (!Py_IsInitialized()) return;
      py::gil_scoped_acquire gil;
      try {
        (*callback)(py::cast(d), fraction);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("torch_lazymem: setting the CUDA allocator's memory fraction");
      }
    };
  });
  m.def("_set_progress_after_seconds", [](double s) { config().progress_after_seconds = s; });
  m.def("_progress_after_seconds", [] { return config().progress_after_seconds.load(); });
  m.def("_fail_allocation", [](int64_t n) {
    TORCH_CHECK(n >= 0, "lazymem: fail_allocation expects n >= 1 (or 0 to disarm), got ", n);
    device_counter().arm_failure(n);
  });
  m.def("_injected_failures", [] { return device_counter().injected(); });

  m.def("_explain", [] { return flush_hooks().explain ? flush_hooks().explain() : std::string(); });

  m.def("_pending_nodes", [] { return Program::get().pending_count(); });
  m.def("_program_str", [](size_t max_nodes) { return Program::get().to_string(max_nodes); }, py::arg("max_nodes") = 200);
  m.def("_verify", wrap([] { Program::get().verify(); }));
  m.def("_buffers_alive", buffers_alive);
  m.def("_buffers_with_real_data", buffers_with_real_data);
  m.def("_buffer_info", wrap(buffer_info));
  m.def("_mark_batch", wrap(mark_batch), py::arg("t"), py::arg("dim").none(true));
  m.def("_enter_module_state", [] { t_module_scopes.emplace_back(std::make_unique<ModuleStateScope>()); });
  m.def("_exit_module_state", [] {
    if (!t_module_scopes.empty()) t_module_scopes.pop_back();
  });
  m.def("_meta_cache_size", meta_cache_size);
  m.def("_clear_meta_cache", clear_meta_cache);
}
