// core: compile gates for the torch versions this extension builds against (2.4 and newer; built
// and tested here with 2.13). Everything version-dependent is gated with LAZYMEM_TORCH_AT_LEAST.
#pragma once

#include <torch/version.h>

#define LAZYMEM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
