// xxh3-64 (seed 0) of completed reads, the checksum every stored block carries (sfstore.blocks.layout.value_sum,
// the KV-cache tiers). Built from Debian's libxxhash-dev header, inlined: no run-time library. Without the
// header at build time checksums are unavailable and the Python side verifies instead.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sfstore {

bool xxh3_available();
uint64_t xxh3_64(const void* data, size_t len);  // only when xxh3_available()

}  // namespace sfstore
