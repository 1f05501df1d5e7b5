#include "pyerrors.hpp"

#include <cxxabi.h>
#include <unistd.h>

#include <nanobind/stl/string.h>

namespace nb = nanobind;

namespace sfstore {

nb::python_error to_python(const SfError& e) {
    if (PyErr_Occurred()) PyErr_Clear();
    nb::object mod = nb::module_::import_("sfstore.errors");
    nb::object path = nb::none();
    if (!e.path.empty()) {
        path = nb::steal(PyUnicode_DecodeFSDefaultAndSize(e.path.data(), static_cast<Py_ssize_t>(e.path.size())));
        if (!path.is_valid()) throw nb::python_error();
    }
    // The message may hold bytes of a caller's string that are not UTF-8: decode with replacement.
    const std::string msg(e.what());
    nb::object text = nb::steal(PyUnicode_DecodeUTF8(msg.data(), static_cast<Py_ssize_t>(msg.size()), "replace"));
    if (!text.is_valid()) throw nb::python_error();
    nb::object exc = mod.attr("native_error")(e.kind, e.err, text, path);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    return nb::python_error();
}

void raise_sf(const std::string& kind, int err, const std::string& msg, const std::string& path) {
    throw to_python(SfError(kind, err, msg, path));
}

namespace {
[[noreturn]] void park() noexcept {
    for (;;) pause();
}
}  // namespace

void restore_thread(PyThreadState* state) noexcept {
    try {
        PyEval_RestoreThread(state);
    } catch (abi::__forced_unwind&) {
        park();  // never leaves the handler: a forced unwind that is caught must not end
    }
}

PyGILState_STATE ensure_gil() noexcept {
    try {
        return PyGILState_Ensure();
    } catch (abi::__forced_unwind&) {
        park();
    }
}

}  // namespace sfstore
