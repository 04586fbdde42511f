// ir: TensorMeta geometry and Node printing.
#include "ir/node.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <new>
#include <sstream>

namespace lazymem {

TensorMeta TensorMeta::contiguous(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  TensorMeta m;
  m.sizes.assign(sizes.begin(), sizes.end());
  m.strides.resize(sizes.size());
  int64_t st = 1;
  for (size_t k = sizes.size(); k-- > 0;) {
    m.strides[k] = st;
    st *= std::max<int64_t>(sizes[k], 1);
  }
  m.dtype = dtype;
  return m;
}

TensorMeta TensorMeta::of(const c10::TensorImpl& t) {
  TensorMeta m;
  m.sizes.assign(t.sizes().begin(), t.sizes().end());
  m.strides.assign(t.strides().begin(), t.strides().end());
  m.offset = t.storage_offset();
  m.dtype = t.dtype().toScalarType();
  m.conj = t.is_conj();
  m.neg = t.is_neg();
  return m;
}

int64_t TensorMeta::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

size_t TensorMeta::extent_bytes() const {
  int64_t n = numel();
  if (n == 0) return 0;
  int64_t last = offset;
  for (size_t i = 0; i < sizes.size(); ++i) last += (sizes[i] - 1) * strides[i];
  return static_cast<size_t>(last + 1) * c10::elementSize(dtype);
}

bool TensorMeta::row_major() const {
  int64_t expect = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expect) return false;
    expect *= sizes[d];
  }
  return true;
}

bool TensorMeta::covers(size_t nbytes) const {
  if (offset != 0) return false;
  int64_t n = numel();
  if (static_cast<size_t>(n) * c10::elementSize(dtype) != nbytes) return false;
  // Dense and non-overlapping: some permutation of the dims has contiguous strides.
  c10::SmallVector<int64_t, 5> order;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] != 1) order.push_back(static_cast<int64_t>(i));
  }
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] < strides[b]; });
  int64_t expected = 1;
  for (int64_t d : order) {
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

void TensorMeta::apply_to(c10::TensorImpl& t) const {
  t.set_sizes_and_strides(sizes, strides, offset);
  if (conj) t._set_conj(true);
  if (neg) t._set_neg(true);
}

std::string TensorMeta::to_string() const {
  std::ostringstream os;
  os << c10::toString(dtype) << "[";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? "," : "") << sizes[i];
  os << "]";
  bool contiguous = true;
  int64_t expected = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] != 1 && strides[i] != expected) contiguous = false;
    expected *= sizes[i];
  }
  if (!contiguous) {
    os << "{";
    for (size_t i = 0; i < strides.size(); ++i) os << (i ? "," : "") << strides[i];
    os << "}";
  }
  if (offset) os << "+" << offset;
  return os.str();
}

std::string Node::describe() const {
  std::ostringstream os;
  const auto& name = op.operator_name();
  os << name.name;
  if (!name.overload_name.empty()) os << "." << name.overload_name;
  os << " (op #" << seq << " of the recorded program";
  if (!site.empty()) {
    os << ", recorded at " << site;
  } else {
    os << "; set LAZYMEM_DEBUG=1 to see where it was recorded";
  }
  os << ")";
  return os.str();
}

std::string Node::to_string() const {
  std::ostringstream os;
  os << "#" << seq << " ";
  for (size_t i = 0; i < defs.size(); ++i) {
    os << (i ? ", " : "") << "b" << defs[i].ref.buf->id << "v" << defs[i].ref.version;
  }
  bool any_write = false;
  for (const auto& u : uses) {
    if (u.write) {
      os << (defs.empty() && !any_write ? "" : ", ") << "b" << u.ref.buf->id << "v" << u.write_version;
      any_write = true;
    }
  }
  os << " = " << op.operator_name().name;
  if (!op.operator_name().overload_name.empty()) os << "." << op.operator_name().overload_name;
  os << "(";
  for (size_t i = 0; i < uses.size(); ++i) {
    const auto& u = uses[i];
    os << (i ? ", " : "") << "b" << u.ref.buf->id << "v" << u.ref.version << ":" << u.ref.meta.to_string();
  }
  os << ")";
  if (random) os << " [random]";
  if (effectful) os << " [effect]";
  return os.str();
}

