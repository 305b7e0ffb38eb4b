// .npy parsing (format versions 1–3): magic, header length, the header dict's descr /
// fortran_order / shape, then the raw data. Only what the `sage` tool needs.
#include "npy.h"

#include <cstring>
#include <fstream>

namespace sage::tool {
namespace {

bool fail(std::string* error, const std::string& path, const std::string& why) {
  *error = path + ": " + why;
  return false;
}

// The value text of `key` in a Python dict literal, e.g. "'<f2'" or "(4, 32)".
std::string dict_value(const std::string& header, const std::string& key) {
  const size_t k = header.find("'" + key + "'");
  if (k == std::string::npos) return {};
  size_t p = header.find(':', k);
  if (p == std::string::npos) return {};
  ++p;
  while (p < header.size() && header[p] == ' ') ++p;
  const char open = header[p];
  const char close = open == '(' ? ')' : open == '\'' ? '\'' : ',';
  const size_t end = header.find(close, p + 1);
  if (end == std::string::npos) return {};
  return header.substr(p, end - p + (close == ',' ? 0 : 1));
}

}  // namespace

bool read_npy(const std::string& path, NpyArray* out, std::string* error) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return fail(error, path, "cannot open");
  char magic[8];
  if (!f.read(magic, 8) || std::memcmp(magic, "\x93NUMPY", 6) != 0)
    return fail(error, path, "not a .npy file");
  uint32_t header_len = 0;
  if (magic[6] == 1) {
    uint8_t b[2];
    f.read(reinterpret_cast<char*>(b), 2);
    header_len = uint32_t(b[0]) | uint32_t(b[1]) << 8;
  } else {
    uint8_t b[4];
    f.read(reinterpret_cast<char*>(b), 4);
    header_len = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
  }
  if (!f || header_len > (1u << 20)) return fail(error, path, "bad header");
  std::string header(header_len, '\0');
  if (!f.read(header.data(), header_len)) return fail(error, path, "truncated header");

  const std::string descr = dict_value(header, "descr");
  if (descr == "'<f2'") {
    out->is_fp16 = true;
  } else if (descr == "'<f4'") {
    out->is_fp16 = false;
  } else {
    return fail(error, path, "dtype " + descr + " unsupported (need float16 '<f2' or float32 '<f4')");
  }
  if (dict_value(header, "fortran_order").rfind("True", 0) == 0)
    return fail(error, path, "Fortran order unsupported (save a C-contiguous array)");
  // The shape, parsed without exceptions: a corrupt header is an error naming the file.
  const std::string shape = dict_value(header, "shape");
  if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')')
    return fail(error, path, "no shape in header");
  out->shape.clear();
  int64_t elems = 1;
  constexpr int64_t kMaxElems = int64_t(1) << 40;
  for (size_t i = 1; i + 1 < shape.size();) {
    while (i + 1 < shape.size() && (shape[i] == ' ' || shape[i] == ',')) ++i;
    if (i + 1 >= shape.size()) break;
    int64_t dim = 0;
    const size_t start = i;
    while (i + 1 < shape.size() && shape[i] >= '0' && shape[i] <= '9' && dim <= kMaxElems)
      dim = dim * 10 + (shape[i++] - '0');
    if (i == start || dim > kMaxElems || (dim > 0 && elems > kMaxElems / dim))
      return fail(error, path, "bad shape " + shape + " in header");
    out->shape.push_back(dim);
    elems *= dim;
  }
  // Compared with what the file holds before allocating, so a corrupt size cannot exhaust memory.
  const size_t bytes = size_t(elems) * (out->is_fp16 ? 2 : 4);
  const std::streamoff data_at = f.tellg();
  f.seekg(0, std::ios::end);
  const std::streamoff have = f.tellg() - data_at;
  f.seekg(data_at);
  if (have < std::streamoff(bytes))
    return fail(error, path,
                "truncated data (expected " + std::to_string(bytes) + " bytes, found " +
                    std::to_string(have) + ")");
  out->bytes.resize(bytes);
  if (!f.read(reinterpret_cast<char*>(out->bytes.data()), std::streamsize(bytes)))
    return fail(error, path, "cannot read " + std::to_string(bytes) + " bytes of data");
  return true;
}

}  // namespace sage::tool
