#include "copy_engine.h"

#include <algorithm>
#include <cstring>
#include <future>
#include <stdexcept>

#include "cuda_support.h"

namespace miles_native {

namespace {

#ifdef MILES_HAVE_CUDA
// Sets the calling thread's current device for the scope, restoring it afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MILES_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MILES_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};
#endif

}  // namespace

CopyTicket::~CopyTicket() {
#ifdef MILES_HAVE_CUDA
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
#endif
}

void CopyTicket::wait() const {
#ifdef MILES_HAVE_CUDA
  if (event_ != nullptr) MILES_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
#endif
}

CopyEngine::CopyEngine(int device, int cpu_threads, size_t split_bytes)
    : device_(device), uses_cuda_(cuda_runtime_available()), split_bytes_(split_bytes) {
  if (split_bytes_ == 0) throw std::invalid_argument("CopyEngine: split_bytes must be > 0");
#ifdef MILES_HAVE_CUDA
  if (uses_cuda_) {
    DeviceGuard guard(device_);
    for (auto& s : streams_) {
      cudaStream_t stream = nullptr;
      MILES_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      s = stream;
    }
  }
#endif
  if (!uses_cuda_) pool_ = std::make_unique<ThreadPool>(cpu_threads);
}

CopyEngine::~CopyEngine() {
#ifdef MILES_HAVE_CUDA
  if (uses_cuda_) {
    for (auto& s : streams_) {
      if (s != nullptr) {
        cudaStreamSynchronize(static_cast<cudaStream_t>(s));
        cudaStreamDestroy(static_cast<cudaStream_t>(s));
      }
    }
  }
#endif
}

uintptr_t CopyEngine::stream(Direction direction) const {
  return reinterpret_cast<uintptr_t>(streams_[static_cast<int>(direction)]);
}

void CopyEngine::memcpy_parallel(const std::vector<CopyOp>& ops) {
  // Cut into pieces of at most split_bytes, then deal the pieces to the workers in
  // contiguous runs of roughly equal byte counts.
  std::vector<CopyOp> pieces;
  size_t total = 0;
  for (const CopyOp& op : ops) {
    for (size_t done = 0; done < op.nbytes; done += split_bytes_) {
      size_t n = std::min(split_bytes_, op.nbytes - done);
      pieces.push_back({op.dst + done, op.src + done, n});
      total += n;
    }
  }
  if (pieces.empty()) return;
  const int workers = pool_->size();
  if (workers == 1 || pieces.size() == 1) {
    for (const CopyOp& p : pieces) {
      std::memcpy(reinterpret_cast<void*>(p.dst), reinterpret_cast<const void*>(p.src), p.nbytes);
    }
    return;
  }
  const size_t share = (total + workers - 1) / workers;
  std::vector<std::future<void>> futures;
  size_t begin = 0;
  while (begin < pieces.size()) {
    size_t end = begin, bytes = 0;
    while (end < pieces.size() && (bytes < share || end == begin)) bytes += pieces[end++].nbytes;
    futures.push_back(pool_->submit([&pieces, begin, end] {
      for (size_t i = begin; i < end; ++i) {
        std::memcpy(reinterpret_cast<void*>(pieces[i].dst),
                    reinterpret_cast<const void*>(pieces[i].src), pieces[i].nbytes);
      }
    }));
    begin = end;
  }
  for (auto& f : futures) f.get();
}

std::shared_ptr<CopyTicket> CopyEngine::submit(const std::vector<CopyOp>& ops,
                                               Direction direction, uintptr_t after_stream) {
  if (!uses_cuda_) {
    memcpy_parallel(ops);
    return std::make_shared<CopyTicket>();
  }
#ifdef MILES_HAVE_CUDA
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard(device_);
  auto stream = static_cast<cudaStream_t>(streams_[static_cast<int>(direction)]);
  cudaEvent_t ready = nullptr;
  MILES_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  cudaError_t err = cudaEventRecord(ready, reinterpret_cast<cudaStream_t>(after_stream));
  if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, ready, 0);
  cudaEventDestroy(ready);
  if (err != cudaSuccess) {
    throw CudaError(std::string("CopyEngine: ordering after the caller's stream failed: ") +
                    cudaGetErrorString(err));
  }
  for (const CopyOp& op : ops) {
    if (op.nbytes == 0) continue;
    MILES_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(op.dst),
                                     reinterpret_cast<const void*>(op.src), op.nbytes,
                                     cudaMemcpyDefault, stream));
  }
  cudaEvent_t done = nullptr;
  MILES_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  MILES_CUDA_CHECK(cudaEventRecord(done, stream));
  return std::make_shared<CopyTicket>(done);
#else
  return std::make_shared<CopyTicket>();
#endif
}

void CopyEngine::stream_wait(uintptr_t target) {
#ifdef MILES_HAVE_CUDA
  if (!uses_cuda_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard(device_);
  for (void* s : streams_) {
    cudaEvent_t ev = nullptr;
    MILES_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cudaError_t err = cudaEventRecord(ev, static_cast<cudaStream_t>(s));
    if (err == cudaSuccess) err = cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(target), ev, 0);
    cudaEventDestroy(ev);
    if (err != cudaSuccess) {
      throw CudaError(std::string("CopyEngine.stream_wait: ") + cudaGetErrorString(err));
    }
  }
#else
  (void)target;
#endif
}

void CopyEngine::synchronize() {
#ifdef MILES_HAVE_CUDA
  if (!uses_cuda_) return;
  for (void* s : streams_) MILES_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
#endif
}

}  // namespace miles_native