namespace {

// At most this many shells are kept (each a few hundred bytes with its vectors' room): a pipelined
// batch's nodes on the CPU, four of them on an accelerator.
constexpr size_t kMaxShells = 4096;
constexpr size_t kShellRoom = 8; // arguments, uses or defs whose room a shell keeps

std::mutex g_shells_mu;
std::atomic<size_t> g_shell_count{0}; // shared_shells().size(), read without the lock
std::vector<NodePtr>& shared_shells() {
  static auto* v = new std::vector<NodePtr>(); // leaked: shells may be recycled during interpreter exit
  return *v;
}
// The recording thread takes shells from its own stash, refilled from the shared one a batch at a time.
// (Emptied shells only: their destruction at thread exit frees memory and nothing else.)
thread_local bool t_stash_gone = false;
struct Stash {
  std::vector<NodePtr> shells;
  ~Stash() {
    t_stash_gone = true; // (a record after this, at thread exit, allocates)
  }
};
thread_local Stash t_stash;

// Off under AddressSanitizer: a node read after its run is reported, not reused.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kKeepShells = false;
#else
constexpr bool kKeepShells = true;
#endif

// The node as a fresh one for `op` would be, but keeping the room of its argument, use and def
// vectors; its buffer references moved to `released`.
void empty_node(Node& n, std::vector<BufferPtr>& released) {
  std::vector<c10::IValue> args = std::move(n.args);
  std::vector<Use> uses = std::move(n.uses);
  std::vector<Def> defs = std::move(n.defs);
  // (A reference that is not the last is dropped here: that frees nothing. Racy but harmless: one
  // that became the last meanwhile frees its buffer here, as before.)
  auto release = [&](BufferPtr& b) {
    if (b && b.use_count() == 1) {
      released.push_back(std::move(b));
    } else {
      b.reset();
    }
  };
  for (Use& u : uses) release(u.ref.buf);
  for (Def& d : defs) release(d.ref.buf);
  // (Room for a few entries only: a shell of a _foreach op over every parameter would keep its
  // thousands of uses' room for as long as the shell is kept.)
  args.clear();
  uses.clear();
  defs.clear();
  if (args.capacity() > kShellRoom) std::vector<c10::IValue>().swap(args);
  if (uses.capacity() > kShellRoom) std::vector<Use>().swap(uses);
  if (defs.capacity() > kShellRoom) std::vector<Def>().swap(defs);
  c10::OperatorHandle op = n.op;
  n.~Node();
  new (&n) Node(std::move(op));
  n.args = std::move(args);
  n.uses = std::move(uses);
  n.defs = std::move(defs);
}

} // namespace

NodePtr new_node(const c10::OperatorHandle& op) {
  if (t_stash_gone) return std::make_unique<Node>(op);
  std::vector<NodePtr>& stash = t_stash.shells;
  if (stash.empty() && g_shell_count.load(std::memory_order_relaxed) > 0) {
    std::lock_guard<std::mutex> lock(g_shells_mu);
    stash.swap(shared_shells());
    g_shell_count.store(0, std::memory_order_relaxed);
  }
  if (stash.empty()) return std::make_unique<Node>(op);
  NodePtr n = std::move(stash.back());
  stash.pop_back();
  n->op = op;
  return n;
}

void recycle_nodes(std::vector<NodePtr>& nodes, std::vector<BufferPtr>& released) {
  size_t live = 0;
  for (NodePtr& n : nodes) {
    if (!n) continue;
    empty_node(*n, released);
    nodes[live++] = std::move(n);
  }
  nodes.resize(live);
  if (kKeepShells) {
    std::lock_guard<std::mutex> lock(g_shells_mu);
    std::vector<NodePtr>& shells = shared_shells();
    const size_t take = std::min(nodes.size(), kMaxShells - std::min(kMaxShells, shells.size()));
    // (Last in, first out: pushed from the back, so that the next records take them in program order.)
    for (size_t i = 0; i < take; ++i) shells.push_back(std::move(nodes[nodes.size() - 1 - i]));
    g_shell_count.store(shells.size(), std::memory_order_relaxed);
    nodes.resize(nodes.size() - take);
  }
  nodes.clear(); // (the shells over the bound, outside the lock)
}

} // namespace lazymem
