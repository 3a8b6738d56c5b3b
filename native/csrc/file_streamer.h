// FileStreamer: large memory regions to and from one file.
//
// The file is opened with O_DIRECT when the filesystem allows it (every request 4 KiB
// aligned in address, offset and size), else buffered (`direct()` is false; the Python
// wrapper logs a warning). Requests run on a thread pool, several in flight.
//
// `store` / `load` pipeline device memory through a bounded ring of pinned staging chunks:
//     store: device --CopyEngine--> ring chunk --pwrite--> file
//     load:  file --pread--> ring chunk --CopyEngine--> device
// so host memory stays at ring_chunks * chunk_bytes whatever the total. Chunk i covers file
// bytes [i * chunk_bytes, (i + 1) * chunk_bytes); the file is written in whole 4 KiB blocks.
//
// Failures (ENOSPC, EIO, EFBIG, short writes, reads past the end, misalignment) throw
// FileError naming the file and the byte offset; a failed call leaves no request running.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "copy_engine.h"
#include "pinned_arena.h"
#include "thread_pool.h"

namespace miles_native {

// `nbytes` bytes at `ptr` (device or host) live at `file_offset` in the file.
struct Region {
  uintptr_t ptr;
  uint64_t file_offset;
  size_t nbytes;
};

constexpr size_t kDirectAlignment = 4096;

class FileStreamer {
 public:
  // Opens (creating if needed, never truncating) `path`. `chunk_bytes` is rounded up to
  // 4 KiB. The staging ring (ring_chunks * chunk_bytes, pinned when CUDA is present) is
  // allocated here, once.
  FileStreamer(std::string path, size_t chunk_bytes, int ring_chunks, int io_threads,
               bool try_direct);
  ~FileStreamer();
  FileStreamer(const FileStreamer&) = delete;
  FileStreamer& operator=(const FileStreamer&) = delete;

  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  size_t chunk_bytes() const { return chunk_bytes_; }
  int ring_chunks() const { return ring_chunks_; }
  size_t ring_bytes() const { return ring_->nbytes(); }
  bool is_open() const { return fd_ >= 0; }

  // Raw host I/O, split into chunk-sized requests that run in parallel. In direct mode
  // `ptr`, `nbytes` and `offset` must be multiples of 4 KiB.
  void write(uintptr_t src, size_t nbytes, uint64_t offset);
  void read(uintptr_t dst, size_t nbytes, uint64_t offset);

  // Pipelined device -> ring -> file. Regions must not overlap in the file. The first
  // copies wait for the work queued on `after_stream`. Returns the bytes written.
  uint64_t store(const std::vector<Region>& regions, CopyEngine& engine, uintptr_t after_stream);
  // Pipelined file -> ring -> device; returns when every byte is in place.
  uint64_t load(const std::vector<Region>& regions, CopyEngine& engine, uintptr_t after_stream);

  // Closes the file (and unlinks it with `remove`). Idempotent.
  void close(bool remove);

 private:
  void check_open(const char* what) const;
  void check_aligned(uintptr_t ptr, size_t nbytes, uint64_t offset, const char* what) const;
  void pwrite_full(const char* buf, size_t nbytes, uint64_t offset) const;
  void pread_full(char* buf, size_t nbytes, uint64_t offset) const;
  char* slot(size_t i) const;

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  size_t chunk_bytes_;
  int ring_chunks_;
  std::unique_ptr<PinnedArena> ring_;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace miles_native
