// TpuEmbedExtApplyStep: the backward pass and update of every table of one
// training step, in one op (update.py builds its inputs and reads its
// outputs; docs/semantics.md is the specification of the math).
//
// Inputs come in segments (one per feature and replica, in the order the
// TF-op path concatenates them): occurrence i of a segment sends
// gains[i] * grads[rows[i]] to id ids[i] (rows empty: row i; gains empty:
// gain 1). Per table the kernel then, exactly as updates.py does with
// TensorFlow ops:
//   1. sums the gradients per id in input order (mode SUMS), keeps every
//      contribution apart (ROUNDS: use_gradient_accumulation=False, applied
//      in input order, which equals updates._in_rounds), or sums into every
//      row of the table (EVERY_ROW: non-lazy Adam);
//   2. runs update_rules.apply_update on the touched rows, in float32 and
//      in the same order of operations (bit-identical results; built with
//      -ffp-contract=off so no multiply-add is fused): in place after
//      logging the old rows (SUMS), or into scratch (ROUNDS, EVERY_ROW);
//   3. checks what it applies (before any row changes) and what it writes,
//      for ALL tables; if everything is finite it writes the scratch rows,
//      else it puts the logged rows back. All of it under exclusive locks
//      of all the step's variables (copy-on-read as TensorFlow's own sparse
//      training ops do, training_op_helpers.h), so no reader sees a row in
//      between.
// A step that fails a check changes nothing and says which table and
// variable failed (outputs); the step's pipeline (step_pipeline.py) raises
// the engine's usual messages.

#ifndef EIGEN_USE_THREADS
#define EIGEN_USE_THREADS
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tpu_embed_ext {
void UseHugePages(const void* data, std::size_t bytes,  // huge_pages.cc
                  bool again = false);
}  // namespace tpu_embed_ext

namespace tensorflow {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;

// Keep in sync with optimizer_rows.py: one Kind per row (its native_kind)
// with its number of slots, and the Mode, Flag and Param constants there. A
// row's native_params fill kA, kB, ... and its native_flags set its own
// flags; its case in ApplyRow reads them (tests/test_optimizer_rows.py
// compares these enums with the rows).
enum Kind { kSGD = 0, kAdagrad = 1, kAdagradMomentum = 2, kAdam = 3, kFTRL = 4,
            kNumKinds };
constexpr int kNumSlots[kNumKinds] = {0, 1, 2, 2, 2};  // by Kind
enum Mode { kSums = 0, kRounds = 1, kEveryRow = 2 };
enum Flag {
  kClipLow = 1, kClipHigh = 2, kDecay = 4, kDecayTimesLr = 8,
  kWeightMin = 16, kWeightMax = 32, kBeta2IsOne = 64, kNesterov = 128,
  kSumInsideSqrt = 256, kLinearTimesLr = 512, kL1 = 1024,
  // Inside tf.function, Grappler rewrites the TF-op path's arithmetic
  // before it runs; update.py sets these when it would (see PowLikeTf).
  kGraphPow = 2048,       // arithmetic optimizer: pow(x, c) for some c
  kRsqrtMul = 4096,       // arithmetic optimizer: x / sqrt(y) -> x * rsqrt(y)
  kReciprocalLr = 8192,   // constant folding: x / lr -> x * (1 / lr)
};
// Per-table float parameters (optimizer_rows.py computes each as
// TensorFlow rounds it: a Python expression first, then float32).
enum Param {
  kClipLowValue = 0, kClipHighValue, kDecayValue, kWeightMinValue,
  kWeightMaxValue, kA, kB, kC, kD, kE, kF, kNumParams
};

REGISTER_OP("TpuEmbedExtApplyStep")
    .Input("variables: num_variables * resource")
    .Input("ids: num_segments * int64")
    .Input("rows: num_segments * int64")
    .Input("gains: num_segments * float")
    .Input("grads: num_segments * float")
    .Input("learning_rates: float")
    .Input("status: int64")
    .Output("accepted: bool")
    .Output("gradient_ok: bool")
    .Output("update_ok: bool")
    .Attr("num_variables: int >= 1")
    .Attr("num_segments: int >= 0")
    .Attr("segment_table: list(int) >= 0")
    .Attr("segment_message: list(string) >= 0")
    .Attr("table_kind: list(int) >= 1")
    .Attr("table_mode: list(int) >= 1")
    .Attr("table_flags: list(int) >= 1")
    .Attr("table_params: list(float) >= 1")
    .Attr("check_finite: bool = true")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int num_variables;
      std::vector<int32> kinds;
      TF_RETURN_IF_ERROR(c->GetAttr("num_variables", &num_variables));
      TF_RETURN_IF_ERROR(c->GetAttr("table_kind", &kinds));
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Vector(static_cast<int64_t>(kinds.size())));
      c->set_output(2, c->Vector(num_variables));
      return absl::OkStatus();
    });

