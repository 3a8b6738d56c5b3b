// CopyEngine: batches of raw-pointer copies between device and host memory.
//
// With a CUDA device, each direction has its own non-blocking stream; a batch first waits
// (through an event) for the work already queued on the caller's stream, is enqueued with
// cudaMemcpyAsync (direction inferred from the pointers, unified addressing) and returns
// at once; `synchronize()` waits for every batch. Without CUDA, the same calls copy with
// memcpy on a small thread pool before returning, so callers run the same code on a CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "thread_pool.h"

namespace miles_native {

struct CopyOp {
  uintptr_t dst;
  uintptr_t src;
  size_t nbytes;
};

enum class Direction : int { kToHost = 0, kToDevice = 1 };

// A point in one of the engine's streams; `wait()` blocks the host until the copies
// submitted before it are done. Complete from birth in CPU mode.
class CopyTicket {
 public:
  CopyTicket() = default;
  explicit CopyTicket(void* event) : event_(event) {}
  ~CopyTicket();
  CopyTicket(const CopyTicket&) = delete;
  CopyTicket& operator=(const CopyTicket&) = delete;
  void wait() const;

 private:
  void* event_ = nullptr;  // cudaEvent_t
};

class CopyEngine {
 public:
  // `device`: CUDA ordinal for the streams (ignored without CUDA). `cpu_threads`: memcpy
  // workers in CPU mode. Copies of more than `split_bytes` are cut into pieces of that
  // size (in CPU mode, so that several threads share one large copy).
  CopyEngine(int device, int cpu_threads, size_t split_bytes);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  bool uses_cuda() const { return uses_cuda_; }
  int device() const { return device_; }
  // The stream used for `direction`, as an integer handle (0 in CPU mode).
  uintptr_t stream(Direction direction) const;

  // Enqueue `ops` after the work queued so far on `after_stream` (a cudaStream_t as an
  // integer; 0 means the legacy default stream). Returns a ticket for this batch.
  std::shared_ptr<CopyTicket> submit(const std::vector<CopyOp>& ops, Direction direction,
                                     uintptr_t after_stream);
  // Make `stream` wait (on the device, the host does not block) for every batch so far.
  void stream_wait(uintptr_t stream);
  // Block the host until every submitted batch is done.
  void synchronize();

 private:
  void memcpy_parallel(const std::vector<CopyOp>& ops);

  int device_;
  bool uses_cuda_;
  size_t split_bytes_;
  void* streams_[2] = {nullptr, nullptr};  // cudaStream_t per direction
  std::unique_ptr<ThreadPool> pool_;
  std::mutex mutex_;
};

}  // namespace miles_native
