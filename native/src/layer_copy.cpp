#include "layer_copy.hpp"

#include <cstring>

namespace sfstore {

void gather_rows(char* out, const std::vector<const char*>& sources, size_t offset, size_t nbytes) noexcept {
    for (size_t i = 0; i < sources.size(); ++i) std::memcpy(out + i * nbytes, sources[i] + offset, nbytes);
}

std::string scatter_extents(long run, const std::vector<long>& counts, const std::vector<long>& out_strides,
                            const std::vector<long>& src_strides, long* out_extent, long* src_extent, bool* empty) {
    if (counts.size() != 3 || out_strides.size() != 3 || src_strides.size() != 3)
        return "counts, out_strides and src_strides must have 3 entries each";
    if (run < 0) return "offset and run must be >= 0";
    constexpr long kLimit = 1L << 48;  // no product below can overflow
    for (int k = 0; k < 3; ++k) {
        if (counts[k] < 0 || counts[k] > kLimit || out_strides[k] < 0 || out_strides[k] > kLimit ||
            src_strides[k] < 0 || src_strides[k] > kLimit)
            return "counts and strides must be in [0, 2**48]";
    }
    *out_extent = run;
    *src_extent = run;
    *empty = run == 0 || counts[0] == 0 || counts[1] == 0 || counts[2] == 0;
    if (*empty) return {};
    for (int k = 0; k < 3; ++k) {
        __int128 o = static_cast<__int128>(counts[k] - 1) * out_strides[k];
        __int128 q = static_cast<__int128>(counts[k] - 1) * src_strides[k];
        if (o > kLimit || q > kLimit) return "an extent is too large";
        *out_extent += static_cast<long>(o);
        *src_extent += static_cast<long>(q);
    }
    return {};
}

void scatter_rows(char* out, const std::vector<const char*>& sources, const std::vector<long>& out_offsets,
                  const std::vector<long>& counts, const std::vector<long>& out_strides,
                  const std::vector<long>& src_strides, size_t run) noexcept {
    for (size_t i = 0; i < sources.size(); ++i) {
        const char* src = sources[i];
        char* base = out + out_offsets[i];
        for (long a = 0; a < counts[0]; ++a)
            for (long b = 0; b < counts[1]; ++b)
                for (long c = 0; c < counts[2]; ++c)
                    std::memcpy(base + a * out_strides[0] + b * out_strides[1] + c * out_strides[2],
                                src + a * src_strides[0] + b * src_strides[1] + c * src_strides[2], run);
    }
}

}  // namespace sfstore
