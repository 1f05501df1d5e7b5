// xxh3-64 with AVX2, chosen at run time by checksum.cpp where the CPU has it; this file alone is built with -mavx2.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

namespace sfstore {
uint64_t xxh3_64_avx2(const void* data, size_t len) { return XXH3_64bits(data, len); }
}  // namespace sfstore
