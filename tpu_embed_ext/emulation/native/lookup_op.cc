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

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/util/work_sharder.h"

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

    // Output rows [begin, end): each thread owns a range.
    auto work = [&](int64_t begin, int64_t end) {
      if (identity) {
        for (int64_t i = begin; i < end; ++i) {
          const float* __restrict src = table + ids[i] * dim;
          float* __restrict dst = out + i * dim;
          if (i + 4 < end) __builtin_prefetch(table + ids[i + 4] * dim);
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
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = rows[i];
        if (r < begin || r >= end) continue;
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
    Shard(workers.num_threads, workers.workers, num_rows, per_row, work);
  }

 private:
  int dim_;
  bool segmented_;
  Quantizer quant_;
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbedExtLookup").Device(DEVICE_CPU), LookupOp);

}  // namespace
}  // namespace tensorflow
