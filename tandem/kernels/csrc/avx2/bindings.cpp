// Python bindings of Tandem's AVX2 + FMA + F16C kernels (the "avx2" variant; see
// tandem/kernels/__init__.py for shapes and semantics). Each function has the name and signature of
// its AVX-512 BF16 counterpart, so tandem.kernels calls whichever variant is selected.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind_omp_threads", &bind_omp_threads, "pin OpenMP thread i to cpus[i]; returns the thread ids",
        py::arg("cpus"));
  m.def("omp_thread_ids", &omp_thread_ids, "thread ids of an n-thread OpenMP team", py::arg("n"));
}