// Id -> slot (first-occurrence order); open addressing over one array of
// {key, slot, stamp} entries (one cache line per probe), cleared in O(1) by
// a generation stamp, reused across steps by each thread.
class IdMap {
 public:
  // expected: the number of ids to come; vocab: ids are in [0, vocab). A
  // small vocabulary is indexed directly (no hashing, no probing).
  void Reset(int64_t expected, int64_t vocab) {
    int64_t cap = 16;
    int bits = 4;
    while (cap < 2 * expected) { cap <<= 1; ++bits; }
    direct_ = vocab <= std::max<int64_t>(cap, int64_t{1} << 16);
    if (direct_) cap = std::max<int64_t>(vocab, 1);
    if (static_cast<int64_t>(entries_.size()) < cap) {
      entries_.assign(cap, Entry{0, 0, 0});
      generation_ = 0;
    }
    mask_ = direct_ ? ~uint64_t{0} : cap - 1;
    shift_ = 64 - bits;
    if (++generation_ == 0) {
      for (Entry& e : entries_) e.stamp = 0;
      generation_ = 1;
    }
    ids.clear();
  }

  inline uint64_t Bucket(int64_t id) const {
    if (direct_) return static_cast<uint64_t>(id);
    return ((static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> shift_) & mask_;
  }

  // Asks for id's bucket ahead of Find (the map is larger than L1).
  inline void Prefetch(int64_t id) const { __builtin_prefetch(&entries_[Bucket(id)], 1, 3); }

  // The slot of id, inserted (as the next slot) if new.
  inline int64_t Find(int64_t id) {
    uint64_t h = Bucket(id);
    while (true) {
      Entry& e = entries_[h];
      if (e.stamp != generation_) {
        e.stamp = generation_;
        e.key = id;
        e.slot = static_cast<uint32_t>(ids.size());
        ids.push_back(id);
        return e.slot;
      }
      if (e.key == id) return e.slot;
      h = (h + 1) & mask_;
    }
  }

  std::vector<int64_t> ids;  // distinct ids, by slot

 private:
  struct Entry {
    int64_t key;
    uint32_t slot;  // < 2^32 occurrences per table and step (checked)
    uint32_t stamp;
  };
  std::vector<Entry> entries_;
  uint32_t generation_ = 0;
  uint64_t mask_ = 0;
  int shift_ = 60;
  bool direct_ = false;
};

struct Segment {
  const int64_t* ids;
  int64_t n;
  const int64_t* rows;  // nullptr: occurrence i reads row i
  const float* gains;   // nullptr: gain 1
  const float* grads;   // [num_rows, dim]
};

struct Table {
  int kind, mode, flags;
  const float* p;  // kNumParams parameters
  float lr;
  int first_variable, num_variables;
  int64_t vocab, dim;
  std::vector<int> segments;
  // Scratch: touched ids, their summed gradients (or, in rounds, every
  // contribution: slot and gradient row) and the new rows of each variable.
  IdMap map;
  std::vector<float> g;
  std::vector<int64_t> order;     // rounds: slot of each contribution,
  std::vector<int64_t> position;  // its place in its round,
  std::vector<int64_t> round_of;  // its round,
  std::vector<int64_t> rounds;    // and the size of every round
  std::vector<std::vector<float>> rows;
};

// How many rows ahead the random row reads and writes prefetch.
constexpr int64_t kAhead = 8;

// Every cache line of one row of dim floats.
inline void Prefetch(const float* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  const char* end = reinterpret_cast<const char*>(row + dim);
  for (; p < end; p += 64) __builtin_prefetch(p, 0, 3);
}

// The undo log's copy of a row. The log is read back only when a step is
// rejected, so on x86 it is written with streaming stores, which bypass the
// caches: they keep the table rows the step works on cached and skip
// reading each log line before writing it (measured: the W2 Adagrad step
// 2.5% faster). dst must be 16-byte aligned; a row whose dim is not a
// multiple of 4 is copied.
inline void LogRow(const float* src, float* dst, int64_t dim) {
#if defined(__SSE2__)
  if (dim % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    for (int64_t k = 0; k < dim; k += 4) _mm_stream_ps(dst + k, _mm_loadu_ps(src + k));
    return;
  }
#endif
  std::memcpy(dst, src, dim * sizeof(float));
}

// Orders the streamed log before what follows (a Restore reads it).
inline void LogDone() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

inline bool AllFinite(const float* x, int64_t n) {
  // NaN and Inf have every exponent bit set; an integer test vectorises.
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  uint32_t bad = 0;
  for (int64_t k = 0; k < n; ++k) {
    bad |= static_cast<uint32_t>((bits[k] & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

// Gradient row gain * grads[row] (gain multiplies each element once, as
// the TF-op path's grad * gains[:, None] does).
inline void Contribution(const Segment& s, int64_t i, int64_t dim,
                         float* __restrict out) {
  const int64_t r = s.rows ? s.rows[i] : i;
  const float* __restrict src = s.grads + r * dim;
  if (s.gains) {
    const float gain = s.gains[i];
    for (int64_t k = 0; k < dim; ++k) out[k] = src[k] * gain;
  } else {
    std::memcpy(out, src, dim * sizeof(float));
  }
}

// TensorFlow's Rsqrt and Pow kernels evaluate Eigen packets over the flat
// tensor, and scalars for its last n % kTfPacket elements (Eigen's
// TensorExecutor aligns every thread's block to the packet size). The
// packet rsqrt is an approximation refined by one Newton step, the packet
// pow Eigen's generic_pow: neither equals the scalar 1 / sqrt or powf. The
// kernel computes each element as TensorFlow would, from its flat index in
// the tensor the TF-op path builds: the packet functions lane by lane (the
// lanes are independent, so any packet width that divides TensorFlow's
// gives the same values), the scalar ones for the tail. TensorFlow's x86-64
// wheels are built for AVX (8 floats), aarch64 ones for NEON (4).
#if defined(__x86_64__) || defined(_M_X64)
constexpr int64_t kTfPacket = 8;
#else
constexpr int64_t kTfPacket = 4;
#endif
using Packet = Eigen::internal::packet_traits<float>::type;
constexpr int64_t kLanes = Eigen::internal::unpacket_traits<Packet>::size;
static_assert(kTfPacket % kLanes == 0, "packet width must divide TensorFlow's");

enum Op { kRsqrt, kPow, kReciprocal };

// out[k] = rsqrt(x[k]) / pow(x[k], e) / 1 / x[k] as TensorFlow computes it;
// elements from `exact_from` on are in TensorFlow's scalar tail.
template <Op kOp>
void LikeTf(const float* x, float e, float* out, int64_t dim, int64_t exact_from) {
  using namespace Eigen::internal;  // NOLINT
  const Packet pe = pset1<Packet>(e);
  auto packet = [&pe](const Packet& px) -> Packet {
    if (kOp == kPow) return generic_pow(px, pe);
    if (kOp == kRsqrt) return prsqrt(px);
#if defined(__x86_64__) || defined(_M_X64)
    // TensorFlow's AVX build: rcp refined by one Newton step (EIGEN_FAST_MATH).
    return generic_reciprocal_newton_step<Packet, 1>::run(px, _mm_rcp_ps(px));
#else
    return preciprocal(px);
#endif
  };
  int64_t k = 0;
  for (; k + kLanes <= exact_from; k += kLanes) {
    pstoreu(out + k, packet(ploadu<Packet>(x + k)));
  }
  if (k < exact_from) {  // a partial packet: pad, compute, keep the prefix
    alignas(64) float in[kLanes], res[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) in[j] = k + j < exact_from ? x[k + j] : 1.0f;
    pstoreu(res, packet(ploadu<Packet>(in)));
    for (; k < exact_from; ++k) out[k] = res[k % kLanes];
  }
  for (; k < dim; ++k) {
    out[k] = kOp == kPow ? Eigen::numext::pow(x[k], e)
                         : (kOp == kRsqrt ? 1.0f / Eigen::numext::sqrt(x[k])
                                          : 1.0f / x[k]);
  }
}

// tf.pow(x, e): eagerly Eigen's pow; inside tf.function (kGraphPow) after
// Grappler's ConvertPow stage, which replaces a constant exponent of 2, 3,
// 0.5, -0.5 or -1 by Square, x * Square, Sqrt, Rsqrt or Reciprocal.
void PowLikeTf(const float* x, float e, float* out, int64_t dim, int64_t exact_from,
               bool graph) {
  if (graph) {
    if (e == 2.0f) {
      for (int64_t k = 0; k < dim; ++k) out[k] = x[k] * x[k];
      return;
    }
    if (e == 3.0f) {
      for (int64_t k = 0; k < dim; ++k) out[k] = x[k] * (x[k] * x[k]);
      return;
    }
    if (e == 0.5f) {
      for (int64_t k = 0; k < dim; ++k) out[k] = std::sqrt(x[k]);
      return;
    }
    if (e == -0.5f) return LikeTf<kRsqrt>(x, e, out, dim, exact_from);
    if (e == -1.0f) return LikeTf<kReciprocal>(x, e, out, dim, exact_from);
  }
  LikeTf<kPow>(x, e, out, dim, exact_from);
}

// Where a row's elements leave TensorFlow's packets: row r of an [n, dim]
// tensor.
inline int64_t ExactFrom(int64_t r, int64_t n, int64_t dim) {
  const int64_t total = n * dim;
  const int64_t cutoff = total - total % kTfPacket - r * dim;
  return std::max<int64_t>(0, std::min<int64_t>(dim, cutoff));
}


// update_rules.apply_update on one row, in place on w / s0 / s1 (copies of
// the variables' rows); g is clipped in place. Every expression follows
// update_rules.py's order of operations, in float32. exact_from: see
// ExactFrom. scratch: 3 * dim floats of the caller's.
void ApplyRow(const Table& t, float* __restrict g, float* __restrict w,
              float* __restrict s0, float* __restrict s1, int64_t exact_from,
              float* __restrict scratch) {
  const int64_t dim = t.dim;
  const float* p = t.p;
  const int f = t.flags;
  const float lr = t.lr;
  if (f & kClipLow) {  // tf.maximum(g, low): NaN stays NaN
    const float lo = p[kClipLowValue];
    for (int64_t k = 0; k < dim; ++k) g[k] = g[k] < lo ? lo : g[k];
  }
  if (f & kClipHigh) {  // tf.minimum(g, high)
    const float hi = p[kClipHighValue];
    for (int64_t k = 0; k < dim; ++k) g[k] = hi < g[k] ? hi : g[k];
  }
  if (f & kDecay) {  // w - decay * w
    const float decay = (f & kDecayTimesLr) ? p[kDecayValue] * lr : p[kDecayValue];
    for (int64_t k = 0; k < dim; ++k) w[k] = w[k] - decay * w[k];
  }
  switch (t.kind) {
    case kSGD:
      for (int64_t k = 0; k < dim; ++k) w[k] = w[k] - lr * g[k];
      break;
    case kAdagrad: {
      float* __restrict r = scratch + 0 * dim;
      for (int64_t k = 0; k < dim; ++k) s0[k] = s0[k] + g[k] * g[k];
      LikeTf<kRsqrt>(s0, 0.0f, r, dim, exact_from);
      for (int64_t k = 0; k < dim; ++k) w[k] = w[k] - lr * g[k] * r[k];
      break;
    }
    case kAdagradMomentum: {
      const float beta2 = p[kA], one_minus_beta2 = p[kB], eps = p[kC];
      const float power = p[kD], momentum = p[kE];
      float* __restrict x = scratch + 0 * dim;
      float* __restrict scaled = scratch + 1 * dim;
      if (f & kBeta2IsOne) {
        for (int64_t k = 0; k < dim; ++k) s0[k] = s0[k] + g[k] * g[k];
      } else {
        for (int64_t k = 0; k < dim; ++k)
          s0[k] = beta2 * s0[k] + one_minus_beta2 * g[k] * g[k];
      }
      for (int64_t k = 0; k < dim; ++k) x[k] = s0[k] + eps;
      PowLikeTf(x, power, scaled, dim, exact_from, f & kGraphPow);
      for (int64_t k = 0; k < dim; ++k) scaled[k] = scaled[k] * g[k];
      for (int64_t k = 0; k < dim; ++k) s1[k] = momentum * s1[k] + scaled[k];
      if (f & kNesterov) {
        for (int64_t k = 0; k < dim; ++k)
          w[k] = w[k] - lr * (momentum * s1[k] + scaled[k]);
      } else {
        for (int64_t k = 0; k < dim; ++k) w[k] = w[k] - lr * s1[k];
      }
      break;
    }
    case kAdam: {
      const float b1 = p[kA], one_minus_b1 = p[kB], b2 = p[kC];
      const float one_minus_b2 = p[kD], eps_squared = p[kE], eps = p[kF];
      const bool inside = f & kSumInsideSqrt;
      for (int64_t k = 0; k < dim; ++k) {
        s0[k] = b1 * s0[k] + one_minus_b1 * g[k];
        s1[k] = b2 * s1[k] + one_minus_b2 * g[k] * g[k];
      }
      if (inside && (f & kRsqrtMul)) {  // lr * m * rsqrt(v + eps^2)
        float* __restrict x = scratch + 0 * dim;
        float* __restrict r = scratch + 1 * dim;
        for (int64_t k = 0; k < dim; ++k) x[k] = s1[k] + eps_squared;
        LikeTf<kRsqrt>(x, 0.0f, r, dim, exact_from);
        for (int64_t k = 0; k < dim; ++k) w[k] = w[k] - lr * s0[k] * r[k];
      } else {
        for (int64_t k = 0; k < dim; ++k) {
          const float denominator =
              inside ? std::sqrt(s1[k] + eps_squared) : std::sqrt(s1[k]) + eps;
          w[k] = w[k] - lr * s0[k] / denominator;
        }
      }
      break;
    }
    case kFTRL: {
      const float power = p[kA], l1 = p[kB], l2 = p[kC], beta = p[kD];
      const float two_l2 = p[kE];
      const bool times_lr = f & kLinearTimesLr;
      const bool has_l1 = f & kL1;
      const float bound = times_lr ? lr * l1 : l1;
      const float two_lr_l2 = 2.0f * lr * l2;
      float* __restrict acc_new = scratch + 0 * dim;
      float* __restrict pow_new = scratch + 1 * dim;
      float* __restrict pow_old = scratch + 2 * dim;
      for (int64_t k = 0; k < dim; ++k) acc_new[k] = s0[k] + g[k] * g[k];
      PowLikeTf(acc_new, power, pow_new, dim, exact_from, f & kGraphPow);
      PowLikeTf(s0, power, pow_old, dim, exact_from, f & kGraphPow);
      const float inverse_lr = 1.0f / lr;  // Grappler's Reciprocal(lr)
      const bool reciprocal = f & kReciprocalLr;
      for (int64_t k = 0; k < dim; ++k) {
        const float dp = pow_new[k] - pow_old[k];
        float lin, denominator;
        if (times_lr) {
          lin = s1[k] + lr * g[k] - dp * w[k];
          denominator = pow_new[k] + two_lr_l2 + beta;
        } else {
          if (reciprocal) {
            lin = s1[k] + g[k] - (dp * inverse_lr) * w[k];
            denominator = (pow_new[k] + beta) * inverse_lr + two_l2;
          } else {
            lin = s1[k] + g[k] - (dp / lr) * w[k];
            denominator = (pow_new[k] + beta) / lr + two_l2;
          }
        }
        float numerator;
        if (has_l1) {  // tf.clip_by_value: minimum first, then maximum
          float c = bound < lin ? bound : lin;
          c = c < -bound ? -bound : c;
          numerator = c - lin;
        } else {
          numerator = -lin;
        }
        s0[k] = acc_new[k];
        s1[k] = lin;
        w[k] = numerator / denominator;
      }
      break;
    }
  }
  if (f & kWeightMin) {
    const float lo = p[kWeightMinValue];
    for (int64_t k = 0; k < dim; ++k) w[k] = w[k] < lo ? lo : w[k];
  }
  if (f & kWeightMax) {
    const float hi = p[kWeightMaxValue];
    for (int64_t k = 0; k < dim; ++k) w[k] = hi < w[k] ? hi : w[k];
  }
}

class ApplyStepOp : public OpKernel {
 public:
  explicit ApplyStepOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("num_variables", &num_variables_));
    OP_REQUIRES_OK(c, c->GetAttr("num_segments", &num_segments_));
    OP_REQUIRES_OK(c, c->GetAttr("segment_table", &segment_table_));
    OP_REQUIRES_OK(c, c->GetAttr("segment_message", &segment_message_));
    OP_REQUIRES_OK(c, c->GetAttr("table_kind", &kind_));
    OP_REQUIRES_OK(c, c->GetAttr("table_mode", &mode_));
    OP_REQUIRES_OK(c, c->GetAttr("table_flags", &flags_));
    OP_REQUIRES_OK(c, c->GetAttr("table_params", &params_));
    OP_REQUIRES_OK(c, c->GetAttr("check_finite", &check_finite_));
    const size_t t = kind_.size();
    OP_REQUIRES(c, mode_.size() == t && flags_.size() == t &&
                       params_.size() == t * kNumParams,
                errors::InvalidArgument("table attributes disagree in length"));
    OP_REQUIRES(c, static_cast<int>(segment_table_.size()) == num_segments_ &&
                       static_cast<int>(segment_message_.size()) == num_segments_,
                errors::InvalidArgument("segment attributes disagree in length"));
    int variables = 0;
    for (size_t i = 0; i < t; ++i) {
      OP_REQUIRES(c, kind_[i] >= 0 && kind_[i] < kNumKinds &&
                         mode_[i] >= kSums && mode_[i] <= kEveryRow,
                  errors::InvalidArgument("bad optimizer kind or mode"));
      variables += 1 + kNumSlots[kind_[i]];
    }
    OP_REQUIRES(c, variables == num_variables_,
                errors::InvalidArgument("num_variables does not match the tables"));
    for (int s : segment_table_) {
      OP_REQUIRES(c, s >= 0 && s < static_cast<int>(t),
                  errors::InvalidArgument("segment_table out of range"));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const int num_tables = static_cast<int>(kind_.size());
    const int nv = num_variables_, ns = num_segments_;
    // Inputs: variables [0, nv), ids, rows, gains, grads, lr, status.
    const int ids_at = nv, rows_at = nv + ns, gains_at = nv + 2 * ns;
    const int grads_at = nv + 3 * ns, lr_at = nv + 4 * ns, status_at = lr_at + 1;

    const Tensor& lr_t = ctx->input(lr_at);
    OP_REQUIRES(ctx, lr_t.dims() == 1 && lr_t.dim_size(0) == num_tables,
                errors::InvalidArgument("learning_rates must be [num_tables]"));
    // The lookup's id check (one row per replica: ok, kind, index, value).
    const Tensor& status_t = ctx->input(status_at);
    OP_REQUIRES(ctx, status_t.dims() == 2 && status_t.dim_size(1) == 4,
                errors::InvalidArgument("status must be [replicas, 4]"));
    const auto status = status_t.matrix<int64_t>();
    for (int64_t r = 0; r < status_t.dim_size(0); ++r) {
      OP_REQUIRES(ctx, status(r, 0) > 0,
                  errors::InvalidArgument(
                      "the step's id check failed (kind ", status(r, 1),
                      ", feature ", status(r, 2), ", id ", status(r, 3),
                      "); no table, slot or step was changed."));
    }

    std::vector<core::RefCountPtr<Var>> vars(nv);
    for (int v = 0; v < nv; ++v) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, v), &vars[v]));
      OP_REQUIRES_OK(ctx, EnsureSparseVariableAccess<CPUDevice, float>(ctx, vars[v].get()));
    }
    // Exclusive locks on every variable of the step, in address order.
    std::vector<mutex*> mutexes;
    for (auto& v : vars) mutexes.push_back(v->mu());
    std::sort(mutexes.begin(), mutexes.end());
    mutexes.erase(std::unique(mutexes.begin(), mutexes.end()), mutexes.end());
    std::vector<std::unique_ptr<mutex_lock>> locks;
    for (mutex* m : mutexes) locks.push_back(std::make_unique<mutex_lock>(*m));

    std::vector<Table>& tables = Tables(num_tables);
    int next_variable = 0;
    for (int i = 0; i < num_tables; ++i) {
      Table& t = tables[i];
      t.kind = kind_[i];
      t.mode = mode_[i];
      t.flags = flags_[i];
      t.p = params_.data() + i * kNumParams;
      t.lr = lr_t.flat<float>()(i);
      t.first_variable = next_variable;
      t.num_variables = 1 + kNumSlots[t.kind];
      next_variable += t.num_variables;
      t.segments.clear();
      const Tensor* w = vars[t.first_variable]->tensor();
      OP_REQUIRES(ctx, w->dtype() == DT_FLOAT && w->dims() == 2,
                  errors::InvalidArgument("table ", i, ": parameters must be a "
                                          "float32 matrix"));
      t.vocab = w->dim_size(0);
      t.dim = w->dim_size(1);
      for (int j = 0; j < t.num_variables; ++j) {  // a buffer new since build
        const Tensor* v = vars[t.first_variable + j]->tensor();
        tpu_embed_ext::UseHugePages(v->tensor_data().data(), v->TotalBytes());
      }
      for (int j = 1; j < t.num_variables; ++j) {
        const Tensor* s = vars[t.first_variable + j]->tensor();
        OP_REQUIRES(ctx, s->dtype() == DT_FLOAT && s->shape() == w->shape(),
                    errors::InvalidArgument("table ", i, ": slot ", j,
                                            " differs from the parameters' shape"));
      }
    }

    // Segments: shapes, ids in range.
    std::vector<Segment> segments(ns);
    for (int s = 0; s < ns; ++s) {
      Table& t = tables[segment_table_[s]];
      const Tensor& ids = ctx->input(ids_at + s);
      const Tensor& rows = ctx->input(rows_at + s);
      const Tensor& gains = ctx->input(gains_at + s);
      const Tensor& grads = ctx->input(grads_at + s);
      Segment& seg = segments[s];
      seg.ids = ids.flat<int64_t>().data();
      seg.n = ids.NumElements();
      seg.rows = rows.NumElements() ? rows.flat<int64_t>().data() : nullptr;
      seg.gains = gains.NumElements() ? gains.flat<float>().data() : nullptr;
      seg.grads = grads.flat<float>().data();
      OP_REQUIRES(ctx, grads.dims() == 2 && grads.dim_size(1) == t.dim,
                  errors::InvalidArgument("segment ", s, ": grads must be [rows, ",
                                          t.dim, "]"));
      OP_REQUIRES(ctx, (!seg.rows || rows.NumElements() == seg.n) &&
                           (!seg.gains || gains.NumElements() == seg.n),
                  errors::InvalidArgument("segment ", s, ": rows and gains must "
                                          "be empty or one per id"));
      const int64_t num_rows = grads.dim_size(0);
      OP_REQUIRES(ctx, seg.n == 0 || seg.rows || num_rows == seg.n,
                  errors::InvalidArgument("segment ", s, ": one gradient row per id"));
      for (int64_t i = 0; i < seg.n; ++i) {
        const int64_t id = seg.ids[i];
        if (id < 0 || id >= t.vocab) {
          std::string message = segment_message_[s];
          const size_t at = message.find("{id}");
          if (at != std::string::npos) message.replace(at, 4, std::to_string(id));
          ctx->CtxFailure(errors::InvalidArgument(message));
          return;
        }
        if (seg.rows) {
          OP_REQUIRES(ctx, seg.rows[i] >= 0 && seg.rows[i] < num_rows,
                      errors::InvalidArgument("segment ", s, ": row ", seg.rows[i],
                                              " out of range [0, ", num_rows, ")"));
        }
      }
      t.segments.push_back(s);
    }
    for (int i = 0; i < num_tables; ++i) {  // IdMap's 32-bit slots
      int64_t n = 0;
      for (int s : tables[i].segments) n += segments[s].n;
      OP_REQUIRES(ctx, n < (int64_t{1} << 32),
                  errors::InvalidArgument("table ", i, ": ", n, " ids in one "
                                          "step; at most 2^32 - 1 are supported"));
    }

    Tensor *accepted_t, *gradient_ok_t, *update_ok_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &accepted_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({num_tables}), &gradient_ok_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nv}), &update_ok_t));
    auto gradient_ok = gradient_ok_t->flat<bool>();
    auto update_ok = update_ok_t->flat<bool>();
    for (int i = 0; i < num_tables; ++i) gradient_ok(i) = true;
    for (int v = 0; v < nv; ++v) update_ok(v) = true;
    accepted_t->scalar<bool>()() = false;

    // Tables are independent until the commit: phases 1 and 2 run them on
    // TensorFlow's intra-op threads (each table has its own scratch; the
    // per-row buffers are per thread).
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    auto for_each_table = [&](const std::function<void(int)>& fn) {
      int64_t cost = 0;
      for (const Segment& seg : segments) cost += seg.n;
      cost = 1 + 40 * cost / std::max(1, num_tables);
      pool->ParallelFor(num_tables, cost, [&fn](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) fn(static_cast<int>(i));
      });
    };
    // 1. What each table applies; every gradient checked before any update.
    std::vector<char> finite_gradient(num_tables), finite_update(nv);
    for_each_table([&](int i) { finite_gradient[i] = Gather(&tables[i], segments); });
    bool ok = true;
    for (int i = 0; i < num_tables; ++i) {
      gradient_ok(i) = finite_gradient[i] || !check_finite_;
      ok = ok && gradient_ok(i);
    }
    if (!ok) return;
    // 2. The new rows of every table: tables without gradient accumulation
    // and non-lazy Adam into scratch; the others (one update per touched
    // row) in place, their old rows kept to be put back if the step fails.
    // Nothing outside this op can see the variables meanwhile: it holds
    // every variable's exclusive lock until it returns.
    for_each_table([&](int i) {
      Table& t = tables[i];
      std::vector<bool> finite(t.num_variables, true);
      Update(&t, vars, &finite);
      for (int j = 0; j < t.num_variables; ++j) finite_update[t.first_variable + j] = finite[j];
    });
    for (int v = 0; v < nv; ++v) {
      update_ok(v) = finite_update[v] || !check_finite_;
      ok = ok && update_ok(v);
    }
    if (!ok) {
      for (int i = 0; i < num_tables; ++i) {
        if (tables[i].mode == kSums) Restore(&tables[i], vars);
      }
      return;
    }
    // 3. Commit the scratch rows.
    for (int i = 0; i < num_tables; ++i) {
      Table& t = tables[i];
      if (t.mode == kSums) continue;  // already in place
      for (int j = 0; j < t.num_variables; ++j) {
        Var* var = vars[t.first_variable + j].get();
        // In place, as TensorFlow's sparse-apply kernels write: the variable
        // is in copy-on-read mode (EnsureSparseVariableAccess above), so
        // readers copy and this buffer is ours under the exclusive lock.
        // PrepareToUpdateVariable would copy the whole table every step.
        float* dst = var->tensor()->flat<float>().data();
        const float* src = t.rows[j].data();
        if (t.mode == kEveryRow) {
          std::memcpy(dst, src, t.vocab * t.dim * sizeof(float));
          continue;
        }
        const int64_t u = static_cast<int64_t>(t.map.ids.size());
        const int64_t* ids = t.map.ids.data();
        for (int64_t r = 0; r < u; ++r) {
          if (r + kAhead < u) Prefetch(dst + ids[r + kAhead] * t.dim, t.dim);
          std::memcpy(dst + ids[r] * t.dim, src + r * t.dim,
                      t.dim * sizeof(float));
        }
      }
    }
    accepted_t->scalar<bool>()() = true;
  }

 private:
  // Per thread (ops of concurrent steps run on different threads): scratch
  // tables reused across steps, so a step allocates nothing once warm.
  static std::vector<Table>& Tables(int n) {
    static thread_local std::vector<Table> tables;
    if (static_cast<int>(tables.size()) < n) tables.resize(n);
    return tables;
  }

  // Distinct ids and per-id sums (SUMS), every contribution (ROUNDS) or
  // per-row sums over the whole table (EVERY_ROW). Returns whether what the
  // rule will be applied to is finite (the TF-op path checks the same
  // tensor: Update.grads).
  bool Gather(Table* t, const std::vector<Segment>& segments) {
    const int64_t dim = t->dim;
    int64_t n = 0;
    for (int s : t->segments) n += segments[s].n;
    if (t->mode == kEveryRow) {
      t->map.ids.clear();
      t->g.assign(t->vocab * dim, 0.0f);
      std::vector<float> row(dim);
      for (int s : t->segments) {
        const Segment& seg = segments[s];
        for (int64_t i = 0; i < seg.n; ++i) {
          Contribution(seg, i, dim, row.data());
          float* __restrict dst = t->g.data() + seg.ids[i] * dim;
          for (int64_t k = 0; k < dim; ++k) dst[k] += row[k];
        }
      }
      return AllFinite(t->g.data(), t->vocab * dim);
    }
    t->map.Reset(n, t->vocab);
    if (t->mode == kRounds) {
      // Every contribution, in input order, with the slot of its id.
      t->g.resize(n * dim);
      t->order.resize(n);
      int64_t c = 0;
      for (int s : t->segments) {
        const Segment& seg = segments[s];
        for (int64_t i = 0; i < seg.n; ++i, ++c) {
          t->order[c] = t->map.Find(seg.ids[i]);
          Contribution(seg, i, dim, t->g.data() + c * dim);
        }
      }
      return AllFinite(t->g.data(), n * dim);
    }
    // Sums start at +0 and add each contribution in input order, as
    // unsorted_segment_sum does (so -0 + -0 sums to +0 there and here); a
    // contribution is gain * grad rounded to float32 first, as the TF-op
    // path's grad * gains[:, None] (built with -ffp-contract=off).
    t->g.resize(n * dim);
    float* const sums = t->g.data();
    for (int s : t->segments) {
      const Segment& seg = segments[s];
      for (int64_t i = 0; i < seg.n; ++i) {
        if (i + 16 < seg.n) t->map.Prefetch(seg.ids[i + 16]);
        const int64_t before = static_cast<int64_t>(t->map.ids.size());
        const int64_t slot = t->map.Find(seg.ids[i]);
        float* __restrict dst = sums + slot * dim;
        const float* __restrict src = seg.grads + (seg.rows ? seg.rows[i] : i) * dim;
        if (slot == before) {
          if (seg.gains) {
            const float gain = seg.gains[i];
            for (int64_t k = 0; k < dim; ++k) dst[k] = 0.0f + src[k] * gain;
          } else {
            for (int64_t k = 0; k < dim; ++k) dst[k] = 0.0f + src[k];
          }
        } else if (seg.gains) {
          const float gain = seg.gains[i];
          for (int64_t k = 0; k < dim; ++k) dst[k] += src[k] * gain;
        } else {
          for (int64_t k = 0; k < dim; ++k) dst[k] += src[k];
        }
      }
    }
    const int64_t u = static_cast<int64_t>(t->map.ids.size());
    return AllFinite(t->g.data(), u * dim);
  }

  // New rows of every variable of the table: ROUNDS and EVERY_ROW into
  // t->rows (copies of the touched rows, updated there; step 3 commits
  // them), SUMS in the variables themselves with t->rows as the undo log
  // (UpdateInPlace); finite[j]: variable j's new rows are finite.
  void Update(Table* t, const std::vector<core::RefCountPtr<Var>>& vars,
              std::vector<bool>* finite) {
    if (t->mode == kSums) return UpdateInPlace(t, vars, finite);
    const int64_t dim = t->dim;
    const bool every_row = t->mode == kEveryRow;
    const int64_t u = every_row ? t->vocab : static_cast<int64_t>(t->map.ids.size());
    t->rows.resize(t->num_variables);
    for (int j = 0; j < t->num_variables; ++j) {
      const float* src = vars[t->first_variable + j]->tensor()->flat<float>().data();
      std::vector<float>& dst = t->rows[j];
      dst.resize(u * dim);
      if (every_row) {
        std::memcpy(dst.data(), src, u * dim * sizeof(float));
      } else {
        const int64_t* ids = t->map.ids.data();
        for (int64_t r = 0; r < u; ++r) {
          if (r + kAhead < u) Prefetch(src + ids[r + kAhead] * dim, dim);
          std::memcpy(dst.data() + r * dim, src + ids[r] * dim,
                      dim * sizeof(float));
        }
      }
    }
    float* w = t->rows[0].data();
    float* s0 = t->num_variables > 1 ? t->rows[1].data() : nullptr;
    float* s1 = t->num_variables > 2 ? t->rows[2].data() : nullptr;
    auto at = [dim](float* base, int64_t r) { return base ? base + r * dim : nullptr; };
    std::vector<float> scratch(3 * dim);
    if (t->mode == kRounds) {
      // Round k of updates._in_rounds applies the k-th contribution of every
      // id, as an [ids with a k-th contribution, dim] tensor in input order;
      // applying all contributions in input order gives each id the same
      // sequence of updates.
      const int64_t n = static_cast<int64_t>(t->order.size());
      t->rounds.clear();
      t->position.resize(n);
      t->round_of.resize(n);
      std::vector<int64_t> seen(u, 0);
      for (int64_t c = 0; c < n; ++c) {
        const int64_t k = seen[t->order[c]]++;
        if (k == static_cast<int64_t>(t->rounds.size())) t->rounds.push_back(0);
        t->round_of[c] = k;
        t->position[c] = t->rounds[k]++;
      }
      for (int64_t c = 0; c < n; ++c) {
        const int64_t r = t->order[c];
        ApplyRow(*t, t->g.data() + c * dim, at(w, r), at(s0, r), at(s1, r),
                 ExactFrom(t->position[c], t->rounds[t->round_of[c]], dim),
                 scratch.data());
      }
    } else {
      for (int64_t r = 0; r < u; ++r) {
        ApplyRow(*t, t->g.data() + r * dim, at(w, r), at(s0, r), at(s1, r),
                 ExactFrom(r, u, dim), scratch.data());
      }
    }
    for (int j = 0; j < t->num_variables; ++j) {
      (*finite)[j] = AllFinite(t->rows[j].data(), u * dim);
    }
  }

  // SUMS: every touched row once, updated in place in the variables (each
  // row is read from memory once, the step's one random access per row),
  // after its old values went to t->rows (the undo log, see Restore); each
  // new row is checked while it is in cache.
  void UpdateInPlace(Table* t, const std::vector<core::RefCountPtr<Var>>& vars,
                     std::vector<bool>* finite) {
    const int64_t dim = t->dim;
    const int nv = t->num_variables;
    const int64_t u = static_cast<int64_t>(t->map.ids.size());
    const int64_t* ids = t->map.ids.data();
    float* var[3] = {nullptr, nullptr, nullptr};
    float* log[3] = {nullptr, nullptr, nullptr};
    t->rows.resize(nv);
    for (int j = 0; j < nv; ++j) {
      var[j] = vars[t->first_variable + j]->tensor()->flat<float>().data();
      t->rows[j].resize(u * dim);
      log[j] = t->rows[j].data();
    }
    std::vector<float> scratch(3 * dim);
    bool bad[3] = {false, false, false};
    for (int64_t r = 0; r < u; ++r) {
      if (r + kAhead < u) {
        for (int j = 0; j < nv; ++j) Prefetch(var[j] + ids[r + kAhead] * dim, dim);
      }
      float* row[3] = {nullptr, nullptr, nullptr};
      for (int j = 0; j < nv; ++j) {
        row[j] = var[j] + ids[r] * dim;
        LogRow(row[j], log[j] + r * dim, dim);
      }
      ApplyRow(*t, t->g.data() + r * dim, row[0], row[1], row[2],
               ExactFrom(r, u, dim), scratch.data());
      for (int j = 0; j < nv; ++j) bad[j] = bad[j] || !AllFinite(row[j], dim);
    }
    LogDone();
    for (int j = 0; j < nv; ++j) (*finite)[j] = !bad[j];
  }

  // Puts back the rows UpdateInPlace changed (a rejected step).
  static void Restore(Table* t, const std::vector<core::RefCountPtr<Var>>& vars) {
    const int64_t dim = t->dim;
    const int64_t u = static_cast<int64_t>(t->map.ids.size());
    for (int j = 0; j < t->num_variables; ++j) {
      float* var = vars[t->first_variable + j]->tensor()->flat<float>().data();
      const float* log = t->rows[j].data();
      for (int64_t r = 0; r < u; ++r) {
        std::memcpy(var + t->map.ids[r] * dim, log + r * dim, dim * sizeof(float));
      }
    }
  }

  int num_variables_, num_segments_;
  std::vector<int32> segment_table_;
  std::vector<std::string> segment_message_;
  std::vector<int32> kind_, mode_, flags_;
  std::vector<float> params_;
  bool check_finite_;
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbedExtApplyStep").Device(DEVICE_CPU),
                        ApplyStepOp);

}  // namespace
}  // namespace tensorflow
