// execute: what a CUDA graph bakes in of a node (graph_hash.h).
#include "execute/graph_hash.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <string_view>

#include <ATen/core/Tensor.h>

namespace lazymem {
namespace {

void mix(uint64_t& h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
}

// Mixes a non-lazymem argument into `h`; false when it cannot be in a graph.
bool hash_arg(const c10::IValue& v, uint64_t& h) {
  if (v.isNone()) {
    mix(h, 1);
  } else if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      mix(h, 2);
    } else if (t.is_cpu()) {
      // A host scalar is a kernel argument by value: its value is part of the graph. A larger host
      // tensor is copied to the device from an address the graph would keep.
      if (t.numel() != 1) return false;
      uint64_t bits = 0;
      std::memcpy(&bits, t.const_data_ptr(), std::min<size_t>(t.element_size(), sizeof(bits)));
      mix(h, bits);
      mix(h, static_cast<uint64_t>(t.scalar_type()));
    } else {
      mix(h, reinterpret_cast<uintptr_t>(t.const_data_ptr())); // read at this address
      mix(h, static_cast<uint64_t>(t.numel()));
    }
  } else if (v.isDouble()) {
    const double d = v.toDouble();
    uint64_t bits = 0;
    std::memcpy(&bits, &d, sizeof(bits));
    mix(h, 3);
    mix(h, bits);
  } else if (v.isInt()) {
    mix(h, 4);
    mix(h, static_cast<uint64_t>(v.toInt()));
  } else if (v.isBool()) {
    mix(h, v.toBool() ? 5 : 6);
  } else if (v.isSymInt()) {
    auto i = v.toSymInt().maybe_as_int();
    if (!i) return false;
    mix(h, 4);
    mix(h, static_cast<uint64_t>(*i));
  } else if (v.isComplexDouble()) {
    const c10::complex<double> c = v.toComplexDouble();
    uint64_t bits[2] = {0, 0};
    std::memcpy(bits, &c, sizeof(bits));
    mix(h, 7);
    mix(h, bits[0]);
    mix(h, bits[1]);
  } else if (v.isString()) {
    mix(h, std::hash<std::string_view>{}(v.toStringView()));
  } else if (v.isDevice()) {
    mix(h, 8 + static_cast<uint64_t>(v.toDevice().type()) * 256 + static_cast<uint64_t>(v.toDevice().index() + 1));
  } else if (v.isList()) {
    const auto list = v.toListRef();
    for (const c10::IValue& e : list) {
      if (!hash_arg(e, h)) return false;
    }
    mix(h, 9 + list.size());
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) {
      if (!hash_arg(e, h)) return false;
    }
  } else {
    return false; // a generator, an object: not in a graph
  }
  return true;
}

} // namespace

uint64_t graph_node_hash(const PlannedNode& pn) {
  const Node& n = *pn.node;
  if (n.random || n.upload || n.effectful || !pn.consts.empty() || !pn.rewrites.empty()) return kGraphPlain;
  for (const Use& u : n.uses) {
    if (u.ref.buf->real_on_host) return kGraphPlain;
  }
  uint64_t h = 0x6c617a796d656dull;
  mix(h, n.grad_mode);
  for (const c10::IValue& a : n.args) {
    if (!hash_arg(a, h)) return kGraphPlain;
  }
  return h == kGraphPlain ? 0 : h;
}

} // namespace lazymem
