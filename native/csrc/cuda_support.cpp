#include "cuda_support.h"

namespace miles_native {

bool built_with_cuda() {
#ifdef MILES_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_runtime_available() {
#ifdef MILES_HAVE_CUDA
  static const bool available = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no device" error
      return false;
    }
    return count > 0;
  }();
  return available;
#else
  return false;
#endif
}

}  // namespace miles_native
