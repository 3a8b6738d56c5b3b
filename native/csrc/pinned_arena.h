// PinnedArena: one page-aligned block of host memory, registered with CUDA when a device is
// present (page-locked, so copies to and from the GPU run at DMA speed and asynchronously).
// Allocated once and reused; Python sees it as a writable byte buffer (torch.frombuffer).
#pragma once

#include <cstddef>
#include <cstdint>

namespace miles_native {

class PinnedArena {
 public:
  // `nbytes` is rounded up to whole pages. With `pin` and a CUDA device present the block
  // is registered with cudaHostRegister; otherwise it is ordinary (page-aligned) memory.
  // Pages are touched up front so the first copy into the arena does not pay page faults.
  PinnedArena(size_t nbytes, bool pin);
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  uintptr_t ptr() const { return reinterpret_cast<uintptr_t>(base_); }
  size_t nbytes() const { return nbytes_; }
  bool pinned() const { return pinned_; }
  // Unregisters and unmaps; later use is an error. Called by the destructor too.
  void release();
  bool released() const { return base_ == nullptr; }

 private:
  void* base_ = nullptr;
  size_t nbytes_ = 0;
  bool pinned_ = false;
};

}  // namespace miles_native
