// miles_native._core: Python bindings of the pinned arena, the copy engine and the file
// streamer. Pointers, sizes, offsets and CUDA streams cross as Python ints; every call that
// copies, waits or does I/O releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

#include "copy_engine.h"
#include "cuda_support.h"
#include "errors.h"
#include "file_streamer.h"
#include "pinned_arena.h"

namespace py = pybind11;
using namespace miles_native;

namespace {

std::string build_info() {
  std::string info = "miles_native (C++";
  info += std::to_string(__cplusplus);
  info += built_with_cuda() ? ", CUDA)" : ", CPU only)";
  return info;
}

std::vector<CopyOp> make_ops(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
                             const std::vector<uint64_t>& nbytes) {
  if (dst.size() != src.size() || dst.size() != nbytes.size()) {
    throw std::invalid_argument("dst, src and nbytes must have the same length");
  }
  std::vector<CopyOp> ops(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) ops[i] = {dst[i], src[i], nbytes[i]};
  return ops;
}

std::vector<Region> make_regions(const std::vector<uint64_t>& ptrs,
                                 const std::vector<uint64_t>& offsets,
                                 const std::vector<uint64_t>& nbytes) {
  if (ptrs.size() != offsets.size() || ptrs.size() != nbytes.size()) {
    throw std::invalid_argument("ptrs, offsets and nbytes must have the same length");
  }
  std::vector<Region> regions(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) regions[i] = {ptrs[i], offsets[i], nbytes[i]};
  return regions;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "miles-native compiled core: pinned arena, copy engine, file streamer";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const FileError& e) {
      py::object err = py::module_::import("builtins").attr("OSError")(e.err(), e.what(), e.path());
      err.attr("offset") = e.offset();
      PyErr_SetObject(PyExc_OSError, err.ptr());
    } catch (const CudaError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const std::system_error& e) {
      PyErr_SetObject(PyExc_OSError, py::make_tuple(e.code().value(), e.what()).ptr());
    }
  });

  m.def("built_with_cuda", &built_with_cuda, "True when the extension was compiled against CUDA.");
  m.def("cuda_runtime_available", &cuda_runtime_available,
        "True when compiled against CUDA and a device is visible now.");
  m.def("build_info", &build_info, "One line describing how the extension was built.");

  py::class_<PinnedArena>(m, "PinnedArena", py::buffer_protocol(),
                          "Page-aligned host memory, page-locked with CUDA when available.")
      .def(py::init<size_t, bool>(), py::arg("nbytes"), py::arg("pin") = true,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("ptr", &PinnedArena::ptr)
      .def_property_readonly("nbytes", &PinnedArena::nbytes)
      .def_property_readonly("pinned", &PinnedArena::pinned)
      .def_buffer([](PinnedArena& a) {
        if (a.released()) throw std::runtime_error("PinnedArena was released");
        return py::buffer_info(reinterpret_cast<void*>(a.ptr()), 1,
                               py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(a.nbytes())}, {1}, false);
      });

  py::class_<CopyTicket, std::shared_ptr<CopyTicket>>(m, "CopyTicket",
                                                      "A submitted batch; wait() blocks until done.")
      .def("wait", &CopyTicket::wait, py::call_guard<py::gil_scoped_release>());

  py::class_<CopyEngine>(m, "CopyEngine", "Batched async copies between raw pointers.")
      .def(py::init<int, int, size_t>(), py::arg("device") = 0, py::arg("cpu_threads") = 2,
           py::arg("split_bytes") = size_t(64) << 20)
      .def_property_readonly("uses_cuda", &CopyEngine::uses_cuda)
      .def_property_readonly("device", &CopyEngine::device)
      .def_property_readonly("stream_to_host",
                             [](const CopyEngine& e) { return e.stream(Direction::kToHost); })
      .def_property_readonly("stream_to_device",
                             [](const CopyEngine& e) { return e.stream(Direction::kToDevice); })
      .def(
          "submit",
          [](CopyEngine& e, const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
             const std::vector<uint64_t>& nbytes, bool to_device, uintptr_t after_stream) {
            std::vector<CopyOp> ops = make_ops(dst, src, nbytes);
            py::gil_scoped_release release;
            return e.submit(ops, to_device ? Direction::kToDevice : Direction::kToHost,
                            after_stream);
          },
          py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("to_device"),
          py::arg("after_stream") = 0,
          "Copy nbytes[i] bytes from src[i] to dst[i] after the work on after_stream.")
      .def("stream_wait", &CopyEngine::stream_wait, py::arg("stream"),
           py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &CopyEngine::synchronize, py::call_guard<py::gil_scoped_release>());

  py::class_<FileStreamer>(m, "FileStreamer", "Regions to and from one file through a pinned ring.")
      .def(py::init<std::string, size_t, int, int, bool>(), py::arg("path"),
           py::arg("chunk_bytes"), py::arg("ring_chunks") = 4, py::arg("io_threads") = 4,
           py::arg("direct") = true, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("path", &FileStreamer::path)
      .def_property_readonly("direct", &FileStreamer::direct)
      .def_property_readonly("chunk_bytes", &FileStreamer::chunk_bytes)
      .def_property_readonly("ring_chunks", &FileStreamer::ring_chunks)
      .def_property_readonly("ring_bytes", &FileStreamer::ring_bytes)
      .def_property_readonly("is_open", &FileStreamer::is_open)
      .def("write", &FileStreamer::write, py::arg("src"), py::arg("nbytes"), py::arg("offset"),
           py::call_guard<py::gil_scoped_release>())
      .def("read", &FileStreamer::read, py::arg("dst"), py::arg("nbytes"), py::arg("offset"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "store",
          [](FileStreamer& s, const std::vector<uint64_t>& ptrs,
             const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& nbytes,
             CopyEngine& engine, uintptr_t after_stream) {
            std::vector<Region> regions = make_regions(ptrs, offsets, nbytes);
            py::gil_scoped_release release;
            return s.store(regions, engine, after_stream);
          },
          py::arg("ptrs"), py::arg("offsets"), py::arg("nbytes"), py::arg("engine"),
          py::arg("after_stream") = 0)
      .def(
          "load",
          [](FileStreamer& s, const std::vector<uint64_t>& ptrs,
             const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& nbytes,
             CopyEngine& engine, uintptr_t after_stream) {
            std::vector<Region> regions = make_regions(ptrs, offsets, nbytes);
            py::gil_scoped_release release;
            return s.load(regions, engine, after_stream);
          },
          py::arg("ptrs"), py::arg("offsets"), py::arg("nbytes"), py::arg("engine"),
          py::arg("after_stream") = 0)
      .def("close", &FileStreamer::close, py::arg("remove") = false,
           py::call_guard<py::gil_scoped_release>());
}
