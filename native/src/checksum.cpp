#include "checksum.hpp"

#ifdef SFSTORE_HAVE_XXHASH
#define XXH_INLINE_ALL
#include <xxhash.h>
#endif

namespace sfstore {

#ifdef SFSTORE_HAVE_XXHASH
bool xxh3_available() { return true; }
uint64_t xxh3_64(const void* data, size_t len) { return XXH3_64bits(data, len); }
#else
bool xxh3_available() { return false; }
uint64_t xxh3_64(const void*, size_t) { return 0; }
#endif

}  // namespace sfstore
