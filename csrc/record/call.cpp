// record: argument classification and cache keys.
#include "record/call.h"

#include <cstring>
#include <functional>
#include <c10/util/hash.h>

#include "core/check.h"
#include "device/phantom.h"

namespace lazymem {
namespace {

enum Tag : int64_t {
  kUndef = 1, kLazyT, kScalarT, kConstT, kInt, kDouble, kBool, kNone, kString, kDevice, kGenerator,
  kIntList, kDoubleList, kBoolList, kList, kScalarInt, kScalarDouble, kScalarBool, kScalarComplex,
  kOther, kSymInt
};

int64_t bits(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof(b));
  return b;
}

struct Analyzer {
  Call& call;
  bool allow_constants;
  c10::SmallVector<const c10::StorageImpl*, 6> storages; // parallel to lazy tensors (alias classes)

  void w(int64_t x) {
    call.key.words.push_back(x);
  }

  void meta_words(const at::Tensor& t) {
    w(static_cast<int64_t>(t.scalar_type()) | (static_cast<int64_t>(t.dim()) << 8) |
      (static_cast<int64_t>(t.is_conj()) << 16) | (static_cast<int64_t>(t.is_neg()) << 17));
    for (int64_t s : t.sizes()) w(s);
    for (int64_t s : t.strides()) w(s);
  }

  void tensor(const at::Tensor& t, int32_t arg, int32_t elem, bool in_index_list) {
    if (!t.defined()) {
      w(kUndef);
      return;
    }
    TensorArg ta;
    ta.arg = arg;
    ta.elem = elem;
    ta.tensor = &t;
    ta.write = call.rules.writes[arg];
    if (is_lazy(t)) {
      LAZYMEM_CHECK(t.layout() == c10::kStrided, call.op.schema().name(), ": only strided lazymem tensors are ",
                    "supported, got layout ", t.layout());
      LAZYMEM_CHECK(t.has_storage() && buffer_of(t) != nullptr, call.op.schema().name(),
                    ": a lazymem tensor without lazymem storage was passed; create lazymem tensors with "
                    "torch factories or .to('lazymem')");
      const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
      int32_t alias = -1;
      for (size_t i = 0; i < storages.size(); ++i) {
        if (storages[i] == s) {
          alias = static_cast<int32_t>(i);
          break;
        }
      }
      int32_t index = static_cast<int32_t>(storages.size());
      storages.push_back(s);
      ta.alias = alias < 0 ? index : alias;
      ta.kind = TensorArg::kLazy;
      w(kLazyT);
      w(ta.alias);
      meta_words(t);
      w(t.storage_offset());
      if (ta.write) w(static_cast<int64_t>(t.storage().nbytes()));
      call.tensors.push_back(std::move(ta));
      return;
    }
    if (t.device().is_cpu() && t.dim() == 0 && !ta.write) {
      ta.kind = TensorArg::kCpuScalar;
      w(kScalarT);
      w(static_cast<int64_t>(t.scalar_type()) | (static_cast<int64_t>(t.unsafeGetTensorImpl()->is_wrapped_number()) << 8));
      call.tensors.push_back(std::move(ta));
      return;
    }
    if (allow_constants || (in_index_list && !ta.write)) {
      ta.kind = TensorArg::kConstant;
      w(kConstT);
      meta_words(t);
      call.tensors.push_back(std::move(ta));
      return;
    }
    // Same wording as eager's TensorIterator error between CPU and CUDA tensors.
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                "lazymem:0 and ", t.device(), "! (", call.op.schema().name(), "; move the ", t.device(),
                " tensor with .to('lazymem') first)");
  }

  // A floating-point value: by value, or by type only where values cannot change output metadata.
  void fp(double d) {
    if (!call.rules.float_values_shape_free) w(bits(d));
  }

  void scalar(const c10::Scalar& s) {
    if (s.isComplex()) {
      auto c = s.toComplexDouble();
      w(kScalarComplex);
      fp(c.real());
      fp(c.imag());
    } else if (s.isFloatingPoint()) {
      w(kScalarDouble);
      fp(s.toDouble());
    } else if (s.isBoolean()) {
      w(kScalarBool);
      w(s.toBool());
    } else if (s.isSymbolic()) {
      call.cacheable = false;
    } else {
      w(kScalarInt);
      w(s.toLong());
    }
  }

  void value(const c10::IValue& v, int32_t arg, int32_t elem, bool in_list) {
    if (v.isTensor()) {
      tensor(v.toTensor(), arg, elem, in_list);
    } else if (v.isNone()) {
      w(kNone);
    } else if (v.isInt()) {
      w(kInt);
      w(v.toInt());
    } else if (v.isDouble()) {
      w(kDouble);
      fp(v.toDouble());
    } else if (v.isBool()) {
      w(kBool);
      w(v.toBool());
    } else if (v.isSymInt()) {
      auto si = v.toSymInt();
      if (auto m = si.maybe_as_int()) {
        w(kInt);
        w(*m);
      } else {
        call.cacheable = false;
      }
    } else if (v.isScalar()) {
      scalar(v.toScalar());
    } else if (v.isString()) {
      w(kString);
      w(static_cast<int64_t>(std::hash<std::string>()(v.toStringRef())));
    } else if (v.isDevice()) {
      w(kDevice);
      w(static_cast<int64_t>(v.toDevice().type()) * 1024 + v.toDevice().index());
    } else if (v.isGenerator()) {
      w(kGenerator);
    } else if (v.isIntList()) {
      auto l = v.toIntList();
      w(kIntList);
      w(static_cast<int64_t>(l.size()));
      for (int64_t x : l) w(x);
    } else if (v.isDoubleList()) {
      auto l = v.toDoubleList();
      w(kDoubleList);
      w(static_cast<int64_t>(l.size()));
      for (double x : l) fp(x);
    } else if (v.isBoolList()) {
      auto l = v.toBoolList();
      w(kBoolList);
      w(static_cast<int64_t>(l.size()));
      for (bool x : l) w(x);
    } else if (v.isList()) {
      bool optional_tensors = v.toList().elementType()->kind() == c10::TypeKind::OptionalType;
      // The elements themselves, not copies: TensorArg borrows them from the call's stack.
      c10::ArrayRef<c10::IValue> l = v.toListRef();
      w(kList);
      w(static_cast<int64_t>(l.size()));
      for (size_t i = 0; i < l.size(); ++i) {
        const c10::IValue& e = l[i];
        if (optional_tensors && e.isTensor()) {
          auto st = e.toTensor().scalar_type();
          if (st == c10::kBool || st == c10::kByte) call.has_mask_index = true;
        }
        value(e, arg, static_cast<int32_t>(i), optional_tensors);
      }
    } else {
      w(kOther);
      call.cacheable = false;
    }
  }
};

} // namespace

void analyze_call(Call& call, bool allow_constants) {
  Analyzer a{call, allow_constants};
  call.key.words.push_back(reinterpret_cast<intptr_t>(&call.op.schema()));
  for (size_t i = 0; i < call.num_args; ++i) {
    if (static_cast<int32_t>(i) == call.rules.state_arg) {
      call.key.words.push_back(0); // per-call state, not structure
      continue;
    }
    a.value(call.arg(i), static_cast<int32_t>(i), -1, false);
  }
  size_t h = 1469598103934665603ull;
  for (int64_t x : call.key.words) h = c10::hash_combine(h, static_cast<size_t>(x));
  call.key.hash = h;
}

} // namespace lazymem
