// Copies of one layer of many KV blocks: into consecutive rows (gather), or straight into an engine's strided
// pages (scatter), where a contiguous copy and then a permuting one would move every byte twice. Called without
// the GIL on memory the caller holds; the extents are checked (scatter_extents) before any byte moves.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace sfstore {

// out[i * nbytes : (i + 1) * nbytes] = sources[i][offset : offset + nbytes] for every source.
void gather_rows(char* out, const std::vector<const char*>& sources, size_t offset, size_t nbytes) noexcept;

// The bytes a 3-D grid of `run`-byte runs spans in the destination and in each source (`counts`, `out_strides`,
// `src_strides`: 3 entries each); an error message, empty when the grid is valid (each number in [0, 2**48], no
// extent past that). `empty` is set when nothing would move.
std::string scatter_extents(long run, const std::vector<long>& counts, const std::vector<long>& out_strides,
                            const std::vector<long>& src_strides, long* out_extent, long* src_extent, bool* empty);

// For each source i and each (a, b, c) < counts: `run` bytes from
//   sources[i] + a*src_strides[0] + b*src_strides[1] + c*src_strides[2]
// to out + out_offsets[i] + a*out_strides[0] + b*out_strides[1] + c*out_strides[2] (extents checked before).
void scatter_rows(char* out, const std::vector<const char*>& sources, const std::vector<long>& out_offsets,
                  const std::vector<long>& counts, const std::vector<long>& out_strides,
                  const std::vector<long>& src_strides, size_t run) noexcept;

}  // namespace sfstore
