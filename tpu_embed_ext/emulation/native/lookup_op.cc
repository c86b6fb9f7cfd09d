// TpuEmbedExtLookup: one feature's activations in one pass over its table.
//
// The engine reduces every input kind to occurrences (lookups.py): occurrence
// i sends gains[i] * Q(E[ids[i]]) to output row rows[i], where Q is the
// table's simulated quantization (or the identity). This op computes
//
//   out[r] = 0 + sum over i with rows[i] == r, in input order, of
//            Q(E[ids[i]]) * gains[i]
//
// with the same float32 operations in the same order as the TF-op path
// (gather, quantize, multiply, unsorted_segment_sum), so results are
// bit-identical. `segmented` false: `rows` is ignored and out[i] =
// Q(E[ids[i]]) (dense ids: row i is id i); empty `gains` means all ones.
//
// The table is read in place (no copy of the variable) under a shared lock,
// as TensorFlow's ResourceGather does. Output rows are split across the
// device's threads by row range; every thread scans the occurrences in input
// order, so the sum order per row never depends on the thread count.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tpu_embed_ext {
void UseHugePages(const void* data, std::size_t bytes,  // huge_pages.cc
                  bool again = false);
}  // namespace tpu_embed_ext

namespace tensorflow {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;

REGISTER_OP("TpuEmbedExtLookup")
    .Input("params: resource")
    .Input("ids: int64")
    .Input("rows: int64")
    .Input("gains: float")
    .Input("num_rows: int64")
    .Output("activations: float")
    .Attr("dim: int >= 1")
    .Attr("segmented: bool = true")
    .Attr("quantize: bool = false")
    .Attr("q_lower: float = 0")
    .Attr("q_upper: float = 0")
    .Attr("q_quantum: float = 1")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      shape_inference::DimensionHandle rows;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(4, &rows));
      c->set_output(0, c->Matrix(rows, dim));
      return absl::OkStatus();
    })
    .Doc("Fused gather + combiner of one feature (tpu_embed_ext lookups).");

struct Quantizer {
  bool on = false;
  float lower = 0, upper = 0, quantum = 1;

  // lookups._quantize: clip, snap to the nearest bucket, then the
  // straight-through form rows + (q - rows), each step rounded to float32.
  inline float operator()(float x) const {
    const float c = std::max(std::min(x, upper), lower);
    const float q = std::floor((c - lower) / quantum + 0.5f) * quantum + lower;
    return x + (q - x);
  }
};

