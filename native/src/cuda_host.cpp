#include "cuda_host.hpp"

#include <dlfcn.h>

#include <mutex>

namespace sfstore::cuda {
namespace {

using CUresult = int;
using CUdevice = int;
using CUcontext = void*;

struct Api {
    bool ok = false;
    std::string reason;
    CUcontext ctx = nullptr;
    CUresult (*cuInit)(unsigned) = nullptr;
    CUresult (*cuDeviceGetCount)(int*) = nullptr;
    CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
    CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
    CUresult (*cuMemHostRegister)(void*, size_t, unsigned) = nullptr;
    CUresult (*cuMemHostUnregister)(void*) = nullptr;
    CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;

    std::string err(const char* what, CUresult r) const {
        const char* s = nullptr;
        if (cuGetErrorString) cuGetErrorString(r, &s);
        return std::string(what) + " failed: " + (s ? s : "CUDA error " + std::to_string(r));
    }
};

Api& api() {
    static Api a;
    static std::once_flag once;
    std::call_once(once, [] {
        void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            const char* e = dlerror();
            a.reason = std::string("no CUDA driver: ") + (e ? e : "libcuda.so.1 not found");
            return;
        }
        auto sym = [&](auto& fn, const char* name) {
            fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
            return fn != nullptr;
        };
        if (!sym(a.cuInit, "cuInit") || !sym(a.cuDeviceGetCount, "cuDeviceGetCount") ||
            !sym(a.cuDeviceGet, "cuDeviceGet") || !sym(a.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain") ||
            !sym(a.cuCtxSetCurrent, "cuCtxSetCurrent") || !sym(a.cuMemHostRegister, "cuMemHostRegister_v2") ||
            !sym(a.cuMemHostUnregister, "cuMemHostUnregister")) {
            a.reason = "libcuda.so.1 lacks the driver API entry points sfstore needs";
            return;
        }
        sym(a.cuGetErrorString, "cuGetErrorString");
        if (CUresult r = a.cuInit(0); r != 0) { a.reason = a.err("cuInit", r); return; }
        int n = 0;
        if (CUresult r = a.cuDeviceGetCount(&n); r != 0 || n == 0) {
            a.reason = r ? a.err("cuDeviceGetCount", r) : "CUDA driver present but no GPU";
            return;
        }
        CUdevice dev = 0;
        if (CUresult r = a.cuDeviceGet(&dev, 0); r != 0) { a.reason = a.err("cuDeviceGet", r); return; }
        if (CUresult r = a.cuDevicePrimaryCtxRetain(&a.ctx, dev); r != 0) {
            a.reason = a.err("cuDevicePrimaryCtxRetain", r);
            return;
        }
        a.ok = true;
        a.reason = "CUDA driver loaded, " + std::to_string(n) + " GPU(s)";
    });
    return a;
}

constexpr unsigned kPortable = 0x01, kDeviceMap = 0x02;

}  // namespace

bool available(std::string* reason) {
    Api& a = api();
    if (reason) *reason = a.reason;
    return a.ok;
}

bool host_register(void* ptr, size_t size, std::string* reason) {
    Api& a = api();
    if (!a.ok) {
        if (reason) *reason = a.reason;
        return false;
    }
    a.cuCtxSetCurrent(a.ctx);  // registration needs a current context in this thread
    if (CUresult r = a.cuMemHostRegister(ptr, size, kPortable | kDeviceMap); r != 0) {
        if (reason) *reason = a.err("cuMemHostRegister", r);
        return false;
    }
    return true;
}

void host_unregister(void* ptr) {
    Api& a = api();
    if (!a.ok) return;
    a.cuCtxSetCurrent(a.ctx);
    a.cuMemHostUnregister(ptr);
}

}  // namespace sfstore::cuda
