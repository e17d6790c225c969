// Python bindings of Tandem's AVX2 + FMA + F16C kernels (the "avx2" variant; see
// tandem/kernels/__init__.py for shapes and semantics). Each function has the name and signature of
// its AVX-512 BF16 counterpart, so tandem.kernels calls whichever variant is selected.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind_omp_threads", &bind_omp_threads, "pin OpenMP thread i to cpus[i]; returns the thread ids",
        py::arg("cpus"));
  m.def("omp_thread_ids", &omp_thread_ids, "thread ids of an n-thread OpenMP team", py::arg("n"));
  m.def("paged_attention", &paged_attention, "write K/V into the paged cache, attend every row up to max_query_len");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim of [R, dim]");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "in place: residual += x; x = rms_norm(residual)");
  m.def("rotary", &rotary, "rotate-half rotary embedding of [T, H, D]");
  m.def("rotary_", &rotary_, "in-place rotate-half rotary embedding of [T, H, D] (any token stride)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
}
