// CUDA host-memory registration through the driver API, loaded at run time with dlopen("libcuda.so.1"),
// so building sfstore needs no CUDA. Without a driver every call is a reported no-op.
#pragma once
#include <cstddef>
#include <string>

namespace sfstore::cuda {

// Whether the CUDA driver loaded and initialised; `reason` says why not.
bool available(std::string* reason);
// Page-locks and maps [ptr, ptr+size) for the GPU (cuMemHostRegister, PORTABLE|DEVICEMAP).
// Returns false and sets `reason` when there is no driver or the driver refuses.
bool host_register(void* ptr, size_t size, std::string* reason);
void host_unregister(void* ptr);

}  // namespace sfstore::cuda
