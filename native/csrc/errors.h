// Errors raised by miles_native; module.cpp translates them into Python exceptions.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace miles_native {

// A failed file operation: becomes OSError(errno, message, path) in Python, so the message
// names the operation and byte offset and the exception names the file.
class FileError : public std::runtime_error {
 public:
  FileError(int err, std::string path, uint64_t offset, const std::string& what)
      : std::runtime_error(what), err_(err), path_(std::move(path)), offset_(offset) {}
  int err() const { return err_; }
  const std::string& path() const { return path_; }
  uint64_t offset() const { return offset_; }

 private:
  int err_;
  std::string path_;
  uint64_t offset_;
};

// A CUDA runtime call that failed: becomes RuntimeError in Python.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace miles_native
