// core: how a random op's draws are reproduced when it runs chunk by chunk (DESIGN.md §7 RNG). The
// form is a property of the op and its arguments (ops/rules_rng.cpp says which), stored on the node
// at record time; the planner and the executor act on it. Each stream form names eager's kernel
// as a draw that depends on the geometry alone (a fill of a tensor laid out as eager's) followed by
// element-wise ops: the draw runs once, whole, in program order, and every chunk reads its rows.
#pragma once

#include <cstdint>

namespace lazymem {

enum class RngForm : uint8_t {
  kNone,        // not random
  kNoDraws,     // tagged random, but this call draws nothing (dropout with p = 0, eval-mode rrelu)
  kWhole,       // its draws depend on its inputs' values (rejection samplers, rrelu in training): no
                // split form; it runs whole, in program order
  kFill,        // its results depend on the generator and its operands' geometry alone (uniform_,
                // normal_, bernoulli_(p float), random_, exponential_, ..., bernoulli.p, randperm.out):
                // the op itself, run on the whole geometry
  kBernoulliP,  // bernoulli_(self, Tensor p), CPU: one uniform per element in self's order (double for
                // double p, else float), compared with p
  kNormalTF,    // normal(Tensor mean, float std): normal_(0, std) of the output, plus mean
  kNormalFT,    // normal(float mean, Tensor std): normal_(0, 1), times std, plus mean
  kNormalTT,    // normal(Tensor mean, Tensor std): normal_(0, 1), times std, plus mean
  kDropout,     // native_dropout in training: its mask depends on the input's geometry (and, on CUDA,
                // alignment) alone; the output is input * mask * (1 / (1 - p))
  kMultinomial, // multinomial without replacement (or one sample): exponential_(1) of the
                // probabilities' geometry q, then argmax / topk of p / q
};

// Forms whose draw is eager's on any backing device (the draw is a fill, the rest device-generic
// ATen ops); the others follow the CPU kernel, and run keyed by batch rows on other devices.
inline bool rng_form_device_generic(RngForm f) {
  return f == RngForm::kFill || f == RngForm::kNormalTF || f == RngForm::kNormalFT || f == RngForm::kNormalTT ||
      f == RngForm::kMultinomial || f == RngForm::kDropout;
}

// Forms with a split form (the draw generated whole, chunks reading rows).
inline bool rng_form_streams(RngForm f) {
  return f >= RngForm::kFill;
}

inline bool rng_form_draws(RngForm f) {
  return f >= RngForm::kWhole;
}

inline const char* rng_form_name(RngForm f) {
  switch (f) {
    case RngForm::kNone:
      return "not random";
    case RngForm::kNoDraws:
      return "draws nothing";
    case RngForm::kWhole:
      return "whole";
    case RngForm::kFill:
      return "fill";
    case RngForm::kBernoulliP:
      return "bernoulli(p): uniforms < p";
    case RngForm::kNormalTF:
      return "normal(mean, std): normal_(0, std) + mean";
    case RngForm::kNormalFT:
      return "normal(mean, std): normal_(0, 1) * std + mean";
    case RngForm::kNormalTT:
      return "normal(mean, std): normal_(0, 1) * std + mean";
    case RngForm::kDropout:
      return "native_dropout: its mask, then input * mask * scale";
    case RngForm::kMultinomial:
      return "multinomial: argmax / topk of p / exponential_(1)";
  }
  return "?";
}

} // namespace lazymem
