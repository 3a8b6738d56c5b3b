#include "file_streamer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <future>

#include "errors.h"

namespace miles_native {

namespace {

uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

std::string describe(const char* op, size_t nbytes, uint64_t offset) {
  return std::string(op) + " of " + std::to_string(nbytes) + " bytes at offset " +
         std::to_string(offset);
}

// Wait for every future; rethrow the first failure once all are done, so no request is
// still running (and touching the ring) when the caller sees the error.
void wait_all(std::vector<std::future<void>>& futures) {
  std::exception_ptr first;
  for (auto& f : futures) {
    if (!f.valid()) continue;
    try {
      f.get();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

std::vector<Region> sorted_nonempty(const std::vector<Region>& regions) {
  std::vector<Region> out;
  out.reserve(regions.size());
  for (const Region& r : regions) {
    if (r.nbytes > 0) out.push_back(r);
  }
  std::sort(out.begin(), out.end(),
            [](const Region& a, const Region& b) { return a.file_offset < b.file_offset; });
  for (size_t i = 1; i < out.size(); ++i) {
    if (out[i - 1].file_offset + out[i - 1].nbytes > out[i].file_offset) {
      throw std::invalid_argument("FileStreamer: regions overlap at file offset " +
                                  std::to_string(out[i].file_offset));
    }
  }
  return out;
}

// The copies that move chunk [begin, end) between the ring slot at `staging` and the
// regions; `cursor` (the first region that may still intersect) advances monotonically.
std::vector<CopyOp> chunk_ops(const std::vector<Region>& regions, size_t& cursor, uint64_t begin,
                              uint64_t end, char* staging, bool to_staging) {
  std::vector<CopyOp> ops;
  while (cursor < regions.size() &&
         regions[cursor].file_offset + regions[cursor].nbytes <= begin) {
    ++cursor;
  }
  for (size_t i = cursor; i < regions.size() && regions[i].file_offset < end; ++i) {
    const Region& r = regions[i];
    uint64_t lo = std::max<uint64_t>(begin, r.file_offset);
    uint64_t hi = std::min<uint64_t>(end, r.file_offset + r.nbytes);
    if (hi <= lo) continue;
    uintptr_t mem = r.ptr + (lo - r.file_offset);
    uintptr_t stage = reinterpret_cast<uintptr_t>(staging) + (lo - begin);
    if (to_staging) {
      ops.push_back({stage, mem, static_cast<size_t>(hi - lo)});
    } else {
      ops.push_back({mem, stage, static_cast<size_t>(hi - lo)});
    }
  }
  return ops;
}

}  // namespace

FileStreamer::FileStreamer(std::string path, size_t chunk_bytes, int ring_chunks,
                           int io_threads, bool try_direct)
    : path_(std::move(path)),
      chunk_bytes_(round_up(chunk_bytes == 0 ? kDirectAlignment : chunk_bytes, kDirectAlignment)),
      ring_chunks_(ring_chunks < 1 ? 1 : ring_chunks) {
  if (try_direct) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
    if (fd_ >= 0) direct_ = true;
    else if (errno != EINVAL) throw FileError(errno, path_, 0, std::string("open: ") + std::strerror(errno));
  }
  if (fd_ < 0) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd_ < 0) throw FileError(errno, path_, 0, std::string("open: ") + std::strerror(errno));
  }
  ring_ = std::make_unique<PinnedArena>(chunk_bytes_ * static_cast<size_t>(ring_chunks_), true);
  pool_ = std::make_unique<ThreadPool>(io_threads);
}

FileStreamer::~FileStreamer() {
  pool_.reset();  // joins the workers before the ring goes away
  if (fd_ >= 0) ::close(fd_);
}

char* FileStreamer::slot(size_t i) const {
  return reinterpret_cast<char*>(ring_->ptr()) + (i % ring_chunks_) * chunk_bytes_;
}

void FileStreamer::check_open(const char* what) const {
  if (fd_ < 0) throw FileError(EBADF, path_, 0, std::string(what) + ": the streamer is closed");
}

void FileStreamer::check_aligned(uintptr_t ptr, size_t nbytes, uint64_t offset,
                                 const char* what) const {
  if (!direct_) return;
  if (ptr % kDirectAlignment || nbytes % kDirectAlignment || offset % kDirectAlignment) {
    throw FileError(EINVAL, path_, offset,
                    describe(what, nbytes, offset) +
                        ": O_DIRECT needs address, size and offset aligned to 4096 bytes");
  }
}

void FileStreamer::pwrite_full(const char* buf, size_t nbytes, uint64_t offset) const {
  size_t done = 0;
  while (done < nbytes) {
    ssize_t n = ::pwrite(fd_, buf + done, nbytes - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      throw FileError(err, path_, offset + done,
                      describe("write", nbytes - done, offset + done) + " failed: " +
                          std::strerror(err));
    }
    if (n == 0) {
      throw FileError(EIO, path_, offset + done,
                      "short write: 0 of " + std::to_string(nbytes - done) +
                          " bytes written at offset " + std::to_string(offset + done));
    }
    done += static_cast<size_t>(n);
  }
}

void FileStreamer::pread_full(char* buf, size_t nbytes, uint64_t offset) const {
  size_t done = 0;
  while (done < nbytes) {
    ssize_t n = ::pread(fd_, buf + done, nbytes - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      throw FileError(err, path_, offset + done,
                      describe("read", nbytes - done, offset + done) + " failed: " +
                          std::strerror(err));
    }
    if (n == 0) {
      throw FileError(EIO, path_, offset + done,
                      "unexpected end of file: " + std::to_string(nbytes - done) +
                          " bytes missing at offset " + std::to_string(offset + done));
    }
    done += static_cast<size_t>(n);
  }
}

void FileStreamer::write(uintptr_t src, size_t nbytes, uint64_t offset) {
  check_open("write");
  check_aligned(src, nbytes, offset, "write");
  std::vector<std::future<void>> futures;
  for (size_t done = 0; done < nbytes; done += chunk_bytes_) {
    size_t n = std::min(chunk_bytes_, nbytes - done);
    const char* buf = reinterpret_cast<const char*>(src) + done;
    futures.push_back(pool_->submit([this, buf, n, offset, done] { pwrite_full(buf, n, offset + done); }));
  }
  wait_all(futures);
}

void FileStreamer::read(uintptr_t dst, size_t nbytes, uint64_t offset) {
  check_open("read");
  check_aligned(dst, nbytes, offset, "read");
  std::vector<std::future<void>> futures;
  for (size_t done = 0; done < nbytes; done += chunk_bytes_) {
    size_t n = std::min(chunk_bytes_, nbytes - done);
    char* buf = reinterpret_cast<char*>(dst) + done;
    futures.push_back(pool_->submit([this, buf, n, offset, done] { pread_full(buf, n, offset + done); }));
  }
  wait_all(futures);
}

uint64_t FileStreamer::store(const std::vector<Region>& regions, CopyEngine& engine,
                             uintptr_t after_stream) {
  check_open("store");
  const std::vector<Region> sorted = sorted_nonempty(regions);
  if (sorted.empty()) return 0;
  const uint64_t end = round_up(sorted.back().file_offset + sorted.back().nbytes, kDirectAlignment);
  const size_t nchunks = (end + chunk_bytes_ - 1) / chunk_bytes_;
  std::vector<std::future<void>> in_flight(ring_chunks_);
  size_t cursor = 0;
  try {
    for (size_t i = 0; i < nchunks; ++i) {
      auto& pending = in_flight[i % ring_chunks_];
      if (pending.valid()) pending.get();  // the slot's previous write is done
      const uint64_t begin = i * chunk_bytes_;
      const uint64_t stop = std::min<uint64_t>(end, begin + chunk_bytes_);
      char* staging = slot(i);
      std::vector<CopyOp> ops = chunk_ops(sorted, cursor, begin, stop, staging, true);
      std::shared_ptr<CopyTicket> ticket = engine.submit(ops, Direction::kToHost, after_stream);
      pending = pool_->submit([this, ticket, staging, begin, stop] {
        ticket->wait();
        pwrite_full(staging, stop - begin, begin);
      });
    }
  } catch (...) {
    try {
      wait_all(in_flight);
    } catch (...) {
    }
    throw;
  }
  wait_all(in_flight);
  return end;
}

uint64_t FileStreamer::load(const std::vector<Region>& regions, CopyEngine& engine,
                            uintptr_t after_stream) {
  check_open("load");
  const std::vector<Region> sorted = sorted_nonempty(regions);
  if (sorted.empty()) return 0;
  const uint64_t end = round_up(sorted.back().file_offset + sorted.back().nbytes, kDirectAlignment);
  const size_t nchunks = (end + chunk_bytes_ - 1) / chunk_bytes_;
  std::vector<std::future<void>> reads(ring_chunks_);
  auto read_chunk = [this, end](size_t i, std::shared_ptr<CopyTicket> slot_free) {
    char* staging = slot(i);
    const uint64_t begin = i * chunk_bytes_;
    const uint64_t stop = std::min<uint64_t>(end, begin + chunk_bytes_);
    return pool_->submit([this, staging, begin, stop, slot_free] {
      if (slot_free) slot_free->wait();  // the slot's previous copies have left it
      pread_full(staging, stop - begin, begin);
    });
  };
  size_t cursor = 0;
  std::shared_ptr<CopyTicket> last;
  try {
    for (size_t i = 0; i < nchunks && i < static_cast<size_t>(ring_chunks_); ++i) {
      reads[i] = read_chunk(i, nullptr);
    }
    for (size_t i = 0; i < nchunks; ++i) {
      auto& pending = reads[i % ring_chunks_];
      pending.get();
      const uint64_t begin = i * chunk_bytes_;
      const uint64_t stop = std::min<uint64_t>(end, begin + chunk_bytes_);
      std::vector<CopyOp> ops = chunk_ops(sorted, cursor, begin, stop, slot(i), false);
      last = engine.submit(ops, Direction::kToDevice, after_stream);
      if (i + ring_chunks_ < nchunks) pending = read_chunk(i + ring_chunks_, last);
    }
  } catch (...) {
    try {
      wait_all(reads);
    } catch (...) {
    }
    engine.synchronize();
    throw;
  }
  if (last) last->wait();
  return end;
}

void FileStreamer::close(bool remove) {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (remove && ::unlink(path_.c_str()) != 0 && errno != ENOENT) {
    throw FileError(errno, path_, 0, std::string("unlink: ") + std::strerror(errno));
  }
}

}  // namespace miles_native
