// core: knobs, statistics and byte-size parsing.
#include "core/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <c10/util/Exception.h>

#include "core/check.h"

namespace lazymem {

Stats& stats() {
  static Stats* s = new Stats(); // leaked: outlives static destructors that may still record
  return *s;
}

std::map<std::string, int64_t> Stats::snapshot() const {
  auto ld = [](const auto& a) { return static_cast<int64_t>(a.load(std::memory_order_relaxed)); };
  return {
      {"ops_recorded", ld(ops_recorded)},
      {"ops_eager", ld(ops_eager)},
      {"views", ld(views)},
      {"meta_cache_hits", ld(meta_cache_hits)},
      {"meta_cache_misses", ld(meta_cache_misses)},
      {"materializations", ld(materializations)},
      {"nodes_executed", ld(nodes_executed)},
      {"nodes_eliminated", ld(nodes_eliminated)},
      {"nodes_collected", ld(nodes_collected)},
      {"peak_bytes", ld(peak_bytes)},
      {"auto_flushes", ld(auto_flushes)},
      {"pipeline_handed", ld(pipeline_handed)},
      {"pipeline_handed_late", ld(pipeline_handed_late)},
      {"pipelined_flushes", ld(pipelined_flushes)},
      {"pipeline_given_back", ld(pipeline_given_back)},
      {"pipeline_worker_ns", ld(pipeline_worker_ns)},
      {"outputs_copied", ld(outputs_copied)},
      {"predicted_peak_bytes", ld(predicted_peak_bytes)},
      {"splits", ld(splits)},
      {"chunks", ld(chunks)},
      {"passes", ld(passes)},
      {"barriers", ld(barriers)},
      {"batch_conflicts", ld(batch_conflicts)},
      {"nodes_kept_pending", ld(nodes_kept_pending)},
      {"random_row_keyed", ld(random_row_keyed)},
      {"random_streams", ld(random_streams)},
      {"random_stream_bytes", ld(random_stream_bytes)},
      {"oom_retries", ld(oom_retries)},
      {"allocator_caps", ld(allocator_caps)},
      {"row_loops", ld(row_loops)},
      {"plan_ns", ld(plan_ns)},
      {"nodes_planned", ld(nodes_planned)},
      {"plans_reused", ld(plans_reused)},
      {"fingerprints_from_tape", ld(fingerprints_from_tape)},
      {"values_recomputed", ld(values_recomputed)},
      {"values_in_host_memory", ld(values_in_host_memory)},
      {"collectives", ld(collectives)},
      {"collective_bytes", ld(collective_bytes)},
      {"h2d_bytes", ld(h2d_bytes)},
      {"h2d_copies", ld(h2d_copies)},
      {"h2d_ns", ld(h2d_ns)},
      {"d2h_bytes", ld(d2h_bytes)},
      {"d2h_copies", ld(d2h_copies)},
      {"d2h_ns", ld(d2h_ns)},
      {"device_pool_misses", ld(device_pool_misses)},
      {"h2d_ahead", ld(h2d_ahead)},
      {"copy_wait_ns", ld(copy_wait_ns)},
      {"d2h_behind", ld(d2h_behind)},
      {"copy_out_wait_ns", ld(copy_out_wait_ns)},
      {"kept_reads", ld(kept_reads)},
      {"fused_chains", ld(fused_chains)},
      {"fused_nodes", ld(fused_nodes)},
      {"fusion_fallbacks", ld(fusion_fallbacks)},
      {"cuda_graph_captures", ld(cuda_graph_captures)},
      {"cuda_graph_replays", ld(cuda_graph_replays)},
      {"cuda_graph_nodes", ld(cuda_graph_nodes)},
      {"cuda_graph_plain_nodes", ld(cuda_graph_plain_nodes)},
      {"cuda_graph_fallbacks", ld(cuda_graph_fallbacks)},
      {"cuda_graph_pool_bytes", ld(cuda_graph_pool_bytes)},
  };
}

void Stats::reset() {
  ops_recorded = 0;
  ops_eager = 0;
  views = 0;
  meta_cache_hits = 0;
  meta_cache_misses = 0;
  materializations = 0;
  nodes_executed = 0;
  nodes_eliminated = 0;
  nodes_collected = 0;
  peak_bytes = 0;
  auto_flushes = 0;
  pipeline_handed = 0;
  pipeline_handed_late = 0;
  pipelined_flushes = 0;
  pipeline_given_back = 0;
  pipeline_worker_ns = 0;
  outputs_copied = 0;
  predicted_peak_bytes = 0;
  splits = 0;
  chunks = 0;
  passes = 0;
  barriers = 0;
  batch_conflicts = 0;
  nodes_kept_pending = 0;
  random_row_keyed = 0;
  random_streams = 0;
  random_stream_bytes = 0;
  oom_retries = 0;
  allocator_caps = 0;
  row_loops = 0;
  plan_ns = 0;
  nodes_planned = 0;
  plans_reused = 0;
  fingerprints_from_tape = 0;
  values_recomputed = 0;
  values_in_host_memory = 0;
  collectives = 0;
  collective_bytes = 0;
  h2d_bytes = 0;
  h2d_copies = 0;
  h2d_ns = 0;
  d2h_bytes = 0;
  d2h_copies = 0;
  d2h_ns = 0;
  device_pool_misses = 0;
  h2d_ahead = 0;
  copy_wait_ns = 0;
  d2h_behind = 0;
  copy_out_wait_ns = 0;
  kept_reads = 0;
  fused_chains = 0;
  fused_nodes = 0;
  fusion_fallbacks = 0;
  cuda_graph_captures = 0;
  cuda_graph_replays = 0;
  cuda_graph_nodes = 0;
  cuda_graph_plain_nodes = 0;
  cuda_graph_fallbacks = 0;
  // (cuda_graph_pool_bytes is a level, not a count)
}

namespace {

std::string trimmed_lower(const std::string& v) {
  size_t a = 0, b = v.size();
  while (a < b && std::isspace(static_cast<unsigned char>(v[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(v[b - 1]))) --b;
  std::string out;
  for (size_t i = a; i < b; ++i) out += static_cast<char>(std::tolower(static_cast<unsigned char>(v[i])));
  return out;
}

} // namespace

std::optional<bool> parse_flag(const std::string& value) {
  const std::string v = trimmed_lower(value);
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  return std::nullopt;
}

std::optional<bool> env_flag(const char* name) {
  const char* raw = std::getenv(name);
  if (!raw || trimmed_lower(raw).empty()) return std::nullopt;
  std::optional<bool> v = parse_flag(raw);
  if (!v) TORCH_WARN("lazymem: ignoring ", name, "='", raw, "': use 1, true, on, 0, false or off");
  return v;
}

std::optional<uint64_t> env_count(const char* name) {
  const char* raw = std::getenv(name);
  if (!raw) return std::nullopt;
  const std::string v = trimmed_lower(raw);
  if (v.empty()) return std::nullopt;
  bool digits = v.size() <= 19;
  for (char ch : v) digits = digits && std::isdigit(static_cast<unsigned char>(ch));
  if (!digits) {
    TORCH_WARN("lazymem: ignoring ", name, "='", raw, "': use a non-negative integer");
    return std::nullopt;
  }
  return std::strtoull(v.c_str(), nullptr, 10);
}

static Config* make_config() {
  auto* c = new Config();
  if (const char* d = std::getenv("LAZYMEM_DEBUG")) {
    // A level (0, 1, 2, 3), or an on/off flag (on: 1).
    const std::string v = trimmed_lower(d);
    if (!v.empty() && v.size() <= 2 && std::isdigit(static_cast<unsigned char>(v[0])) &&
        std::isdigit(static_cast<unsigned char>(v.back()))) {
      c->debug = std::atoi(v.c_str());
    } else if (std::optional<bool> on = env_flag("LAZYMEM_DEBUG")) {
      c->debug = *on ? 1 : 0;
    }
  }
  if (std::optional<bool> v = env_flag("LAZYMEM_PLAN_CACHE")) c->plan_cache = *v;
  if (const char* p = std::getenv("LAZYMEM_RECOMPUTE")) {
    // auto (the priced default), or an on/off flag.
    if (trimmed_lower(p) == "auto") {
      c->recompute = -1;
    } else if (std::optional<bool> v = env_flag("LAZYMEM_RECOMPUTE")) {
      c->recompute = *v ? 1 : 0;
    }
  }
  if (std::optional<bool> v = env_flag("LAZYMEM_CHECK_TAPE")) c->check_tape = *v;
  if (std::optional<bool> v = env_flag("LAZYMEM_PIPELINE")) c->pipeline = *v ? 1 : 0;
  if (std::optional<bool> v = env_flag("LAZYMEM_CUDA_GRAPHS")) c->cuda_graphs = *v;
  if (std::optional<bool> v = env_flag("LAZYMEM_FUSION")) c->fusion = *v;
  if (std::optional<uint64_t> n = env_count("LAZYMEM_PIPELINE_BATCH")) c->pipeline_batch = std::max<uint64_t>(*n, 1);
  if (std::optional<uint64_t> n = env_count("LAZYMEM_CHUNK_NODE_NS")) c->chunk_node_ns = static_cast<int64_t>(*n);
  if (std::optional<bool> v = env_flag("LAZYMEM_CHECK_BOUNDARY")) c->check_boundary = *v;
  if (std::optional<bool> v = env_flag("LAZYMEM_ASYNC_COPY_OUT")) c->async_copy_out = *v ? 1 : 0;
  if (std::optional<uint64_t> n = env_count("LAZYMEM_FLUSH_NODES")) c->flush_threshold_nodes = *n;
  if (const char* b = std::getenv("LAZYMEM_FLUSH_BYTES")) {
    if (*b) c->flush_threshold_bytes = static_cast<uint64_t>(parse_bytes(b));
  }
  if (std::optional<uint64_t> n = env_count("LAZYMEM_META_CACHE_SIZE")) c->meta_cache_capacity = *n;
  if (const char* m = std::getenv("LAZYMEM_MEMORY_BUDGET")) {
    if (*m) c->memory_budget = parse_bytes(m);
  }
  return c;
}

Config& config() {
  static Config* c = make_config();
  return *c;
}

int64_t parse_bytes(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t start = i;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  LAZYMEM_CHECK_VALUE(i > start, "cannot parse a byte size from '", text,
                      "'; use a number of bytes or a string such as '256MiB' or '2GB'");
  const std::string number = text.substr(start, i - start);
  char* end = nullptr;
  double value = std::strtod(number.c_str(), &end);
  LAZYMEM_CHECK_VALUE(end == number.c_str() + number.size(), "cannot parse a byte size from '", text,
                      "': '", number, "' is not a number; use a number of bytes or a string such as '256MiB'");
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit;
  for (; i < text.size(); ++i) {
    if (!std::isspace(static_cast<unsigned char>(text[i]))) unit += static_cast<char>(std::tolower(text[i]));
  }
  double mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "kb" || unit == "k") mult = 1e3;
  else if (unit == "mb" || unit == "m") mult = 1e6;
  else if (unit == "gb" || unit == "g") mult = 1e9;
  else if (unit == "tb" || unit == "t") mult = 1e12;
  else if (unit == "kib") mult = 1024.0;
  else if (unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  LAZYMEM_CHECK_VALUE(mult > 0, "unknown byte unit '", unit, "' in '", text,
                      "'; use B, KB, MB, GB, KiB, MiB or GiB");
  double bytes = value * mult;
  LAZYMEM_CHECK_VALUE(std::isfinite(bytes) && bytes >= 0 && bytes < 9.0e18, "byte size '", text,
                      "' is out of range");
  return static_cast<int64_t>(bytes);
}

std::string format_bytes(int64_t n) {
  char buf[64];
  double v = static_cast<double>(n);
  if (n < 0) {
    std::snprintf(buf, sizeof(buf), "unlimited");
  } else if (v >= 1024.0 * 1024 * 1024 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.2f TiB", v / (1024.0 * 1024 * 1024 * 1024));
  } else if (v >= 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", v / (1024.0 * 1024 * 1024));
  } else if (v >= 1024.0 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", v / (1024.0 * 1024));
  } else if (v >= 1024.0) {
    std::snprintf(buf, sizeof(buf), "%.2f KiB", v / 1024.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld bytes", static_cast<long long>(n));
  }
  return buf;
}

std::string format_seconds(double s) {
  char buf[32];
  if (s >= 1) {
    std::snprintf(buf, sizeof(buf), "%.2f s", s);
  } else if (s >= 1e-3) {
    std::snprintf(buf, sizeof(buf), "%.2f ms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f us", s * 1e6);
  }
  return buf;
}

} // namespace lazymem
