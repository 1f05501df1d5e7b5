// The DLPack ABI (https://dmlc.github.io/dlpack/latest/c_api.html), declared here for the few fields
// sfstore fills; layout must match the specification exactly.
#pragma once
#include <cstdint>

extern "C" {
struct DLDevice {
    int32_t device_type;  // kDLCPU = 1
    int32_t device_id;
};
struct DLDataType {
    uint8_t code;  // kDLUInt = 1
    uint8_t bits;
    uint16_t lanes;
};
struct DLTensor {
    void* data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t* shape;
    int64_t* strides;
    uint64_t byte_offset;
};
struct DLManagedTensor {
    DLTensor dl_tensor;
    void* manager_ctx;
    void (*deleter)(DLManagedTensor*);
};
struct DLPackVersion {
    uint32_t major;
    uint32_t minor;
};
struct DLManagedTensorVersioned {
    DLPackVersion version;
    void* manager_ctx;
    void (*deleter)(DLManagedTensorVersioned*);
    uint64_t flags;
    DLTensor dl_tensor;
};
}

constexpr int32_t kDLCPU = 1;
constexpr uint8_t kDLUInt = 1;
