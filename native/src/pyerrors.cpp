#include "pyerrors.hpp"

#include <nanobind/stl/string.h>

namespace nb = nanobind;

namespace sfstore {

nb::python_error to_python(const SfError& e) {
    nb::object mod = nb::module_::import_("sfstore.errors");
    nb::object path = e.path.empty() ? nb::none() : nb::object(nb::str(e.path.c_str()));
    nb::object exc = mod.attr("native_error")(e.kind, e.err, std::string(e.what()), path);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    return nb::python_error();
}

void raise_sf(const std::string& kind, int err, const std::string& msg, const std::string& path) {
    throw to_python(SfError(kind, err, msg, path));
}

}  // namespace sfstore
