// miles_native._core: the compiled half of miles-native.
#include <pybind11/pybind11.h>

#include <string>

namespace py = pybind11;

namespace {

bool built_with_cuda() {
#ifdef MILES_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::string build_info() {
  std::string info = "miles_native (C++";
  info += std::to_string(__cplusplus);
  info += built_with_cuda() ? ", CUDA)" : ", CPU only)";
  return info;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "miles-native compiled core";
  m.def("built_with_cuda", &built_with_cuda, "True when the extension was compiled against CUDA.");
  m.def("build_info", &build_info, "One line describing how the extension was built.");
}
