// core: error helpers shared by every stage. Every user-facing message starts with "lazymem: ",
// names the op and the values involved, and says what to do.
#pragma once

#include <c10/util/Exception.h>

#define LAZYMEM_CHECK(cond, ...) TORCH_CHECK(cond, "lazymem: ", __VA_ARGS__)
#define LAZYMEM_CHECK_NOT_IMPLEMENTED(cond, ...) \
  TORCH_CHECK_NOT_IMPLEMENTED(cond, "lazymem: ", __VA_ARGS__)
#define LAZYMEM_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, "lazymem: ", __VA_ARGS__)
#define LAZYMEM_INTERNAL_ASSERT(cond, ...) \
  TORCH_INTERNAL_ASSERT(cond, "lazymem internal error: ", __VA_ARGS__)
