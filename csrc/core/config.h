// core: the process-wide knobs (one place) and the counters behind torch_lazymem.stats().
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <c10/core/Device.h>

namespace lazymem {

// Counters. Relaxed atomics: they are statistics, not synchronization.
struct Stats {
  std::atomic<uint64_t> ops_recorded{0};     // nodes appended to the program
  std::atomic<uint64_t> ops_eager{0};        // ops run eagerly (data-dependent / no meta kernel)
  std::atomic<uint64_t> views{0};            // view ops served as metadata only
  std::atomic<uint64_t> meta_cache_hits{0};
  std::atomic<uint64_t> meta_cache_misses{0};
  std::atomic<uint64_t> materializations{0}; // flushes that ran at least one node
  std::atomic<uint64_t> nodes_executed{0};
  std::atomic<uint64_t> nodes_eliminated{0};
  std::atomic<uint64_t> nodes_collected{0}; // pending nodes dropped because nobody could read them
  std::atomic<int64_t> peak_bytes{0};        // peak device bytes during the last materialization (pipelined: the step's, batches and read)
  std::atomic<uint64_t> auto_flushes{0};
  std::atomic<uint64_t> pipeline_handed{0};   // batches handed to the pipeline's worker
  std::atomic<uint64_t> pipeline_handed_late{0}; // of them, handed after their last op (the worker was busy)
  std::atomic<uint64_t> pipelined_flushes{0}; // batches the pipeline's worker ran while recording went on
  std::atomic<uint64_t> pipeline_given_back{0}; // batches it left to the recording thread (split, new and near the budget)
  std::atomic<uint64_t> pipeline_worker_ns{0};  // the worker's time planning and running batches
  std::atomic<uint64_t> outputs_copied{0};   // kernel results copied into their buffer (layout differed)
  std::atomic<int64_t> predicted_peak_bytes{0}; // the memory model's peak for the last materialization
  std::atomic<uint64_t> splits{0};           // materializations that split along the batch
  std::atomic<int64_t> chunks{0};            // chunks of the last split's largest loop
  std::atomic<int64_t> passes{0};            // loops (passes over the batch) of the last split
  std::atomic<uint64_t> barriers{0};         // nodes with batch-sharded inputs that ran whole (no rule)
  std::atomic<uint64_t> batch_conflicts{0};  // splits whose sources at their hints conflicted (solved for)
  std::atomic<uint64_t> nodes_kept_pending{0}; // nodes a split left pending (recomputed when needed)
  std::atomic<uint64_t> random_row_keyed{0}; // random node runs whose draws are keyed by batch rows
  std::atomic<uint64_t> random_streams{0};   // random nodes' draws generated whole for chunks to read (eager's)
  std::atomic<uint64_t> random_stream_bytes{0}; // host bytes of those streams
  std::atomic<uint64_t> oom_retries{0};      // plans made again after an out-of-memory error taught the model
  std::atomic<uint64_t> row_loops{0};        // loops over a tensor's own rows run (plan/rows.h)
  std::atomic<uint64_t> allocator_caps{0};   // runs the CUDA caching allocator held to the budget (execute/memory.h)
  std::atomic<uint64_t> plan_ns{0};          // time spent planning (make_plan), summed
  std::atomic<uint64_t> nodes_planned{0};    // nodes given to the planner, summed
  std::atomic<uint64_t> plans_reused{0};     // materializations whose plan came from the plan cache
  std::atomic<uint64_t> fingerprints_from_tape{0}; // plan fingerprints read from the Program's tape (ir/tape.h)
  std::atomic<uint64_t> values_recomputed{0};  // values crossing passes recomputed per pass, not stored
  std::atomic<uint64_t> values_in_host_memory{0}; // batch-sharded values a split assembled in host memory
  std::atomic<uint64_t> collectives{0};      // torch.distributed collectives run (dist/collectives.cpp)
  std::atomic<uint64_t> collective_bytes{0}; // bytes they sent from this rank (their inputs' sizes)
  // Copies across the host/device boundary (execute/transfer.h): bytes, copies and time each way.
  std::atomic<uint64_t> h2d_bytes{0};
  std::atomic<uint64_t> h2d_copies{0};
  std::atomic<uint64_t> h2d_ns{0};
  std::atomic<uint64_t> d2h_bytes{0};
  std::atomic<uint64_t> d2h_copies{0};
  std::atomic<uint64_t> d2h_ns{0};
  std::atomic<uint64_t> device_pool_misses{0}; // simulated device blocks of 64 KiB or more its pool did not have
  std::atomic<uint64_t> h2d_ahead{0};     // copies started ahead of their reader (the next chunk's rows)
  std::atomic<uint64_t> copy_wait_ns{0};  // time the executor waited for such copies to end
  std::atomic<uint64_t> d2h_behind{0};    // copies out the executor did not wait for (execute/transfer.h copy_out)
  std::atomic<uint64_t> copy_out_wait_ns{0}; // time spent waiting for them to end (await_copies_out)
  std::atomic<uint64_t> kept_reads{0};    // reads of rows a chunk wrote to host memory, from the device (plan.h KeptRows)
  // Pointwise chains run as one loop on the CPU backing (execute/fuse.h).
  std::atomic<uint64_t> fused_chains{0};
  std::atomic<uint64_t> fused_nodes{0};           // nodes they ran
  std::atomic<uint64_t> fusion_fallbacks{0};      // chains run plainly (an operand off the device, out of memory)
  // CUDA graphs of reused plans (execute/graphs.h).
  std::atomic<uint64_t> cuda_graph_captures{0};   // pieces of plans captured as graphs
  std::atomic<uint64_t> cuda_graph_replays{0};    // graph launches (a piece's nodes in one launch)
  std::atomic<uint64_t> cuda_graph_nodes{0};      // nodes those launches ran
  std::atomic<uint64_t> cuda_graph_plain_nodes{0}; // nodes of graphed plans run plainly (not capturable, changed)
  std::atomic<uint64_t> cuda_graph_fallbacks{0};  // captures that failed and graphs dropped (inputs or arguments changed)
  std::atomic<int64_t> cuda_graph_pool_bytes{0};  // device bytes the graphs' pools hold now
  std::map<std::string, int64_t> snapshot() const;
  void reset();
};
Stats& stats();

struct Config {
  // LAZYMEM_DEBUG=1: print each materialization's summary and capture where each op was recorded;
  // LAZYMEM_DEBUG=2 also prints each plan node by node.
  std::atomic<int> debug{0};
  // Auto-flush when this many nodes are pending (0 = never). LAZYMEM_FLUSH_NODES. The default bounds
  // a loop that never reads a value while leaving a whole training step (thousands of nodes even for
  // large models) in one window for the planner.
  std::atomic<uint64_t> flush_threshold_nodes{50000};
  // Auto-flush when the pending program would allocate this many new bytes (0 = never).
  std::atomic<uint64_t> flush_threshold_bytes{0};
  // Pipelined execution (sync/sync.cpp Pipeline): 1 on, 0 off, -1 (the default) on where the backing
  // device is an accelerator (its kernels run asynchronously: the worker only launches them) and off
  // on the CPU backing (measured no faster on 2 cores: see the README's speed section).
  // LAZYMEM_PIPELINE=0/1, torch_lazymem.set_pipeline().
  std::atomic<int> pipeline{-1};
  // Nodes per pipelined batch (LAZYMEM_PIPELINE_BATCH; small values stress the worker in tests);
  // 0: Pipeline::kBatchAccelerator (64) on an accelerator, Pipeline::kBatchCpu (1,024) on the CPU.
  std::atomic<uint64_t> pipeline_batch{0};
  // A reused plan's nodes replay as CUDA graphs where they can (execute/graphs.h); on a CUDA backing
  // device with a CUDA build of torch. LAZYMEM_CUDA_GRAPHS=0/1, torch_lazymem.set_cuda_graphs().
  std::atomic<bool> cuda_graphs{true};
  // Chains of pointwise arithmetic on small tensors run as one loop on the CPU backing
  // (execute/fuse.h). LAZYMEM_FUSION=0/1, torch_lazymem.set_fusion().
  std::atomic<bool> fusion{true};
  // What the planner takes a node to cost per chunk beyond its work, in ns (PlanInput::chunk_node_ns;
  // LAZYMEM_CHUNK_NODE_NS; -1 or 0: nothing, the default until it is right on a GPU, see sync.cpp).
  // Set on the CPU backing, tests exercise the GPU's trade of chunks against host memory.
  std::atomic<int64_t> chunk_node_ns{-1};
  // Meta-inference cache entries kept before the cache is cleared (LAZYMEM_META_CACHE_SIZE).
  std::atomic<uint64_t> meta_cache_capacity{1u << 16};
  // Bytes lazymem may hold on the backing device (-1: its free memory, or the simulated capacity).
  // LAZYMEM_MEMORY_BUDGET, torch_lazymem.set_memory_budget().
  std::atomic<int64_t> memory_budget{-1};
  // > 0: split every materialization into this many chunks, memory permitting or not (testing).
  std::atomic<int64_t> force_chunks{0};
  // A materialization expected to take longer than this shows progress (FlushHooks::progress).
  std::atomic<double> progress_after_seconds{2.0};
  // Reuse plans across materializations of programs with the same structure (LAZYMEM_PLAN_CACHE=0
  // disables; plan/reuse.h).
  std::atomic<bool> plan_cache{true};
  // A batch-sharded value that crosses passes of a split and does not fit the device budget is
  // recomputed chunk by chunk where it is read, when its computation can run again (1), else it
  // is held in host memory; 0: always host memory; -1 (the default): whichever costs less, by the
  // recomputing nodes' measured time and the copies' modeled time. LAZYMEM_RECOMPUTE=0/1/auto,
  // torch_lazymem.set_recompute().
  std::atomic<int> recompute{-1};
  // Recompute every value crossing passes that can be, fitting or not (testing).
  std::atomic<bool> force_recompute{false};
  // Kernels that allocate inside are measured on a row or two before a plan that runs them new
  // (execute/ws_probe.h); off, their workspace is learned only from their runs (testing).
  std::atomic<bool> workspace_probes{true};
  // Check at every plan that the Program's tape (ir/tape.h), kept as nodes are appended, equals one
  // built from the nodes (LAZYMEM_CHECK_TAPE=1; the test suite sets it).
  std::atomic<bool> check_tape{false};
  // Check that every kernel operand is in device memory on the simulated device (LAZYMEM_CHECK_BOUNDARY=1;
  // the test suite and the fuzzer set it; always on while a simulated capacity is set).
  std::atomic<bool> check_boundary{false};
  // The simulated device's modeled link between host and device memory, bytes per second each way
  // (0: not modeled). torch_lazymem.testing.simulated_device(link=...) (execute/transfer.h).
  std::atomic<double> link_bandwidth{0.0};
  // Copies of results into host memory overlap the kernels after them (execute/transfer.h copy_out):
  // 1 on, 0 off, -1 (the default) on the simulated device and off on an accelerator until a GPU run
  // has checked it. LAZYMEM_ASYNC_COPY_OUT=0/1.
  std::atomic<int> async_copy_out{-1};
};
Config& config();

// Every on/off setting in the environment reads the same: 1, true, on or yes turn it on; 0, false, off
// or no turn it off (any case, surrounding spaces ignored). parse_flag: nullopt for anything else.
// env_flag: nullopt when the variable is unset or empty, and, with a warning naming the variable and
// its value, when it is none of those.
std::optional<bool> parse_flag(const std::string& value);
std::optional<bool> env_flag(const char* name);
// A count from the environment (LAZYMEM_FLUSH_NODES): nullopt when unset or empty, and, with a
// warning, when it is not a non-negative integer.
std::optional<uint64_t> env_count(const char* name);

// Parses "256MiB", "1.5GB", "4096" into bytes; throws a lazymem: ValueError on bad input.
int64_t parse_bytes(const std::string& text);
std::string format_bytes(int64_t n);
// "3.2 ms", "1.50 s", "840 us".
std::string format_seconds(double s);

} // namespace lazymem
