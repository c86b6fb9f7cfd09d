// Large tables on 2 MiB pages (Linux transparent huge pages).
//
// The engine reads and writes tables at random rows. On 4 KiB pages nearly
// every row of a large table costs a TLB miss and a page walk (a nested one
// under a hypervisor); on 2 MiB pages most of the walks go. Measured on this
// project's 2-core VM: the random read-modify-write of 1,200 rows of a
// [500000, 64] table and its accumulator took 112 us on 4 KiB pages and
// 65 us on 2 MiB pages; the W2 Adagrad step got 13% faster.
//
// TensorFlow allocates the variables. UseHugePages asks the kernel to back
// one buffer of 8 MiB or more with huge pages: MADV_HUGEPAGE for the pages
// to come, then MADV_COLLAPSE for the ones already there (Linux 6.1+; it
// copies them, once). Both are hints: the contents never change, and where
// huge pages are off ("never"), unavailable or unsupported, nothing happens.
// The engine calls TpuEmbedExtUseHugePages on its variables when it builds
// them (native/__init__.py); that call always asks. The lookup and update
// ops call it on every buffer they use, for buffers replaced since (a
// restore); they ask once per address range, so a new buffer at a range
// seen before (freed, then allocated again) is not asked for there.
// TPU_EMBED_EXT_HUGE_PAGES=0 in the environment turns it off.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace tpu_embed_ext {
namespace {

bool HugePagesWanted() {
  const char* value = std::getenv("TPU_EMBED_EXT_HUGE_PAGES");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

}  // namespace

void UseHugePages(const void* data, std::size_t bytes, bool again) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  if (bytes < 4 * kHuge) return;  // a small table stays in the caches
  const std::uintptr_t start = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t begin = (start + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t end = (start + bytes) & ~(kHuge - 1);
  static std::mutex mu;
  static std::set<std::pair<std::uintptr_t, std::uintptr_t>> advised;
  {
    std::lock_guard<std::mutex> lock(mu);
    if ((!again && advised.count({begin, end})) || !HugePagesWanted()) return;
    advised.emplace(begin, end);
  }
  void* p = reinterpret_cast<void*>(begin);
  if (madvise(p, end - begin, MADV_HUGEPAGE) != 0) return;
#if !defined(MADV_COLLAPSE)
#define MADV_COLLAPSE 25
#endif
  madvise(p, end - begin, MADV_COLLAPSE);  // EINVAL before Linux 6.1: a hint
#else
  (void)data;
  (void)bytes;
  (void)again;
#endif
}

}  // namespace tpu_embed_ext

namespace tensorflow {
namespace {

REGISTER_OP("TpuEmbedExtUseHugePages")
    .Input("variables: num_variables * resource")
    .Attr("num_variables: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext*) { return absl::OkStatus(); })
    .Doc("Backs large float variables with huge pages (tpu_embed_ext).");

class UseHugePagesOp : public OpKernel {
 public:
  explicit UseHugePagesOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      core::RefCountPtr<Var> var;
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, i), &var));
      tf_shared_lock lock(*var->mu());
      const Tensor* t = var->tensor();
      if (t->IsInitialized()) {
        tpu_embed_ext::UseHugePages(t->tensor_data().data(), t->TotalBytes(),
                                    /*again=*/true);
      }
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbedExtUseHugePages").Device(DEVICE_CPU),
                        UseHugePagesOp);

}  // namespace
}  // namespace tensorflow
