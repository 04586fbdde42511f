// ir: the pending program.
#include "ir/program.h"

#include <atomic>
#include <sstream>
#include <unordered_map>

#include "core/check.h"
#include "core/config.h"

namespace lazymem {

Program& Program::get() {
  static Program* p = new Program(); // leaked: nodes may still be dropped during interpreter exit
  return *p;
}

Program::Program() {
  tape_.reset(Tape::Scratch::kProgram);
}

void Program::retape() {
  tape_.reset(Tape::Scratch::kProgram);
  for (const auto& n : pending_) tape_.add(*n);
}

void Program::recycle_tape(Tape&& tape) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tape.words.capacity() > spare_tape_.words.capacity()) spare_tape_ = std::move(tape);
}

static uint64_t def_bytes(const Node& n) {
  uint64_t b = 0;
  for (const auto& d : n.defs) b += d.ref.buf->nbytes.load(std::memory_order_relaxed);
  return b;
}

// Counts the node's writes as pending (delta +1) or no longer pending (-1). Program lock held.
static void note_pending_writes(const Node& n, int delta) {
  for (const auto& d : n.defs) d.ref.buf->pending_writes += delta;
  for (const auto& u : n.uses) {
    if (u.write) u.ref.buf->pending_writes += delta;
  }
}

uint64_t Program::append(NodePtr node) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t seq = next_seq_++;
  node->seq = seq;
  // Reads first, so an argument that is both read and written (add_(x, x)) reads the old version.
  for (auto& u : node->uses) {
    u.ref.version = u.ref.buf->version;
    size_t nbytes = u.ref.buf->nbytes.load(std::memory_order_relaxed);
    if (u.write_only && u.ref.meta.covers(nbytes)) u.covered_nbytes = nbytes;
  }
  for (auto& u : node->uses) {
    if (!u.write) continue;
    u.write_version = ++u.ref.buf->version;
    u.ref.buf->last_writer_seq = seq;
    if (node->upload) u.ref.buf->holds_data.store(true, std::memory_order_relaxed);
    if (node->upload && u.full_overwrite()) {
      LazyBuffer& b = *u.ref.buf;
      b.upload_version = u.write_version;
      const TensorMeta& m = u.ref.meta;
      b.upload_rows = m.sizes.empty() ? 0 : m.sizes[0];
      b.upload_stride_bytes = m.sizes.empty() ? 0 : m.strides[0] * static_cast<int64_t>(c10::elementSize(m.dtype));
      b.fact_version = u.write_version; // dim 0, a hint: a later plan may choose otherwise
      b.fact_hint = true;
      b.fact_batch = 0;
      b.fact_rows = b.upload_rows;
      b.fact_row_bytes = b.upload_stride_bytes;
    }
  }
  for (auto& d : node->defs) {
    LAZYMEM_INTERNAL_ASSERT(d.ref.buf->version == 0, "def of a buffer that was already written");
    d.ref.buf->version = 1;
    d.ref.version = 1;
    d.ref.buf->last_writer_seq = seq;
  }
  pending_bytes_ += def_bytes(*node);
  note_pending_writes(*node, +1);
  tape_.add(*node);
  pending_.push_back(std::move(node));
  pending_size_.store(pending_.size(), std::memory_order_relaxed);
  return seq;
}

void Program::set_batch_hint(LazyBuffer& b, LazyBuffer::BatchHint hint, int64_t rows, int64_t stride_bytes,
                             bool only_if_auto) {
  std::lock_guard<std::mutex> lock(mu_);
  if (only_if_auto && b.batch_hint != LazyBuffer::BatchHint::kAuto) return;
  b.batch_hint = hint;
  b.mark_rows = rows;
  b.mark_stride_bytes = stride_bytes;
}

uint32_t Program::note_external_write(LazyBuffer& b) {
  std::lock_guard<std::mutex> lock(mu_);
  return ++b.version;
}

