// Raising sfstore.errors classes from native code, and giving the GIL up and back safely.
#pragma once
#include <nanobind/nanobind.h>

#include <string>

#include "common.hpp"

namespace sfstore {
// Sets the Python error for `e` (through sfstore.errors.native_error) and returns nb::python_error to throw.
// A Python error already pending (a failed conversion) is cleared first: raising over it is a SystemError.
nanobind::python_error to_python(const SfError& e);
[[noreturn]] void raise_sf(const std::string& kind, int err, const std::string& msg, const std::string& path = {});

// Takes the GIL back for a thread that gave it up. While the interpreter finalizes, CPython (< 3.14) ends any
// other thread that asks for the GIL with pthread_exit, whose forced unwind aborts the process ("terminate
// called without an active exception") when it meets a noexcept frame, such as a destructor that takes the GIL
// back. Such a thread is parked instead (as CPython 3.14 does): it sleeps until the process is gone.
void restore_thread(PyThreadState* state) noexcept;
// PyGILState_Ensure for threads CPython may not know (DLPack deleters run on the consumer's threads), likewise.
PyGILState_STATE ensure_gil() noexcept;

// Gives the GIL up for a scope; takes it back with restore_thread.
class NoGil {
public:
    NoGil() : state_(PyEval_SaveThread()) {}
    ~NoGil() { restore_thread(state_); }
    NoGil(const NoGil&) = delete;
    NoGil& operator=(const NoGil&) = delete;

private:
    PyThreadState* state_;
};
}  // namespace sfstore