class LookupOp : public OpKernel {
 public:
  explicit LookupOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(c, c->GetAttr("segmented", &segmented_));
    OP_REQUIRES_OK(c, c->GetAttr("quantize", &quant_.on));
    OP_REQUIRES_OK(c, c->GetAttr("q_lower", &quant_.lower));
    OP_REQUIRES_OK(c, c->GetAttr("q_upper", &quant_.upper));
    OP_REQUIRES_OK(c, c->GetAttr("q_quantum", &quant_.quantum));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids_t = ctx->input(1);
    const Tensor& rows_t = ctx->input(2);
    const Tensor& gains_t = ctx->input(3);
    const Tensor& num_rows_t = ctx->input(4);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids_t.shape()),
                errors::InvalidArgument("ids must be a vector, got ",
                                        ids_t.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(num_rows_t.shape()),
                errors::InvalidArgument("num_rows must be a scalar"));
    const int64_t n = ids_t.NumElements();
    const bool identity = !segmented_;
    const int64_t num_rows = num_rows_t.scalar<int64_t>()();
    OP_REQUIRES(ctx, identity || rows_t.NumElements() == n,
                errors::InvalidArgument("rows must match ids: ",
                                        rows_t.NumElements(), " vs ", n));
    OP_REQUIRES(ctx, gains_t.NumElements() == 0 || gains_t.NumElements() == n,
                errors::InvalidArgument("gains must be empty or match ids: ",
                                        gains_t.NumElements(), " vs ", n));
    OP_REQUIRES(ctx, !identity || num_rows == n,
                errors::InvalidArgument("without rows, num_rows (", num_rows,
                                        ") must equal the number of ids (", n,
                                        ")"));
    OP_REQUIRES(ctx, num_rows >= 0,
                errors::InvalidArgument("num_rows must be >= 0, got ", num_rows));
    const int64_t* ids = ids_t.flat<int64_t>().data();
    const int64_t* rows = identity ? nullptr : rows_t.flat<int64_t>().data();
    const float* gains =
        gains_t.NumElements() ? gains_t.flat<float>().data() : nullptr;
    for (int64_t i = 0; rows != nullptr && i < n; ++i) {
      OP_REQUIRES(ctx, rows[i] >= 0 && rows[i] < num_rows,
                  errors::InvalidArgument("rows[", i, "] = ", rows[i],
                                          " is not in [0, ", num_rows, ")"));
    }

    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    OP_REQUIRES_OK(ctx,
                   EnsureSparseVariableAccess<CPUDevice, float>(ctx, var.get()));
    // Held for the whole op rather than copying the (large) table.
    tf_shared_lock lock(*var->mu());
    const Tensor* table_t = var->tensor();
    OP_REQUIRES(ctx, table_t->dtype() == DT_FLOAT && table_t->dims() == 2 &&
                         table_t->dim_size(1) == dim_,
                errors::InvalidArgument("the table must be float32 [vocab, ",
                                        dim_, "], got ",
                                        table_t->shape().DebugString()));
    const int64_t vocab = table_t->dim_size(0);
    // A buffer new since build (a restore): on huge pages from now on.
    tpu_embed_ext::UseHugePages(table_t->tensor_data().data(), table_t->TotalBytes());
    // The message of TensorFlow's gather, which the TF-op path raises.
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, ids[i] >= 0 && ids[i] < vocab,
                  errors::InvalidArgument("indices[", i, "] = ", ids[i],
                                          " is not in [0, ", vocab, ")"));
    }

    Tensor* out_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num_rows, dim_}),
                                             &out_t));
    const float* table = table_t->flat<float>().data();
    float* out = out_t->flat<float>().data();
    const int64_t dim = dim_;
    const Quantizer quant = quant_;

    // Rows of large tables miss the caches: each loop asks for the row
    // kAhead occurrences on while it works on this one.
    constexpr int64_t kAhead = 8;
    auto prefetch = [table, dim](int64_t id) {
      const char* p = reinterpret_cast<const char*>(table + id * dim);
      for (int64_t b = 0; b < dim * 4; b += 64) __builtin_prefetch(p + b, 0, 1);
    };
    // Ragged and sparse ids come with their rows in order: then the
    // occurrences of output rows [begin, end) are one run, found by binary
    // search (otherwise every thread scans them all). The sum order per row
    // is input order either way.
    bool sorted = true;
    for (int64_t i = 1; rows != nullptr && i < n && sorted; ++i) {
      sorted = rows[i - 1] <= rows[i];
    }
    // Output rows [begin, end): each thread owns a range.
    auto work = [&](int64_t begin, int64_t end) {
      if (identity) {
        for (int64_t i = begin; i < end; ++i) {
          const float* __restrict src = table + ids[i] * dim;
          float* __restrict dst = out + i * dim;
          if (i + kAhead < end) prefetch(ids[i + kAhead]);
          if (quant.on) {
            for (int64_t k = 0; k < dim; ++k) dst[k] = quant(src[k]);
            if (gains) for (int64_t k = 0; k < dim; ++k) dst[k] *= gains[i];
          } else if (gains) {
            for (int64_t k = 0; k < dim; ++k) dst[k] = src[k] * gains[i];
          } else {
            std::memcpy(dst, src, dim * sizeof(float));
          }
        }
        return;
      }
      std::memset(out + begin * dim, 0, (end - begin) * dim * sizeof(float));
      int64_t first = 0, last = n;
      if (sorted) {
        first = std::lower_bound(rows, rows + n, begin) - rows;
        last = std::lower_bound(rows + first, rows + n, end) - rows;
      }
      for (int64_t i = first; i < last; ++i) {
        const int64_t r = rows[i];
        if (r < begin || r >= end) continue;
        if (i + kAhead < last) prefetch(ids[i + kAhead]);
        const float* __restrict src = table + ids[i] * dim;
        float* __restrict dst = out + r * dim;
        const float g = gains ? gains[i] : 1.0f;
        if (quant.on) {
          for (int64_t k = 0; k < dim; ++k) {
            const float v = quant(src[k]);
            dst[k] += gains ? v * g : v;
          }
        } else if (gains) {
          for (int64_t k = 0; k < dim; ++k) dst[k] += src[k] * g;
        } else {
          for (int64_t k = 0; k < dim; ++k) dst[k] += src[k];
        }
      }
    };
    const auto& workers = *ctx->device()->tensorflow_cpu_worker_threads();
    // Cost of one output row: its share of the occurrences' row reads.
    const int64_t per_row =
        dim * (num_rows > 0 ? std::max<int64_t>(1, n / num_rows) : 1) * 4;
    // Any feature of 65,536 floats or more is split across the intra-op
    // threads, as TensorFlow's own kernels are. Run whole on the executor's
    // thread, a large lookup held a core for its full length, and any op
    // beside it that had split its work (the loss's multiplies) waited for
    // it: on W2 such a multiply took 1-1.5 ms instead of 0.1 ms, and the
    // Adagrad step was 7% slower. Tiny features run whole.
    if (n * dim < (int64_t{1} << 16)) {
      work(0, num_rows);
    } else {
      Shard(workers.num_threads, workers.workers, num_rows, per_row, work);
    }
  }

 private:
  int dim_;
  bool segmented_;
  Quantizer quant_;
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbedExtLookup").Device(DEVICE_CPU), LookupOp);

}  // namespace
}  // namespace tensorflow

