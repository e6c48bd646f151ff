// PyTorch operator glm5_cuda::deterministic_topk around glm5::deterministic_topk_kernel (see the .cuh).
// Registered with TORCH_LIBRARY (no pybind11), so it loads with cpp_extension.load(is_python_module=False)
// and is called as torch.ops.glm5_cuda.deterministic_topk; light headers keep the host compile short.
//
// The caller (glm5_core.backends.cuda.ext) passes the current CUDA stream as an integer and has made the
// scores' device current, so this file needs no c10/cuda headers and compiles against any torch build.
#include <cuda_runtime.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "deterministic_topk.cuh"

namespace {

// scores: fp32 [R, S] on the current CUDA device (last dim contiguous, no NaN); returns int32 [R, k], k <= S.
at::Tensor deterministic_topk(const at::Tensor& scores, int64_t k, int64_t stream_handle) {
  TORCH_CHECK(scores.is_cuda(), "scores: expected a CUDA tensor, got device ", scores.device());
  TORCH_CHECK(scores.dim() == 2, "scores: expected rank 2 [R, S], got shape ", scores.sizes());
  TORCH_CHECK(scores.scalar_type() == at::kFloat, "scores: expected float32, got ", scores.scalar_type());
  TORCH_CHECK(scores.stride(1) == 1, "scores: expected a contiguous last dim");
  TORCH_CHECK(k >= 1 && k <= scores.size(1) && k <= glm5::kTopkMaxK,
              "k: expected 1 <= k <= min(S, ", glm5::kTopkMaxK, ") with S=", scores.size(1), ", got ", k);
  TORCH_CHECK(scores.size(1) < (int64_t{1} << 31), "scores: expected fewer than 2^31 columns");
  auto out = at::empty({scores.size(0), k}, scores.options().dtype(at::kInt));
  if (scores.size(0) == 0) return out;
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  glm5::deterministic_topk_kernel<<<static_cast<unsigned>(scores.size(0)), glm5::kTopkThreads, 0, stream>>>(
      scores.data_ptr<float>(), scores.size(1), scores.stride(0), static_cast<int>(k), out.data_ptr<int32_t>());
  const cudaError_t status = cudaGetLastError();
  TORCH_CHECK(status == cudaSuccess, "deterministic_topk launch failed: ", cudaGetErrorString(status));
  return out;
}

}  // namespace

TORCH_LIBRARY(glm5_cuda, m) {
  // Row-wise top-k of fp32 scores [R, S] -> int32 [R, k]: score descending, ties to the lower index.
  m.def("deterministic_topk(Tensor scores, int k, int stream) -> Tensor", &deterministic_topk);
}
