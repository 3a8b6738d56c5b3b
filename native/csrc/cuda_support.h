// Whether the CUDA runtime can be used at run time, and a checked-call macro.
#pragma once

#include <string>

#ifdef MILES_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "errors.h"

#define MILES_CUDA_CHECK(expr)                                                             \
  do {                                                                                     \
    cudaError_t miles_err_ = (expr);                                                       \
    if (miles_err_ != cudaSuccess) {                                                       \
      throw ::miles_native::CudaError(std::string(#expr) + " failed: " +                    \
                                      cudaGetErrorString(miles_err_));                     \
    }                                                                                      \
  } while (0)
#endif

namespace miles_native {

// True when the extension was compiled against CUDA.
bool built_with_cuda();

// True when it was compiled against CUDA and the runtime sees at least one device. The
// answer is computed once; a CUDA build on a machine without a GPU answers false and every
// copy becomes a memcpy.
bool cuda_runtime_available();

}  // namespace miles_native