// TpuEmbedExtRaggedGains: the occurrence form of one ragged feature, what
// lookups._ragged / _combined compute with TensorFlow ops: the output row
// of every id (value_rowids) and the combiner's gain per id, with the same
// float32 operations in the same order (per-row sums start at 0 and add in
// input order, as unsorted_segment_sum; divide_no_nan; sqrt), so the
// same bits. combiner: 0 sum (gains = the weights), 1 mean, 2 sqrtn.
namespace tensorflow {
namespace {

// The combiner's gain of each of n ids whose output rows are rows[i] (each
// in [0, num_rows)), weights w (nullptr: all 1): per-row sums start at 0 and
// add in input order (as unsorted_segment_sum), then sqrt (sqrtn), then
// w / sum or 0 (divide_no_nan). Both gain ops use it.
void CombinerGains(const int64_t* rows, const float* w, int64_t n,
                   int64_t num_rows, int combiner, float* gains) {
  if (combiner == 0) {  // sum: the weights (the caller has some)
    std::copy(w, w + n, gains);
    return;
  }
  std::vector<float> totals(num_rows, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float x = w ? w[i] : 1.0f;
    totals[rows[i]] += combiner == 2 ? x * x : x;
  }
  if (combiner == 2) {
    for (float& total : totals) total = std::sqrt(total);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float x = w ? w[i] : 1.0f;
    const float total = totals[rows[i]];
    gains[i] = total == 0.0f ? 0.0f : x / total;  // divide_no_nan
  }
}

REGISTER_OP("TpuEmbedExtRaggedGains")
    .Input("row_splits: int64")
    .Input("weights: float")
    .Output("rows: int64")
    .Output("gains: float")
    .Attr("combiner: int")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(shape_inference::InferenceContext::kUnknownDim));
      c->set_output(1, c->Vector(shape_inference::InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc("value_rowids and combiner gains of a ragged feature (tpu_embed_ext).");

class RaggedGainsOp : public OpKernel {
 public:
  explicit RaggedGainsOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("combiner", &combiner_));
    OP_REQUIRES(c, combiner_ >= 0 && combiner_ <= 2,
                errors::InvalidArgument("combiner must be 0, 1 or 2"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& splits_t = ctx->input(0);
    const Tensor& weights_t = ctx->input(1);
    OP_REQUIRES(ctx, splits_t.dims() == 1 && splits_t.NumElements() >= 1,
                errors::InvalidArgument("row_splits must be a non-empty vector"));
    const int64_t* splits = splits_t.flat<int64_t>().data();
    const int64_t batch = splits_t.NumElements() - 1;
    const int64_t n = splits[batch];
    OP_REQUIRES(ctx, splits[0] == 0,
                errors::InvalidArgument("row_splits must start at 0"));
    for (int64_t r = 0; r < batch; ++r) {
      OP_REQUIRES(ctx, splits[r] <= splits[r + 1],
                  errors::InvalidArgument("row_splits must not decrease"));
    }
    const bool weighted = weights_t.NumElements() > 0;
    OP_REQUIRES(ctx, !weighted || weights_t.NumElements() == n,
                errors::InvalidArgument("weights must be empty or one per id: ",
                                        weights_t.NumElements(), " vs ", n));
    Tensor *rows_t, *gains_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &rows_t));
    const bool ones = combiner_ == 0 && !weighted;  // gains of 1: none
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({ones ? 0 : n}),
                                             &gains_t));
    int64_t* rows = rows_t->flat<int64_t>().data();
    float* gains = gains_t->flat<float>().data();
    const float* w = weighted ? weights_t.flat<float>().data() : nullptr;
    for (int64_t r = 0; r < batch; ++r) {
      for (int64_t i = splits[r]; i < splits[r + 1]; ++i) rows[i] = r;
    }
    if (!ones) CombinerGains(rows, w, n, batch, combiner_, gains);
  }

 private:
  int combiner_;
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbedExtRaggedGains").Device(DEVICE_CPU),
                        RaggedGainsOp);

}  // namespace
}  // namespace tensorflow

