#include "pinned_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>

#include "cuda_support.h"

namespace miles_native {

namespace {

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

}  // namespace

PinnedArena::PinnedArena(size_t nbytes, bool pin) {
  const size_t page = page_size();
  nbytes_ = ((nbytes == 0 ? 1 : nbytes) + page - 1) / page * page;
  void* base = mmap(nullptr, nbytes_, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (base == MAP_FAILED) {
    throw std::system_error(errno, std::generic_category(),
                            "PinnedArena: mmap of " + std::to_string(nbytes_) + " bytes");
  }
  base_ = base;
#ifdef MILES_HAVE_CUDA
  if (pin && cuda_runtime_available()) {
    cudaError_t err = cudaHostRegister(base_, nbytes_, cudaHostRegisterDefault);
    if (err != cudaSuccess) {
      munmap(base_, nbytes_);
      base_ = nullptr;
      throw CudaError("PinnedArena: cudaHostRegister of " + std::to_string(nbytes_) +
                      " bytes failed: " + cudaGetErrorString(err));
    }
    pinned_ = true;
  }
#else
  (void)pin;
#endif
}

void PinnedArena::release() {
  if (base_ == nullptr) return;
#ifdef MILES_HAVE_CUDA
  if (pinned_) cudaHostUnregister(base_);
#endif
  munmap(base_, nbytes_);
  base_ = nullptr;
  pinned_ = false;
}

PinnedArena::~PinnedArena() { release(); }

}  // namespace miles_native