uint64_t Program::pending_writer(const LazyBuffer& b) {
  std::lock_guard<std::mutex> lock(mu_);
  // Nodes put back after a materialization leave holes in the pending seqs, so the front's seq says
  // nothing about whether the last writer ran: the count of pending writers does. When it is
  // non-zero the last writer is pending (a kept-pending writer is never followed by one that ran).
  return b.pending_writes > 0 ? b.last_writer_seq : 0;
}

uint64_t Program::last_seq() {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.empty() ? 0 : pending_.back()->seq;
}

uint64_t Program::seq_at(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_.empty()) return 0;
  return n < pending_.size() ? pending_[n]->seq : pending_.back()->seq;
}

size_t Program::collect_dead() {
  std::vector<NodePtr> dead; // destroyed after the lock: their buffers' storage goes with them
  std::lock_guard<std::mutex> lock(mu_);
  collect_dead_locked(dead);
  return dead.size();
}

void Program::collect_dead_locked(std::vector<NodePtr>& dead) {
  const uint64_t count = dead_pinned_count();
  if (count == swept_at_ || pending_.empty()) return;
  swept_at_ = count;
  // Backwards: a node is dead when nothing can read what it writes — every buffer it writes has
  // lost its last tensor and no later node that stays reads it — and it has no effect of its own
  // (random nodes advance their generator; effectful ones assert). Its reads then stop mattering.
  static std::atomic<uint64_t> stamps{0};
  const uint64_t stamp = stamps.fetch_add(1, std::memory_order_relaxed) + 1;
  std::vector<char> drop(pending_.size(), 0);
  size_t dropped = 0;
  auto unread = [&](const LazyBuffer* b) {
    return b->sweep_stamp != stamp && !b->storage_alive.load(std::memory_order_acquire);
  };
  for (size_t i = pending_.size(); i-- > 0;) {
    const Node& n = *pending_[i];
    bool is_dead = !n.random && !n.effectful;
    for (const Def& d : n.defs) is_dead = is_dead && unread(d.ref.buf.get());
    for (const Use& u : n.uses) is_dead = is_dead && (!u.write || unread(u.ref.buf.get()));
    if (is_dead) {
      drop[i] = 1;
      ++dropped;
      continue;
    }
    for (const Use& u : n.uses) u.ref.buf->sweep_stamp = stamp;
  }
  if (!dropped) return;
  std::deque<NodePtr> kept;
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (!drop[i]) {
      kept.push_back(std::move(pending_[i]));
      continue;
    }
    pending_bytes_ -= def_bytes(*pending_[i]);
    note_pending_writes(*pending_[i], -1);
    dead.push_back(std::move(pending_[i]));
  }
  pending_ = std::move(kept);
  pending_size_.store(pending_.size(), std::memory_order_relaxed);
  retape();
  stats().nodes_collected.fetch_add(dropped, std::memory_order_relaxed);
}

namespace {
std::atomic<uint64_t> g_epochs{0};
} // namespace

template <class Mark>
void Program::visit_live_locked(uint64_t upto, Mark&& mark) {
  auto note_alive = [&](LazyBuffer* b) {
    if (b->storage_alive.load(std::memory_order_acquire)) mark(b);
  };
  for (const auto& n : pending_) {
    if (n->seq <= upto) {
      for (const auto& d : n->defs) note_alive(d.ref.buf.get());
      for (const auto& u : n->uses) note_alive(u.ref.buf.get());
      continue;
    }
    for (const auto& u : n->uses) {
      // A pending full overwrite does not need the old value; anything else does.
      if (!(u.write_only && u.covered_nbytes && u.covered_nbytes == u.ref.buf->nbytes.load())) mark(u.ref.buf.get());
    }
  }
}

uint64_t Program::stamp_live_locked(uint64_t upto) {
  const uint64_t epoch = g_epochs.fetch_add(1, std::memory_order_relaxed) + 1;
  visit_live_locked(upto, [&](LazyBuffer* b) { b->live_epoch = epoch; });
  return epoch;
}

