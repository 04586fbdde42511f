// core: the precompiled header of the core's build (setup.py compiles it once per build directory
// with the core's exact flags and force-includes it in every translation unit of the core): the
// standard and torch headers most of them include, parsed once instead of sixty times. Nothing
// here may depend on lazymem; a file still includes what it uses.
#pragma once

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