// TpuEmbedExtSegmentGains: the combiner's gain per id of a feature whose
// output row per id is given (a SparseTensor's row-major outer index), what
// lookups._combined computes with TensorFlow ops (CombinerGains, as
// TpuEmbedExtRaggedGains), so the same bits. Rows need not be sorted. combiner: 0 sum, 1 mean,
// 2 sqrtn; a sum without weights has no gains (an empty output: all ones).
namespace tensorflow {
namespace {

REGISTER_OP("TpuEmbedExtSegmentGains")
    .Input("rows: int64")
    .Input("weights: float")
    .Input("num_rows: int64")
    .Output("gains: float")
    .Attr("combiner: int")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(shape_inference::InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc("combiner gains of a feature from each id's output row (tpu_embed_ext).");

class SegmentGainsOp : public OpKernel {
 public:
  explicit SegmentGainsOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("combiner", &combiner_));
    OP_REQUIRES(c, combiner_ >= 0 && combiner_ <= 2,
                errors::InvalidArgument("combiner must be 0, 1 or 2"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows_t = ctx->input(0);
    const Tensor& weights_t = ctx->input(1);
    const Tensor& num_rows_t = ctx->input(2);
    OP_REQUIRES(ctx, rows_t.dims() == 1,
                errors::InvalidArgument("rows must be a vector"));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(num_rows_t.shape()),
                errors::InvalidArgument("num_rows must be a scalar"));
    const int64_t n = rows_t.NumElements();
    const int64_t num_rows = num_rows_t.scalar<int64_t>()();
    OP_REQUIRES(ctx, num_rows >= 0,
                errors::InvalidArgument("num_rows must not be negative"));
    const int64_t* rows = rows_t.flat<int64_t>().data();
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, rows[i] >= 0 && rows[i] < num_rows,
                  errors::InvalidArgument("rows[", i, "] = ", rows[i],
                                          " is out of range [0, ", num_rows, ")"));
    }
    const bool weighted = weights_t.NumElements() > 0;
    OP_REQUIRES(ctx, !weighted || weights_t.NumElements() == n,
                errors::InvalidArgument("weights must be empty or one per id: ",
                                        weights_t.NumElements(), " vs ", n));
    const bool ones = combiner_ == 0 && !weighted;
    Tensor* gains_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({ones ? 0 : n}),
                                             &gains_t));
    if (ones) return;
    CombinerGains(rows, weighted ? weights_t.flat<float>().data() : nullptr, n,
                  num_rows, combiner_, gains_t->flat<float>().data());
  }

 private:
  int combiner_;
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbedExtSegmentGains").Device(DEVICE_CPU),
                        SegmentGainsOp);

}  // namespace
}  // namespace tensorflow