Program::LiveSnapshot Program::snapshot_live(uint64_t upto, const std::unique_lock<std::mutex>& flush,
                                             const std::vector<BufferPtr>* also) {
  LAZYMEM_INTERNAL_ASSERT(flush.owns_lock(), "a live-out snapshot needs the flush lock");
  std::lock_guard<std::mutex> lock(mu_);
  LiveSnapshot snap{upto, stamp_live_locked(upto), takes_};
  if (also) {
    for (const BufferPtr& b : *also) b->live_epoch = snap.epoch;
  }
  return snap;
}

std::vector<BufferPtr> Program::live_now(uint64_t upto) {
  std::vector<BufferPtr> live;
  std::lock_guard<std::mutex> lock(mu_);
  visit_live_locked(upto, [&](LazyBuffer* b) { live.emplace_back(BufferPtr::reclaim_copy(b)); });
  return live;
}

Segment Program::take_prefix(uint64_t upto, const LiveSnapshot* live) {
  Segment seg;
  std::vector<NodePtr> dead;
  std::lock_guard<std::mutex> lock(mu_);
  // A snapshot still holds when nothing was taken since and it covers exactly this prefix (nodes
  // recorded since only read what a tensor held then; dead nodes dropped now only make it larger).
  const bool snapshot = live && live->takes == takes_ && live->upto == upto;
  ++takes_;
  collect_dead_locked(dead);
  seg.epoch = snapshot ? live->epoch : stamp_live_locked(upto);
  seg.live_snapshot = snapshot;
  while (!pending_.empty() && pending_.front()->seq <= upto) {
    pending_bytes_ -= def_bytes(*pending_.front());
    note_pending_writes(*pending_.front(), -1);
    seg.nodes.push_back(std::move(pending_.front()));
    pending_.pop_front();
  }
  pending_size_.store(pending_.size(), std::memory_order_relaxed);
  if (seg.nodes.empty()) return seg;
  if (pending_.empty() && tape_.nodes == seg.nodes.size()) {
    // Everything pending: the segment takes the tape, the program starts a new one in spare room.
    seg.tape = std::move(tape_);
    tape_ = std::move(spare_tape_);
    tape_.reset(Tape::Scratch::kProgram);
    spare_tape_ = Tape{};
  } else {
    retape(); // (what stays pending numbered from its first node)
  }
  return seg;
}

void Program::restore_prefix(std::vector<NodePtr> nodes) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    LAZYMEM_INTERNAL_ASSERT(pending_.empty() || (*it)->seq < pending_.front()->seq,
                            "restored nodes must precede the pending program");
    pending_bytes_ += def_bytes(**it);
    note_pending_writes(**it, +1);
    pending_.push_front(std::move(*it));
  }
  pending_size_.store(pending_.size(), std::memory_order_relaxed);
  retape();
}

void Program::verify() {
  std::lock_guard<std::mutex> lock(mu_);
  // Every pending node's uses read versions no newer than the buffer's latest, writes are increasing
  // per buffer in program order, and seqs are strictly increasing.
  std::unordered_map<const LazyBuffer*, uint32_t> last_written;
  uint64_t prev = 0;
  for (const auto& n : pending_) {
    LAZYMEM_INTERNAL_ASSERT(n->seq > prev, "pending seqs not increasing at #", n->seq);
    prev = n->seq;
    for (const auto& u : n->uses) {
      LAZYMEM_INTERNAL_ASSERT(u.ref.version <= u.ref.buf->version, "use reads a future version in #", n->seq);
      if (u.write) {
        auto& lw = last_written[u.ref.buf.get()];
        LAZYMEM_INTERNAL_ASSERT(u.write_version > lw, "write versions not increasing in #", n->seq);
        lw = u.write_version;
      }
    }
  }
}

std::string Program::to_string(size_t max_nodes) {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream os;
  os << "Program: " << pending_.size() << " pending nodes\n";
  size_t i = 0;
  for (const auto& n : pending_) {
    if (i++ == max_nodes) {
      os << "  ...\n";
      break;
    }
    os << "  " << n->to_string() << "\n";
  }
  return os.str();
}

} // namespace lazymem
