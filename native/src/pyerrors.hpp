// Raising sfstore.errors classes from native code.
#pragma once
#include <nanobind/nanobind.h>

#include <string>

#include "common.hpp"

namespace sfstore {
// Sets the Python error for `e` (through sfstore.errors.native_error) and returns nb::python_error to throw.
nanobind::python_error to_python(const SfError& e);
[[noreturn]] void raise_sf(const std::string& kind, int err, const std::string& msg, const std::string& path = {});
}  // namespace sfstore
