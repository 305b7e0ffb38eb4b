// GoogleTest suites Api*: the C API (sage.h) with host pointers, i.e. the CPU reference backend.
// Bad arguments give a status and a message naming the argument and leave every buffer untouched;
// defaults and version; the same problem in any layout or strides gives bit-identical output; the
// API agrees with sage::ref called directly and with a float64 attention written here; LSE, GQA,
// MQA and both causal alignments. Host code; any architecture. Seeds: SAGE_TEST_SEED reruns one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ref/reference.h"
#include "sage/sage.h"

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------
// Seeds, dtypes, poison patterns.

uint64_t fresh_seed() {
  if (const char* s = std::getenv("SAGE_TEST_SEED")) return std::strtoull(s, nullptr, 0);
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ uint64_t(rd());
}

std::string seed_message(uint64_t seed) {
  return "seed = " + std::to_string(seed) + " (rerun with SAGE_TEST_SEED=" + std::to_string(seed) +
         ")";
}

int64_t elem_bytes(sage_dtype d) {
  return d == SAGE_DTYPE_FP32 ? 4 : 2;
}

const char* dtype_name(sage_dtype d) {
  return d == SAGE_DTYPE_FP16 ? "fp16" : d == SAGE_DTYPE_BF16 ? "bf16" : "fp32";
}

// Input padding holds NaN: a read of it would spread into the output.
uint32_t nan_bits(sage_dtype d) {
  return d == SAGE_DTYPE_FP32 ? 0x7FC00000u : d == SAGE_DTYPE_FP16 ? 0x7E00u : 0x7FC0u;
}
// Output buffers start as this pattern; what the API must not write keeps it.
uint32_t poison_bits(sage_dtype d) {
  return d == SAGE_DTYPE_FP32 ? 0xDEADBEEFu : 0xDEADu;
}
constexpr uint32_t kLsePoison = 0xDEADBEEFu;

// Bits of x stored in dtype (the rounding the API applies to its output).
uint32_t round_bits(sage_dtype d, double x) {
  uint32_t word = 0;
  sage::ref::store_element(&word, d, 0, x);
  return d == SAGE_DTYPE_FP32 ? word : (word & 0xFFFFu);
}

// Writes an arbitrary int into an enum field, as a C caller can (no out-of-range enum cast in this
// file; whether the library reads such a field safely is what the tests ask).
template <typename E>
void set_enum(E& field, int value) {
  static_assert(sizeof(E) == sizeof(int), "C enums are int-sized");
  std::memcpy(&field, &value, sizeof(value));
}

// True when `word` occurs in `msg` as a whole identifier ("o" in "o overlaps q", "block_q" in
// "quant.block_q = 0").
bool names_word(const std::string& msg, const std::string& word) {
  auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t pos = msg.find(word); pos != std::string::npos; pos = msg.find(word, pos + 1)) {
    const size_t end = pos + word.size();
    if ((pos == 0 || !ident(msg[pos - 1])) && (end == msg.size() || !ident(msg[end]))) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Layouts and strided host tensors.

enum class Layout {
  kHndDefault,  // strides {0, 0, 0}, args.layout = HND
  kNhdDefault,  // strides {0, 0, 0}, args.layout = NHD
  kHnd,         // explicit contiguous [B, H, N, D]
  kNhd,         // explicit contiguous [B, N, H, D]
  kPadded,      // [B, N, H, D+8], extra gaps after each token and batch (heads interleaved)
  kHeadsOuter,  // [H, B, N, D+4] with gaps: the head stride is the largest
  kTransposed,  // [N, H, B, D] with a gap per token: the batch stride is the smallest
};

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kHndDefault:
      return "HND (zero strides)";
    case Layout::kNhdDefault:
      return "NHD (zero strides)";
    case Layout::kHnd:
      return "HND";
    case Layout::kNhd:
      return "NHD";
    case Layout::kPadded:
      return "padded NHD";
    case Layout::kHeadsOuter:
      return "heads-outer padded";
    case Layout::kTransposed:
      return "[N,H,B,D]";
  }
  return "?";
}

bool is_default(Layout l) {
  return l == Layout::kHndDefault || l == Layout::kNhdDefault;
}

// Strides of a [B, H, N, D] tensor stored in `l` (D = 1 for LSE, whose zero strides mean HND).
sage_strides strides_for(Layout l, int64_t B, int64_t H, int64_t N, int64_t D, bool lse = false) {
  if (lse && is_default(l)) l = Layout::kHnd;
  switch (l) {
    case Layout::kHndDefault:
    case Layout::kHnd:
      return {H * N * D, N * D, D};
    case Layout::kNhdDefault:
    case Layout::kNhd:
      return {N * H * D, D, H * D};
    case Layout::kPadded: {
      const int64_t dp = D + 8, token = H * dp + 16;
      return {N * token + 40, dp, token};
    }
    case Layout::kHeadsOuter: {
      const int64_t token = D + 4, batch = N * token + 8;
      return {batch, B * batch + 24, token};
    }
    case Layout::kTransposed:
      return {D, B * D, H * B * D + 5};
  }
  return {0, 0, 0};
}

// A strided [B, H, N, D] tensor in host memory, every slot (elements, padding, slack after the
// end) starting as `fill`.
class Tensor {
 public:
  Tensor() = default;
  Tensor(sage_dtype dtype, int64_t B, int64_t H, int64_t N, int64_t D, sage_strides s,
         uint32_t fill, int64_t slack = 8)
      : dtype_(dtype), B_(B), H_(H), N_(N), D_(D), s_(s) {
    slots_ = (B - 1) * s.batch + (H - 1) * s.head + (N - 1) * s.token + D + slack;
    bytes_.assign(size_t(slots_ * elem_bytes(dtype)), 0);
    for (int64_t i = 0; i < slots_; ++i) set_raw(i, fill);
  }

  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  sage_dtype dtype() const { return dtype_; }
  sage_strides strides() const { return s_; }
  int64_t slots() const { return slots_; }
  sage::ref::TensorView view() const { return {data(), dtype_, s_}; }

  int64_t offset(int64_t b, int64_t h, int64_t n, int64_t d) const {
    return b * s_.batch + h * s_.head + n * s_.token + d;
  }
  double get(int64_t b, int64_t h, int64_t n, int64_t d) const {
    return sage::ref::load_element(data(), dtype_, offset(b, h, n, d));
  }
  void set(int64_t b, int64_t h, int64_t n, int64_t d, double x) {
    sage::ref::store_element(data(), dtype_, offset(b, h, n, d), x);
  }
  uint32_t raw(int64_t slot) const {
    uint32_t w = 0;
    if (dtype_ == SAGE_DTYPE_FP32) {
      std::memcpy(&w, &bytes_[size_t(slot) * 4], 4);
    } else {
      uint16_t h = 0;
      std::memcpy(&h, &bytes_[size_t(slot) * 2], 2);
      w = h;
    }
    return w;
  }
  void set_raw(int64_t slot, uint32_t bits) {
    if (dtype_ == SAGE_DTYPE_FP32) {
      std::memcpy(&bytes_[size_t(slot) * 4], &bits, 4);
    } else {
      const uint16_t h = uint16_t(bits);
      std::memcpy(&bytes_[size_t(slot) * 2], &h, 2);
    }
  }

  // Raw bits of every element in [B, H, N, D] order: compares tensors stored in any strides.
  std::vector<uint32_t> elements() const {
    std::vector<uint32_t> e;
    e.reserve(size_t(B_ * H_ * N_ * D_));
    for (int64_t b = 0; b < B_; ++b)
      for (int64_t h = 0; h < H_; ++h)
        for (int64_t n = 0; n < N_; ++n)
          for (int64_t d = 0; d < D_; ++d) e.push_back(raw(offset(b, h, n, d)));
    return e;
  }
  std::vector<double> values() const {
    std::vector<double> e;
    e.reserve(size_t(B_ * H_ * N_ * D_));
    for (int64_t b = 0; b < B_; ++b)
      for (int64_t h = 0; h < H_; ++h)
        for (int64_t n = 0; n < N_; ++n)
          for (int64_t d = 0; d < D_; ++d) e.push_back(get(b, h, n, d));
    return e;
  }
  // How many slots that are not elements (padding, slack) no longer hold `fill`.
  int64_t padding_changed(uint32_t fill) const {
    std::vector<char> element(size_t(slots_), 0);
    for (int64_t b = 0; b < B_; ++b)
      for (int64_t h = 0; h < H_; ++h)
        for (int64_t n = 0; n < N_; ++n)
          for (int64_t d = 0; d < D_; ++d) element[size_t(offset(b, h, n, d))] = 1;
    int64_t changed = 0;
    for (int64_t i = 0; i < slots_; ++i) changed += !element[size_t(i)] && raw(i) != fill;
    return changed;
  }
  const std::vector<unsigned char>& bytes() const { return bytes_; }

 private:
  sage_dtype dtype_ = SAGE_DTYPE_FP32;
  int64_t B_ = 0, H_ = 0, N_ = 0, D_ = 0, slots_ = 0;
  sage_strides s_{0, 0, 0};
  std::vector<unsigned char> bytes_;
};

// ---------------------------------------------------------------------------------------------
// Problems, inputs, calls.

struct Problem {
  int64_t B = 1, Hq = 2, Hkv = 2, Nq = 33, Nk = 47, D = 64;
  sage_dtype dtype = SAGE_DTYPE_FP32;
  sage_mask mask = SAGE_MASK_NONE;
  sage_variant variant = SAGE_VARIANT_EXACT;
  float scale = 0.0f;
  bool lse = true;

  double resolved_scale() const {
    return scale != 0.0f ? double(scale) : 1.0 / std::sqrt(double(D));
  }
  sage::ref::Problem ref() const { return {B, Hq, Hkv, Nq, Nk, D, resolved_scale(), mask}; }
  std::string str() const {
    char s[200];
    std::snprintf(s, sizeof(s),
                  "B=%lld Hq=%lld Hkv=%lld Nq=%lld Nk=%lld D=%lld %s mask=%d variant=%d",
                  (long long)B, (long long)Hq, (long long)Hkv, (long long)Nq, (long long)Nk,
                  (long long)D, dtype_name(dtype), int(mask), int(variant));
    return s;
  }
};

// Logical inputs [B, H, N, D] before rounding to the dtype; a per-channel bias (larger on K, as
// in real models) so that smoothing and quantization have something to do.
struct Inputs {
  std::vector<double> q, k, v;
};

Inputs random_inputs(const Problem& p, std::mt19937_64& rng) {
  std::normal_distribution<double> n01(0.0, 1.0);
  auto make = [&](int64_t H, int64_t N, double bias_std) {
    std::vector<double> bias(size_t(p.D));
    for (double& b : bias) b = bias_std * n01(rng);
    std::vector<double> x(size_t(p.B * H * N * p.D));
    for (size_t i = 0; i < x.size(); ++i) x[i] = bias[i % size_t(p.D)] + n01(rng);
    return x;
  };
  Inputs in;
  in.q = make(p.Hq, p.Nq, 1.0);
  in.k = make(p.Hkv, p.Nk, 3.0);
  in.v = make(p.Hkv, p.Nk, 1.0);
  return in;
}

struct Layouts {
  Layout q, k, v, o, lse;
};
Layouts uniform(Layout l) {
  return {l, l, l, l, l};
}

// One sage_attention call with its buffers. Move-only use: args point into the tensors' storage.
struct Call {
  Problem p;
  Tensor q, k, v, o, lse;
  sage_attention_args args{};
};

Tensor input_tensor(const Problem& p, const std::vector<double>& x, int64_t H, int64_t N,
                    Layout l) {
  Tensor t(p.dtype, p.B, H, N, p.D, strides_for(l, p.B, H, N, p.D), nan_bits(p.dtype));
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t d = 0; d < p.D; ++d)
          t.set(b, h, n, d, x[size_t(((b * H + h) * N + n) * p.D + d)]);
  return t;
}

Call make_call(const Problem& p, const Inputs& in, const Layouts& l) {
  Call c;
  c.p = p;
  c.q = input_tensor(p, in.q, p.Hq, p.Nq, l.q);
  c.k = input_tensor(p, in.k, p.Hkv, p.Nk, l.k);
  c.v = input_tensor(p, in.v, p.Hkv, p.Nk, l.v);
  c.o = Tensor(p.dtype, p.B, p.Hq, p.Nq, p.D, strides_for(l.o, p.B, p.Hq, p.Nq, p.D),
               poison_bits(p.dtype));
  if (p.lse)
    c.lse = Tensor(SAGE_DTYPE_FP32, p.B, p.Hq, p.Nq, 1,
                   strides_for(l.lse, p.B, p.Hq, p.Nq, 1, /*lse=*/true), kLsePoison);

  sage_attention_args& a = c.args;
  EXPECT_EQ(sage_attention_args_init(&a), SAGE_OK);
  a.q = c.q.data();
  a.k = c.k.data();
  a.v = c.v.data();
  a.o = c.o.data();
  a.lse = p.lse ? static_cast<float*>(c.lse.data()) : nullptr;
  a.batch = p.B;
  a.heads_q = p.Hq;
  a.heads_kv = p.Hkv;
  a.seq_q = p.Nq;
  a.seq_kv = p.Nk;
  a.head_dim = p.D;
  a.dtype = p.dtype;
  a.mask = p.mask;
  a.variant = p.variant;
  a.scale = p.scale;
  a.layout = SAGE_LAYOUT_HND;
  for (Layout x : {l.q, l.k, l.v, l.o})
    if (x == Layout::kNhdDefault) a.layout = SAGE_LAYOUT_NHD;
  auto strides = [](Layout x, const Tensor& t) {
    return is_default(x) ? sage_strides{0, 0, 0} : t.strides();
  };
  a.q_strides = strides(l.q, c.q);
  a.k_strides = strides(l.k, c.k);
  a.v_strides = strides(l.v, c.v);
  a.o_strides = strides(l.o, c.o);
  if (p.lse) a.lse_strides = strides(l.lse, c.lse);
  return c;
}

// Runs a call that must succeed: status OK, the last error (set on purpose before) cleared,
// inputs byte-identical afterwards, no padding or slack of o and lse written.
void run_ok(Call& c) {
  const std::vector<unsigned char> q0 = c.q.bytes(), k0 = c.k.bytes(), v0 = c.v.bytes();
  ASSERT_NE(sage_attention(nullptr), SAGE_OK);
  ASSERT_STRNE(sage_last_error(), "");
  const sage_status st = sage_attention(&c.args);
  ASSERT_EQ(st, SAGE_OK) << sage_last_error();
  EXPECT_STREQ(sage_last_error(), "") << "a successful call must clear the last error";
  EXPECT_TRUE(c.q.bytes() == q0) << "q was modified";
  EXPECT_TRUE(c.k.bytes() == k0) << "k was modified";
  EXPECT_TRUE(c.v.bytes() == v0) << "v was modified";
  EXPECT_EQ(c.o.padding_changed(poison_bits(c.p.dtype)), 0) << "o written outside its elements";
  if (c.p.lse) {
    EXPECT_EQ(c.lse.padding_changed(kLsePoison), 0) << "lse written outside its elements";
  }
}

// ---------------------------------------------------------------------------------------------
// An independent float64 attention (no library code) over the inputs as stored.

int64_t visible_keys(const Problem& p, int64_t i) {
  int64_t n = p.Nk;
  if (p.mask == SAGE_MASK_CAUSAL_TOP_LEFT) n = i + 1;
  if (p.mask == SAGE_MASK_CAUSAL_BOTTOM_RIGHT) n = i + 1 + p.Nk - p.Nq;
  return std::max<int64_t>(0, std::min(n, p.Nk));
}

struct Expected {
  std::vector<double> o, lse;  // [B, Hq, Nq, D], [B, Hq, Nq]
};

Expected naive_attention(const Call& c) {
  const Problem& p = c.p;
  Expected e;
  e.o.assign(size_t(p.B * p.Hq * p.Nq * p.D), 0.0);
  e.lse.assign(size_t(p.B * p.Hq * p.Nq), -kInf);
  const double scale = p.resolved_scale();
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.Hq; ++h) {
      const int64_t hk = h / (p.Hq / p.Hkv);
      for (int64_t i = 0; i < p.Nq; ++i) {
        const int64_t n = visible_keys(p, i), row = (b * p.Hq + h) * p.Nq + i;
        if (n == 0) continue;
        std::vector<double> s(static_cast<size_t>(n));
        double m = -kInf;
        for (int64_t j = 0; j < n; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < p.D; ++d) dot += c.q.get(b, h, i, d) * c.k.get(b, hk, j, d);
          s[size_t(j)] = scale * dot;
          m = std::max(m, s[size_t(j)]);
        }
        double l = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double w = std::exp(s[size_t(j)] - m);
          l += w;
          for (int64_t d = 0; d < p.D; ++d) e.o[size_t(row * p.D + d)] += w * c.v.get(b, hk, j, d);
        }
        for (int64_t d = 0; d < p.D; ++d) e.o[size_t(row * p.D + d)] /= l;
        e.lse[size_t(row)] = m + std::log(l);
      }
    }
  return e;
}

// Largest |x - ref| / (1 + |ref|) over finite refs; both infinite and equal counts as 0.
double max_rel_error(const std::vector<double>& x, const std::vector<double>& ref) {
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(ref[i]) && x[i] == ref[i]) continue;
    const double e = std::fabs(x[i] - ref[i]) / (1.0 + std::fabs(ref[i]));
    worst = std::isnan(e) ? kInf : std::max(worst, e);
  }
  return worst;
}

// Largest |x - ref|; both infinite and equal counts as 0.
double max_abs_error(const std::vector<double>& x, const std::vector<double>& ref) {
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(ref[i]) && x[i] == ref[i]) continue;
    const double e = std::fabs(x[i] - ref[i]);
    worst = std::isnan(e) ? kInf : std::max(worst, e);
  }
  return worst;
}

double cosine(const std::vector<double>& a, const std::vector<double>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

// Index of the first difference of two equally long vectors, or -1.
template <typename T>
int64_t first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return int64_t(i);
  return -1;
}

bool same_quant(const sage_quant_config& a, const sage_quant_config& b) {
  return a.qk_format == b.qk_format && a.granularity == b.granularity && a.smooth == b.smooth &&
         a.pv_format == b.pv_format && a.v_scale == b.v_scale && a.pv_accum == b.pv_accum &&
         a.pv_flush_interval == b.pv_flush_interval &&
         a.accum_mantissa_bits == b.accum_mantissa_bits && a.accum_chunk == b.accum_chunk &&
         a.block_q == b.block_q && a.block_k == b.block_k && a.warps == b.warps &&
         a.k_mean_tokens == b.k_mean_tokens;
}

sage_quant_config preset(sage_variant v) {
  sage_quant_config c{};
  EXPECT_EQ(sage_quant_config_init(&c, v), SAGE_OK) << sage_last_error();
  return c;
}

// =============================================================================================
// ApiInfo: version, status strings, initialisers, workspace size, the last-error contract.

TEST(ApiInfo, VersionStringMatchesNumbers) {
  int major = -1, minor = -1, patch = -1;
  sage_version_numbers(&major, &minor, &patch);
  EXPECT_EQ(major, SAGE_VERSION_MAJOR);
  EXPECT_EQ(minor, SAGE_VERSION_MINOR);
  EXPECT_EQ(patch, SAGE_VERSION_PATCH);
  char expected[64];
  std::snprintf(expected, sizeof(expected), "%d.%d.%d", major, minor, patch);
  ASSERT_NE(sage_version(), nullptr);
  EXPECT_STREQ(sage_version(), expected);
  sage_version_numbers(nullptr, nullptr, nullptr);  // each output is optional
  int only_minor = -1;
  sage_version_numbers(nullptr, &only_minor, nullptr);
  EXPECT_EQ(only_minor, SAGE_VERSION_MINOR);
}

TEST(ApiInfo, EveryStatusHasItsOwnString) {
  const sage_status all[] = {SAGE_OK,
                             SAGE_ERROR_INVALID_ARGUMENT,
                             SAGE_ERROR_UNSUPPORTED,
                             SAGE_ERROR_CUDA,
                             SAGE_ERROR_OUT_OF_MEMORY,
                             SAGE_ERROR_WORKSPACE_TOO_SMALL,
                             SAGE_ERROR_INTERNAL};
  std::vector<std::string> seen;
  for (sage_status s : all) {
    const char* text = sage_status_string(s);
    ASSERT_NE(text, nullptr) << "status " << int(s);
    EXPECT_STRNE(text, "") << "status " << int(s);
    EXPECT_EQ(std::count(seen.begin(), seen.end(), std::string(text)), 0)
        << "status " << int(s) << " shares its string \"" << text << "\"";
    seen.push_back(text);
  }
  // 7 is a value of the type (enumerators 0..6 fill three bits) without a name; passing a value
  // outside the type's range would be undefined behaviour in C++ before the library sees it.
  for (int unknown : {7}) {
    sage_status s;
    set_enum(s, unknown);
    const char* text = sage_status_string(s);
    ASSERT_NE(text, nullptr);
    EXPECT_STRNE(text, "");
    EXPECT_EQ(std::count(seen.begin(), seen.end(), std::string(text)), 0) << unknown;
  }
}

TEST(ApiInfo, ArgsInitDefaults) {
  sage_attention_args a;
  std::memset(&a, 0xAB, sizeof(a));
  ASSERT_EQ(sage_attention_args_init(&a), SAGE_OK);
  EXPECT_EQ(a.struct_size, sizeof(sage_attention_args));
  EXPECT_EQ(a.q, nullptr);
  EXPECT_EQ(a.k, nullptr);
  EXPECT_EQ(a.v, nullptr);
  EXPECT_EQ(a.o, nullptr);
  EXPECT_EQ(a.lse, nullptr);
  for (int64_t size : {a.batch, a.heads_q, a.heads_kv, a.seq_q, a.seq_kv, a.head_dim})
    EXPECT_EQ(size, 0);
  EXPECT_EQ(a.layout, SAGE_LAYOUT_HND);
  for (const sage_strides& s :
       {a.q_strides, a.k_strides, a.v_strides, a.o_strides, a.lse_strides}) {
    EXPECT_EQ(s.batch, 0);
    EXPECT_EQ(s.head, 0);
    EXPECT_EQ(s.token, 0);
  }
  EXPECT_EQ(a.dtype, SAGE_DTYPE_FP16);
  EXPECT_EQ(a.scale, 0.0f);
  EXPECT_EQ(a.mask, SAGE_MASK_NONE);
  EXPECT_EQ(a.variant, SAGE_VARIANT_AUTO);
  EXPECT_EQ(a.backend, SAGE_BACKEND_AUTO);
  EXPECT_EQ(a.stream, nullptr);
  EXPECT_EQ(a.workspace, nullptr);
  EXPECT_EQ(a.workspace_size, 0u);
  EXPECT_EQ(a.num_threads, 0);
  EXPECT_TRUE(same_quant(a.quant, preset(SAGE_VARIANT_SAGE2_8B)));

  EXPECT_EQ(sage_attention_args_init(nullptr), SAGE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(names_word(sage_last_error(), "args")) << sage_last_error();
}

TEST(ApiInfo, QuantConfigPresets) {
  const sage_variant presets[] = {SAGE_VARIANT_AUTO, SAGE_VARIANT_SAGE2_8B, SAGE_VARIANT_SAGE2_4B,
                                  SAGE_VARIANT_EXACT, SAGE_VARIANT_SAGE3_FP4};
  for (sage_variant v : presets) {
    SCOPED_TRACE(int(v));
    sage_quant_config c;
    std::memset(&c, 0xCD, sizeof(c));
    ASSERT_EQ(sage_quant_config_init(&c, v), SAGE_OK) << sage_last_error();
    EXPECT_STREQ(sage_last_error(), "");
    EXPECT_EQ(sage::ref::quant_config_error(c), "") << "a preset must be a valid CUSTOM config";
    EXPECT_TRUE(same_quant(c, sage::ref::quant_preset(v)));
  }
  // AUTO is the SAGE2_8B emulation on the CPU.
  EXPECT_TRUE(same_quant(preset(SAGE_VARIANT_AUTO), preset(SAGE_VARIANT_SAGE2_8B)));

  const sage_quant_config s8 = preset(SAGE_VARIANT_SAGE2_8B);
  EXPECT_EQ(s8.qk_format, SAGE_QK_INT8);
  EXPECT_EQ(s8.smooth, SAGE_SMOOTH_K | SAGE_SMOOTH_V);
  EXPECT_EQ(s8.pv_format, SAGE_PV_FP8_E4M3);
  EXPECT_EQ(s8.v_scale, SAGE_V_SCALE_PER_CHANNEL);
  EXPECT_EQ(s8.pv_accum, SAGE_PV_ACCUM_TWO_LEVEL);
  EXPECT_GE(s8.pv_flush_interval, 1);
  EXPECT_EQ(s8.k_mean_tokens, 256);
  const sage_quant_config s4 = preset(SAGE_VARIANT_SAGE2_4B);
  EXPECT_EQ(s4.qk_format, SAGE_QK_INT4);
  EXPECT_EQ(s4.smooth, SAGE_SMOOTH_Q | SAGE_SMOOTH_K | SAGE_SMOOTH_V);
  EXPECT_EQ(s4.pv_format, SAGE_PV_FP8_E4M3);
  EXPECT_EQ(s4.v_scale, SAGE_V_SCALE_PER_CHANNEL);
  EXPECT_EQ(s4.pv_accum, SAGE_PV_ACCUM_TWO_LEVEL);
  EXPECT_EQ(s4.k_mean_tokens, 256);
  const sage_quant_config ex = preset(SAGE_VARIANT_EXACT);
  EXPECT_EQ(ex.qk_format, SAGE_QK_NONE);
  EXPECT_EQ(ex.pv_format, SAGE_PV_NONE);
  const sage_quant_config f4 = preset(SAGE_VARIANT_SAGE3_FP4);  // SageAttention3, Algorithm 1
  EXPECT_EQ(f4.qk_format, SAGE_QK_NVFP4);
  EXPECT_EQ(f4.smooth, SAGE_SMOOTH_Q | SAGE_SMOOTH_K);
  EXPECT_EQ(f4.pv_format, SAGE_PV_NVFP4);
  EXPECT_EQ(f4.pv_accum, SAGE_PV_ACCUM_FP32);
  EXPECT_EQ(f4.accum_chunk, 64);

  // Errors: NULL config, unknown variant; the config is left as it was.
  EXPECT_EQ(sage_quant_config_init(nullptr, SAGE_VARIANT_SAGE2_8B), SAGE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(names_word(sage_last_error(), "config")) << sage_last_error();
  for (int bad : {6, 7, 8}) {  // values of the type without a name (see the status test)
    sage_quant_config c = s4, before = s4;
    sage_variant v;
    set_enum(v, bad);
    EXPECT_EQ(sage_quant_config_init(&c, v), SAGE_ERROR_INVALID_ARGUMENT) << bad;
    EXPECT_TRUE(names_word(sage_last_error(), "variant")) << sage_last_error();
    EXPECT_TRUE(same_quant(c, before)) << "config written on error";
  }
}

TEST(ApiInfo, WorkspaceSizeIsZeroOnCpu) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  Problem p;
  p.dtype = SAGE_DTYPE_FP16;
  Call c = make_call(p, random_inputs(p, rng), uniform(Layout::kHndDefault));
  for (sage_backend b : {SAGE_BACKEND_AUTO, SAGE_BACKEND_CPU}) {
    c.args.backend = b;
    size_t bytes = 12345;
    EXPECT_EQ(sage_attention_workspace_size(&c.args, &bytes), SAGE_OK) << sage_last_error();
    EXPECT_EQ(bytes, 0u);
    EXPECT_STREQ(sage_last_error(), "");
  }
  EXPECT_EQ(sage_attention_workspace_size(&c.args, nullptr), SAGE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(names_word(sage_last_error(), "bytes")) << sage_last_error();
  size_t bytes = 0;
  EXPECT_EQ(sage_attention_workspace_size(nullptr, &bytes), SAGE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(names_word(sage_last_error(), "args")) << sage_last_error();
  EXPECT_EQ(c.o.padding_changed(poison_bits(p.dtype)), 0);
  EXPECT_TRUE(c.o.bytes() ==
              Tensor(p.dtype, p.B, p.Hq, p.Nq, p.D, c.o.strides(), poison_bits(p.dtype)).bytes())
      << "the workspace query wrote o";
}

TEST(ApiInfo, SuccessClearsTheLastError) {
  auto fail = [] {
    ASSERT_EQ(sage_attention(nullptr), SAGE_ERROR_INVALID_ARGUMENT);
    ASSERT_STRNE(sage_last_error(), "");
  };
  sage_attention_args a;
  fail();
  ASSERT_EQ(sage_attention_args_init(&a), SAGE_OK);
  EXPECT_STREQ(sage_last_error(), "");
  sage_quant_config c;
  fail();
  ASSERT_EQ(sage_quant_config_init(&c, SAGE_VARIANT_SAGE2_4B), SAGE_OK);
  EXPECT_STREQ(sage_last_error(), "");
  // sage_attention itself: run_ok sets an error first and checks that success clears it.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  Problem p;
  Call call = make_call(p, random_inputs(p, rng), uniform(Layout::kHnd));
  ASSERT_NO_FATAL_FAILURE(run_ok(call));
  fail();
  size_t bytes = 1;
  ASSERT_EQ(sage_attention_workspace_size(&call.args, &bytes), SAGE_OK);
  EXPECT_STREQ(sage_last_error(), "");
}

TEST(ApiInfo, LastErrorIsPerThread) {
  sage_attention_args a;
  ASSERT_EQ(sage_attention_args_init(&a), SAGE_OK);  // clears this thread's message
  std::string other_message;
  sage_status other_status = SAGE_OK;
  std::thread t([&] {
    other_status = sage_attention(nullptr);
    other_message = sage_last_error();
  });
  t.join();
  EXPECT_EQ(other_status, SAGE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(names_word(other_message, "args")) << other_message;
  EXPECT_STREQ(sage_last_error(), "") << "another thread's failure leaked into this thread";
}

// =============================================================================================
// ApiErrors: every bad argument gives its status, a message naming the argument, and leaves
// q, k, v, o and lse byte-identical. sage_attention_workspace_size must agree.

class ApiErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = fresh_seed();
    std::mt19937_64 rng(seed_);
    p_.B = 2;
    p_.Hq = p_.Hkv = 2;
    p_.Nq = p_.Nk = 24;
    p_.D = 64;
    p_.dtype = SAGE_DTYPE_FP16;
    c_ = make_call(p_, random_inputs(p_, rng), uniform(Layout::kHndDefault));
  }

  // Runs `mutate`d valid args; expects one of `statuses` and a message naming every word.
  void expect_rejected(const std::string& what,
                       const std::function<void(sage_attention_args&)>& mutate,
                       std::vector<std::string> words,
                       std::vector<sage_status> statuses = {SAGE_ERROR_INVALID_ARGUMENT}) {
    SCOPED_TRACE(seed_message(seed_));
    SCOPED_TRACE(what);
    size_t bytes = 1;
    ASSERT_EQ(sage_attention_workspace_size(&c_.args, &bytes), SAGE_OK)
        << "the unmutated args must be valid: " << sage_last_error();
    ASSERT_STREQ(sage_last_error(), "");
    const std::vector<unsigned char> q0 = c_.q.bytes(), k0 = c_.k.bytes(), v0 = c_.v.bytes(),
                                     o0 = c_.o.bytes(), lse0 = c_.lse.bytes();
    sage_attention_args a = c_.args;
    mutate(a);
    const sage_status st = sage_attention(&a);
    const std::string msg = sage_last_error();
    EXPECT_NE(std::find(statuses.begin(), statuses.end(), st), statuses.end())
        << "status " << int(st) << " (" << sage_status_string(st) << "), message \"" << msg << "\"";
    EXPECT_NE(st, SAGE_OK);
    EXPECT_FALSE(msg.empty()) << "an error without a message";
    for (const std::string& w : words)
      EXPECT_TRUE(names_word(msg, w)) << "message \"" << msg << "\" does not name " << w;
    EXPECT_TRUE(c_.q.bytes() == q0) << "q modified";
    EXPECT_TRUE(c_.k.bytes() == k0) << "k modified";
    EXPECT_TRUE(c_.v.bytes() == v0) << "v modified";
    EXPECT_TRUE(c_.o.bytes() == o0) << "o written on error";
    EXPECT_TRUE(c_.lse.bytes() == lse0) << "lse written on error";
    // The workspace query validates the same way.
    bytes = 777;
    EXPECT_EQ(sage_attention_workspace_size(&a, &bytes), st);
    EXPECT_EQ(std::string(sage_last_error()), msg);
  }

  // Explicit contiguous HND strides of a tensor with H heads and N tokens.
  sage_strides hnd(int64_t H, int64_t N) const {
    return strides_for(Layout::kHnd, p_.B, H, N, p_.D);
  }

  uint64_t seed_ = 0;
  Problem p_;
  Call c_;
};

TEST_F(ApiErrors, NullArgsAndStructSize) {
  ASSERT_EQ(sage_attention(nullptr), SAGE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(names_word(sage_last_error(), "args")) << sage_last_error();
  for (size_t size : {size_t(0), size_t(1), sizeof(sage_attention_args) - 8,
                      sizeof(sage_attention_args) + 8, size_t(-1)})
    expect_rejected("struct_size " + std::to_string(size),
                    [&](sage_attention_args& a) { a.struct_size = size; }, {"struct_size"});
}

TEST_F(ApiErrors, NullTensors) {
  expect_rejected("q NULL", [](sage_attention_args& a) { a.q = nullptr; }, {"q"});
  expect_rejected("k NULL", [](sage_attention_args& a) { a.k = nullptr; }, {"k"});
  expect_rejected("v NULL", [](sage_attention_args& a) { a.v = nullptr; }, {"v"});
  expect_rejected("o NULL", [](sage_attention_args& a) { a.o = nullptr; }, {"o"});
}

TEST_F(ApiErrors, Sizes) {
  struct Case {
    const char* name;
    int64_t sage_attention_args::*field;
  };
  const Case cases[] = {
      {"batch", &sage_attention_args::batch},       {"heads_q", &sage_attention_args::heads_q},
      {"heads_kv", &sage_attention_args::heads_kv}, {"seq_q", &sage_attention_args::seq_q},
      {"seq_kv", &sage_attention_args::seq_kv},     {"head_dim", &sage_attention_args::head_dim}};
  for (const Case& c : cases)
    for (int64_t bad : {int64_t(0), int64_t(-1), std::numeric_limits<int64_t>::min()})
      expect_rejected(std::string(c.name) + " = " + std::to_string(bad),
                      [&](sage_attention_args& a) { a.*c.field = bad; }, {c.name});
  // Above 256, the largest head dim a GPU kernel is planned for, the CPU reference refuses too,
  // naming the head dims the GPU has (forward and backward).
  for (int64_t bad : {int64_t(257), int64_t(513), int64_t(1) << 20,
                      std::numeric_limits<int64_t>::max()})
    expect_rejected("head_dim = " + std::to_string(bad),
                    [&](sage_attention_args& a) { a.head_dim = bad; },
                    {"head_dim", "1..256", "multiples of 8 from 8 to 256", "64, 128"});
  // GQA needs heads_q % heads_kv == 0.
  expect_rejected("heads_q 2, heads_kv 4", [](sage_attention_args& a) { a.heads_kv = 4; },
                  {"heads_q", "heads_kv"});
  expect_rejected("heads_q 3, heads_kv 2", [](sage_attention_args& a) { a.heads_q = 3; },
                  {"heads_q", "heads_kv"});
}

TEST_F(ApiErrors, UnknownEnums) {
  for (int bad : {3, -1, 1000})
    expect_rejected("dtype " + std::to_string(bad),
                    [&](sage_attention_args& a) { set_enum(a.dtype, bad); }, {"dtype"});
  for (int bad : {2, -1, 77})
    expect_rejected("layout " + std::to_string(bad),
                    [&](sage_attention_args& a) { set_enum(a.layout, bad); }, {"layout"});
  for (int bad : {3, -1})
    expect_rejected("mask " + std::to_string(bad),
                    [&](sage_attention_args& a) { set_enum(a.mask, bad); }, {"mask"});
  for (int bad : {6, -1})
    expect_rejected("variant " + std::to_string(bad),
                    [&](sage_attention_args& a) { set_enum(a.variant, bad); }, {"variant"});
  for (int bad : {3, -1})
    expect_rejected("backend " + std::to_string(bad),
                    [&](sage_attention_args& a) { set_enum(a.backend, bad); }, {"backend"});
}

TEST_F(ApiErrors, NonFiniteScaleAndNegativeThreads) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()})
    expect_rejected("scale " + std::to_string(bad), [&](sage_attention_args& a) { a.scale = bad; },
                    {"scale"});
  for (int32_t bad : {-1, std::numeric_limits<int32_t>::min()})
    expect_rejected("num_threads " + std::to_string(bad),
                    [&](sage_attention_args& a) { a.num_threads = bad; }, {"num_threads"});
}

TEST_F(ApiErrors, NegativeStrides) {
  const sage_strides q = hnd(p_.Hq, p_.Nq), kv = hnd(p_.Hkv, p_.Nk);
  const sage_strides lse{p_.Hq * p_.Nq, p_.Nq, 1};
  struct Case {
    const char* name;
    sage_strides sage_attention_args::*field;
    sage_strides good;
  };
  const Case cases[] = {{"q_strides", &sage_attention_args::q_strides, q},
                        {"k_strides", &sage_attention_args::k_strides, kv},
                        {"v_strides", &sage_attention_args::v_strides, kv},
                        {"o_strides", &sage_attention_args::o_strides, q},
                        {"lse_strides", &sage_attention_args::lse_strides, lse}};
  for (const Case& c : cases)
    for (int which = 0; which < 3; ++which) {
      sage_strides s = c.good;
      int64_t* component = which == 0 ? &s.batch : which == 1 ? &s.head : &s.token;
      *component = -*component;
      expect_rejected(std::string(c.name) + " component " + std::to_string(which) + " negative",
                      [&](sage_attention_args& a) { a.*c.field = s; }, {c.name});
    }
}

TEST_F(ApiErrors, OutputStridesThatOverlap) {
  const sage_strides o = hnd(p_.Hq, p_.Nq);
  const int64_t D = p_.D, N = p_.Nq, H = p_.Hq;
  const sage_strides bad_o[] = {
      {o.batch, o.head, D - 1},   // token stride shorter than a row
      {o.batch, o.head, 0},       // every token on the same row
      {o.batch, 0, o.token},      // every head on the same matrix
      {0, o.head, o.token},       // every batch on the same tensor
      {o.head, o.head, o.token},  // batch and head collide
      {o.batch, (N - 1) * D, D},  // head h's last token is head h+1's first
      {H * N * D - 1, N * D, D},  // batches overlap by one element
  };
  for (const sage_strides& s : bad_o)
    expect_rejected("o_strides {" + std::to_string(s.batch) + ", " + std::to_string(s.head) + ", " +
                        std::to_string(s.token) + "}",
                    [&](sage_attention_args& a) { a.o_strides = s; }, {"o_strides"});
  const sage_strides bad_lse[] = {{H * N, N, 0}, {H * N, 0, 1}, {0, N, 1}, {N, N, 1}};
  for (const sage_strides& s : bad_lse)
    expect_rejected("lse_strides {" + std::to_string(s.batch) + ", " + std::to_string(s.head) +
                        ", " + std::to_string(s.token) + "}",
                    [&](sage_attention_args& a) { a.lse_strides = s; }, {"lse_strides"});
}

TEST_F(ApiErrors, OutputOverlapsAnInput) {
  expect_rejected("o == q", [](sage_attention_args& a) { a.o = const_cast<void*>(a.q); },
                  {"o", "q"});
  expect_rejected("o == k", [](sage_attention_args& a) { a.o = const_cast<void*>(a.k); },
                  {"o", "k"});
  expect_rejected("o == v", [](sage_attention_args& a) { a.o = const_cast<void*>(a.v); },
                  {"o", "v"});
  // With half the tokens, q and o each span half of q's buffer: o starting in the middle of q's
  // span stays inside q's buffer (memory-safe even if the check were missing).
  const size_t quarter = size_t(p_.B * p_.Hq * p_.Nq * p_.D) / 4 * 2;  // bytes (fp16)
  expect_rejected("o inside q",
                  [&](sage_attention_args& a) {
                    a.seq_q = p_.Nq / 2;
                    a.o = static_cast<char*>(const_cast<void*>(a.q)) + quarter;
                  },
                  {"o", "q"});
  const size_t half = 2 * quarter;
  // lse must overlap nothing either.
  expect_rejected("lse == o", [](sage_attention_args& a) { a.lse = static_cast<float*>(a.o); },
                  {"lse", "o"});
  expect_rejected(
      "lse == q",
      [](sage_attention_args& a) { a.lse = static_cast<float*>(const_cast<void*>(a.q)); },
      {"lse", "q"});
  expect_rejected("lse inside v",
                  [&](sage_attention_args& a) {
                    a.lse =
                        reinterpret_cast<float*>(static_cast<char*>(const_cast<void*>(a.v)) + half);
                  },
                  {"lse", "v"});
}

TEST_F(ApiErrors, MisalignedPointers) {
  auto shift = [](const void* p, int bytes) {
    return static_cast<char*>(const_cast<void*>(p)) + bytes;
  };
  expect_rejected("q + 1 byte", [&](sage_attention_args& a) { a.q = shift(a.q, 1); }, {"q"});
  expect_rejected("k + 1 byte", [&](sage_attention_args& a) { a.k = shift(a.k, 1); }, {"k"});
  expect_rejected("v + 1 byte", [&](sage_attention_args& a) { a.v = shift(a.v, 1); }, {"v"});
  expect_rejected("o + 1 byte", [&](sage_attention_args& a) { a.o = shift(a.o, 1); }, {"o"});
  expect_rejected(
      "lse + 2 bytes",
      [&](sage_attention_args& a) { a.lse = reinterpret_cast<float*>(shift(a.lse, 2)); }, {"lse"});
  // fp32 needs 4-byte alignment: 2 bytes off is misaligned (the buffers are big enough for fp32
  // only in the first half; validation must reject before reading anything).
  expect_rejected("fp32 q + 2 bytes",
                  [&](sage_attention_args& a) {
                    a.dtype = SAGE_DTYPE_FP32;
                    a.seq_q = a.seq_kv = p_.Nq / 2;
                    a.q = shift(a.q, 2);
                  },
                  {"q"});
}

TEST_F(ApiErrors, OffsetsThatOverflow64Bits) {
  expect_rejected("q token stride 2^61",
                  [](sage_attention_args& a) {
                    a.q_strides = {0, 0, int64_t(1) << 61};
                    a.batch = 1;
                    a.heads_q = a.heads_kv = 1;
                  },
                  {"q"});
  expect_rejected("o head stride 2^62",
                  [&](sage_attention_args& a) {
                    a.o_strides = {int64_t(1) << 62, int64_t(1) << 61, p_.D};
                  },
                  {"o"});
}

// Sizes whose element count does not fit in 64 bits, with the strides left at zero (so the library
// derives them): rejected, with a message about the tensor, not about strides the caller never set.
TEST_F(ApiErrors, HugeSizesWithDefaultStrides) {
  for (int shift : {57, 58, 62})
    expect_rejected("seq_q = 2^" + std::to_string(shift),
                    [&](sage_attention_args& a) { a.seq_q = int64_t(1) << shift; }, {"q"});
  for (int shift : {57, 61})
    expect_rejected("seq_kv = 2^" + std::to_string(shift) + ", NHD",
                    [&](sage_attention_args& a) {
                      a.layout = SAGE_LAYOUT_NHD;
                      a.seq_kv = int64_t(1) << shift;
                    },
                    {"k"});
}

TEST_F(ApiErrors, InvalidCustomQuantConfig) {
  using Mutation = std::function<void(sage_quant_config&)>;
  struct Case {
    std::string what;
    Mutation mutate;
    std::vector<std::string> words;
  };
  auto enum_case = [](const char* name, auto sage_quant_config::*field, int value) {
    return Case{std::string(name) + " " + std::to_string(value),
                [=](sage_quant_config& q) { set_enum(q.*field, value); },
                {name}};
  };
  std::vector<Case> cases = {
      enum_case("qk_format", &sage_quant_config::qk_format, 6),
      enum_case("qk_format", &sage_quant_config::qk_format, -1),
      enum_case("granularity", &sage_quant_config::granularity, 6),
      enum_case("granularity", &sage_quant_config::granularity, -1),
      enum_case("pv_format", &sage_quant_config::pv_format, 8),
      enum_case("pv_format", &sage_quant_config::pv_format, -1),
      enum_case("v_scale", &sage_quant_config::v_scale, 3),
      enum_case("v_scale", &sage_quant_config::v_scale, -1),
      enum_case("pv_accum", &sage_quant_config::pv_accum, 4),
      enum_case("pv_accum", &sage_quant_config::pv_accum, -1),
      {"smooth unknown bit", [](sage_quant_config& q) { q.smooth = 8; }, {"smooth"}},
      {"block_q 0", [](sage_quant_config& q) { q.block_q = 0; }, {"block_q"}},
      {"block_q 2048", [](sage_quant_config& q) { q.block_q = 2048; }, {"block_q"}},
      {"block_k 0", [](sage_quant_config& q) { q.block_k = 0; }, {"block_k"}},
      {"block_k -64", [](sage_quant_config& q) { q.block_k = -64; }, {"block_k"}},
      {"block_k 4096", [](sage_quant_config& q) { q.block_k = 4096; }, {"block_k"}},
      {"warps 0", [](sage_quant_config& q) { q.warps = 0; }, {"warps"}},
      {"warps 3 (block_q 128)", [](sage_quant_config& q) { q.warps = 3; }, {"warps"}},
      {"warps 256 (block_q 128)", [](sage_quant_config& q) { q.warps = 256; }, {"warps"}},
      {"pv_flush_interval 0",
       [](sage_quant_config& q) { q.pv_flush_interval = 0; },
       {"pv_flush_interval"}},
      {"pv_flush_interval -1",
       [](sage_quant_config& q) { q.pv_flush_interval = -1; },
       {"pv_flush_interval"}},
      {"accum_mantissa_bits 0",
       [](sage_quant_config& q) { q.accum_mantissa_bits = 0; },
       {"accum_mantissa_bits"}},
      {"accum_mantissa_bits 24",
       [](sage_quant_config& q) { q.accum_mantissa_bits = 24; },
       {"accum_mantissa_bits"}},
      {"accum_chunk 0", [](sage_quant_config& q) { q.accum_chunk = 0; }, {"accum_chunk"}},
      {"k_mean_tokens -1", [](sage_quant_config& q) { q.k_mean_tokens = -1; }, {"k_mean_tokens"}},
      // Per-thread MMA groups: block_q / warps must be a multiple of 16; block_k of 8.
      {"per-thread MMA, 8 rows a warp", [](sage_quant_config& q) { q.warps = 16; }, {"block_q"}},
      {"per-thread WGMMA, block_q 40",
       [](sage_quant_config& q) {
         q.granularity = SAGE_GRANULARITY_PER_THREAD_WGMMA;
         q.block_q = 40;
         q.warps = 1;
       },
       {"block_q"}},
      {"per-thread, block_k 60", [](sage_quant_config& q) { q.block_k = 60; }, {"block_k"}},
      // Block V scales need the accumulator flushed every key block.
      {"per-block V scale, flush every 2 blocks",
       [](sage_quant_config& q) {
         q.v_scale = SAGE_V_SCALE_PER_BLOCK_CHANNEL;
         q.pv_accum = SAGE_PV_ACCUM_TWO_LEVEL;
         q.pv_flush_interval = 2;
       },
       {"v_scale", "pv_flush_interval"}},
      {"per-block V scale, HW accumulator",
       [](sage_quant_config& q) {
         q.v_scale = SAGE_V_SCALE_PER_BLOCK_CHANNEL;
         q.pv_accum = SAGE_PV_ACCUM_HW;
       },
       {"v_scale", "pv_accum"}},
      // The power-of-two V scale per block (the preset's) is for E4M3 V only.
      {"power-of-two V scale per block, E5M2",
       [](sage_quant_config& q) {
         q.v_scale = SAGE_V_SCALE_PER_BLOCK;
         q.pv_format = SAGE_PV_FP8_E5M2;
       },
       {"v_scale", "pv_format"}},
  };
  for (const Case& c : cases) {
    expect_rejected(
        "CUSTOM: " + c.what,
        [&](sage_attention_args& a) {
          a.variant = SAGE_VARIANT_CUSTOM;
          a.quant = preset(SAGE_VARIANT_SAGE2_8B);
          c.mutate(a.quant);
        },
        c.words);
    // A preset variant ignores args.quant: the same bad config is no error there.
    sage_attention_args a = c_.args;
    a.variant = SAGE_VARIANT_SAGE2_8B;
    c.mutate(a.quant);
    size_t bytes = 1;
    EXPECT_EQ(sage_attention_workspace_size(&a, &bytes), SAGE_OK)
        << c.what << ": " << sage_last_error();
  }
}

TEST_F(ApiErrors, CudaBackendWithHostPointers) {
  expect_rejected("backend CUDA, host pointers",
                  [](sage_attention_args& a) { a.backend = SAGE_BACKEND_CUDA; }, {"CUDA"},
                  {SAGE_ERROR_INVALID_ARGUMENT, SAGE_ERROR_UNSUPPORTED});
  expect_rejected("backend CUDA, host pointers, EXACT fp32",
                  [](sage_attention_args& a) {
                    a.backend = SAGE_BACKEND_CUDA;
                    a.variant = SAGE_VARIANT_EXACT;
                    a.seq_q = a.seq_kv = 12;
                    a.dtype = SAGE_DTYPE_FP32;
                  },
                  {"CUDA"}, {SAGE_ERROR_INVALID_ARGUMENT, SAGE_ERROR_UNSUPPORTED});
}

// Boundaries of the overlap checks: o (or lse) starting right after an input is fine; one
// element earlier is an overlap.
TEST(ApiErrorsBoundary, AdjacentBuffersAreAcceptedOverlapByOneIsNot) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  Problem p;
  p.B = 1;
  p.Hq = p.Hkv = 2;
  p.Nq = p.Nk = 20;
  const int64_t n = p.B * p.Hq * p.Nq * p.D;  // elements of each of q, k, v, o
  Call c = make_call(p, random_inputs(p, rng), uniform(Layout::kHnd));
  // One buffer: [q | o | lse], contiguous HND.
  std::vector<float> buf(size_t(2 * n + p.B * p.Hq * p.Nq + 1), 0.0f);
  std::copy_n(static_cast<const float*>(c.q.data()), n, buf.begin());
  sage_attention_args a = c.args;
  a.q = buf.data();
  a.o = buf.data() + n;
  a.lse = buf.data() + 2 * n;
  ASSERT_EQ(sage_attention(&a), SAGE_OK) << sage_last_error();
  ASSERT_NO_FATAL_FAILURE(run_ok(c));
  EXPECT_TRUE(
      std::equal(buf.begin() + n, buf.begin() + 2 * n, static_cast<const float*>(c.o.data())));
  const std::vector<float> before = buf;
  a.o = buf.data() + n - 1;
  EXPECT_EQ(sage_attention(&a), SAGE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(names_word(sage_last_error(), "o")) << sage_last_error();
  a.o = buf.data() + n;
  a.lse = buf.data() + 2 * n - 1;
  EXPECT_EQ(sage_attention(&a), SAGE_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(names_word(sage_last_error(), "lse")) << sage_last_error();
  EXPECT_TRUE(buf == before) << "a rejected call wrote memory";
}

// The ends of the head dims any call takes, 1 and 256, run on the CPU reference in the exact and
// a quantized variant (257 is refused: ApiErrors.Sizes).
TEST(ApiErrorsBoundary, HeadDimsOneAnd256RunOnTheCpu) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  for (int64_t d : {int64_t(1), int64_t(256)})
    for (sage_variant variant : {SAGE_VARIANT_EXACT, SAGE_VARIANT_SAGE2_8B}) {
      SCOPED_TRACE("D = " + std::to_string(d));
      Problem p;
      p.Nq = p.Nk = 9;
      p.D = d;
      p.variant = variant;
      Call c = make_call(p, random_inputs(p, rng), uniform(Layout::kHnd));
      ASSERT_NO_FATAL_FAILURE(run_ok(c));
    }
}

// =============================================================================================
// ApiLayouts: the same problem in any layout or strides gives bit-identical o and lse, and the
// API writes nothing but elements.

TEST(ApiLayouts, SameOutputInEveryLayout) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  const std::vector<Layouts> layouts = {
      uniform(Layout::kHndDefault),
      uniform(Layout::kNhdDefault),
      uniform(Layout::kHnd),
      uniform(Layout::kNhd),
      uniform(Layout::kPadded),
      uniform(Layout::kHeadsOuter),
      uniform(Layout::kTransposed),
      {Layout::kPadded, Layout::kHeadsOuter, Layout::kTransposed, Layout::kNhd, Layout::kPadded},
  };
  for (sage_dtype dtype : {SAGE_DTYPE_FP16, SAGE_DTYPE_BF16, SAGE_DTYPE_FP32})
    for (sage_variant variant : {SAGE_VARIANT_EXACT, SAGE_VARIANT_SAGE2_8B}) {
      Problem p;
      p.B = 2;
      p.Hq = 4;
      p.Hkv = 2;
      p.Nq = 70;
      p.Nk = 131;
      p.dtype = dtype;
      p.variant = variant;
      p.mask = SAGE_MASK_CAUSAL_BOTTOM_RIGHT;
      SCOPED_TRACE(p.str());
      const Inputs in = random_inputs(p, rng);
      std::vector<uint32_t> o0, lse0;
      for (const Layouts& l : layouts) {
        SCOPED_TRACE(std::string("o in ") + layout_name(l.o) + ", q in " + layout_name(l.q));
        Call c = make_call(p, in, l);
        ASSERT_NO_FATAL_FAILURE(run_ok(c));
        const std::vector<uint32_t> o = c.o.elements(), lse = c.lse.elements();
        for (double x : c.o.values()) ASSERT_TRUE(std::isfinite(x)) << "non-finite output";
        if (o0.empty()) {
          o0 = o;
          lse0 = lse;
          continue;
        }
        EXPECT_EQ(first_difference(o, o0), -1) << "o differs from the first layout";
        EXPECT_EQ(first_difference(lse, lse0), -1) << "lse differs from the first layout";
      }
    }
}

// Inputs may share memory between indices (stride 0) and with each other; only o must not.
TEST(ApiLayouts, BroadcastAndAliasedInputs) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  for (sage_variant variant : {SAGE_VARIANT_EXACT, SAGE_VARIANT_SAGE2_8B}) {
    SCOPED_TRACE(int(variant));
    // K and V shared by both batches through batch stride 0 == K and V copied per batch.
    Problem p;
    p.B = 2;
    p.Hq = p.Hkv = 2;
    p.Nq = 40;
    p.Nk = 60;
    p.variant = variant;
    Inputs in = random_inputs(p, rng);
    const size_t per_batch = in.k.size() / 2;
    std::copy_n(in.k.begin(), per_batch, in.k.begin() + per_batch);
    std::copy_n(in.v.begin(), per_batch, in.v.begin() + per_batch);
    Call full = make_call(p, in, uniform(Layout::kHnd));
    ASSERT_NO_FATAL_FAILURE(run_ok(full));
    Call shared = make_call(p, in, uniform(Layout::kHnd));
    shared.args.k_strides.batch = 0;
    shared.args.v_strides.batch = 0;
    ASSERT_NO_FATAL_FAILURE(run_ok(shared));
    EXPECT_EQ(first_difference(shared.o.elements(), full.o.elements()), -1);
    EXPECT_EQ(first_difference(shared.lse.elements(), full.lse.elements()), -1);

    // Self-attention with q == k == v: one buffer passed three times.
    Problem s;
    s.Hq = s.Hkv = 2;
    s.Nq = s.Nk = 50;
    s.variant = variant;
    Inputs si = random_inputs(s, rng);
    si.k = si.v = si.q;
    Call separate = make_call(s, si, uniform(Layout::kNhd));
    ASSERT_NO_FATAL_FAILURE(run_ok(separate));
    Call same = make_call(s, si, uniform(Layout::kNhd));
    same.args.k = same.args.v = same.args.q;
    ASSERT_NO_FATAL_FAILURE(run_ok(same));
    EXPECT_EQ(first_difference(same.o.elements(), separate.o.elements()), -1);
  }
}

// =============================================================================================
// ApiReference: the API computes what sage::ref computes when called directly, and EXACT is
// float64 attention (checked against the independent one above).

TEST(ApiReference, ExactFp32MatchesRefAttentionExact) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  for (sage_mask mask :
       {SAGE_MASK_NONE, SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
    Problem p;
    p.B = 2;
    p.Hq = 4;
    p.Hkv = 2;
    p.Nq = 45;
    p.Nk = 77;
    p.mask = mask;
    SCOPED_TRACE(p.str());
    Call c = make_call(p, random_inputs(p, rng), uniform(Layout::kPadded));
    ASSERT_NO_FATAL_FAILURE(run_ok(c));
    std::vector<double> out(size_t(p.B * p.Hq * p.Nq * p.D)), lse(size_t(p.B * p.Hq * p.Nq));
    sage::ref::attention_exact(p.ref(), c.q.view(), c.k.view(), c.v.view(), out.data(), lse.data());
    std::vector<uint32_t> want_o, want_lse;
    for (double x : out) want_o.push_back(round_bits(SAGE_DTYPE_FP32, x));
    for (double x : lse) want_lse.push_back(round_bits(SAGE_DTYPE_FP32, x));
    EXPECT_EQ(first_difference(c.o.elements(), want_o), -1);
    EXPECT_EQ(first_difference(c.lse.elements(), want_lse), -1);
    // And it is attention: float64 truth to fp32 rounding.
    const Expected e = naive_attention(c);
    EXPECT_LE(max_rel_error(c.o.values(), e.o), 1e-6);
    EXPECT_LE(max_rel_error(c.lse.values(), e.lse), 1e-6);
  }
}

TEST(ApiReference, QuantizedVariantsMatchRefAttentionQuant) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    sage_variant variant;
    sage_dtype dtype;
    sage_mask mask;
  };
  const Case cases[] = {
      {SAGE_VARIANT_SAGE2_8B, SAGE_DTYPE_FP16, SAGE_MASK_NONE},
      {SAGE_VARIANT_SAGE2_8B, SAGE_DTYPE_BF16, SAGE_MASK_CAUSAL_BOTTOM_RIGHT},
      {SAGE_VARIANT_SAGE2_8B, SAGE_DTYPE_FP32, SAGE_MASK_CAUSAL_TOP_LEFT},
      {SAGE_VARIANT_SAGE2_4B, SAGE_DTYPE_FP16, SAGE_MASK_CAUSAL_TOP_LEFT},
      {SAGE_VARIANT_AUTO, SAGE_DTYPE_FP16, SAGE_MASK_NONE},
      {SAGE_VARIANT_SAGE3_FP4, SAGE_DTYPE_FP16, SAGE_MASK_CAUSAL_BOTTOM_RIGHT},
  };
  for (const Case& k : cases) {
    Problem p;
    p.B = 1;
    p.Hq = 2;
    p.Hkv = 1;
    p.Nq = 150;  // two Q blocks of 128 rows
    p.Nk = 200;  // four key blocks of 64
    p.dtype = k.dtype;
    p.variant = k.variant;
    p.mask = k.mask;
    SCOPED_TRACE(p.str());
    Call c = make_call(p, random_inputs(p, rng), uniform(Layout::kNhd));
    ASSERT_NO_FATAL_FAILURE(run_ok(c));
    const sage_variant v = k.variant == SAGE_VARIANT_AUTO ? SAGE_VARIANT_SAGE2_8B : k.variant;
    std::vector<float> out(size_t(p.B * p.Hq * p.Nq * p.D)), lse(size_t(p.B * p.Hq * p.Nq));
    sage::ref::attention_quant(p.ref(), sage::ref::quant_preset(v), c.q.view(), c.k.view(),
                               c.v.view(), out.data(), lse.data());
    std::vector<uint32_t> want_o, want_lse;
    for (float x : out) want_o.push_back(round_bits(p.dtype, double(x)));
    for (float x : lse) want_lse.push_back(round_bits(SAGE_DTYPE_FP32, double(x)));
    EXPECT_EQ(first_difference(c.o.elements(), want_o), -1);
    EXPECT_EQ(first_difference(c.lse.elements(), want_lse), -1);
    // Quantized, but still attention. A row seeing one key has LSE = its one score, so the
    // LSE error is a score error: ~0.02 for INT8, a few tenths for INT4.
    const Expected e = naive_attention(c);
    const bool int4 = v == SAGE_VARIANT_SAGE2_4B || v == SAGE_VARIANT_SAGE3_FP4;  // 4-bit Q·K
    EXPECT_GT(cosine(c.o.values(), e.o), int4 ? 0.95 : 0.99);
    EXPECT_LE(max_abs_error(c.lse.values(), e.lse), int4 ? 1.0 : 0.1);
  }
}

TEST(ApiReference, CustomVariantTakesQuantAsGiven) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  Problem p;
  p.Hq = 2;
  p.Hkv = 2;
  p.Nq = 90;
  p.Nk = 100;
  p.dtype = SAGE_DTYPE_FP16;
  const Inputs in = random_inputs(p, rng);

  // CUSTOM with a non-preset config == sage::ref::attention_quant with that config.
  sage_quant_config cfg = preset(SAGE_VARIANT_SAGE2_8B);
  cfg.granularity = SAGE_GRANULARITY_PER_TOKEN;
  cfg.smooth = SAGE_SMOOTH_K | SAGE_SMOOTH_V;
  cfg.pv_format = SAGE_PV_FP8_E5M2;
  cfg.v_scale = SAGE_V_SCALE_PER_BLOCK_CHANNEL;
  cfg.block_q = 32;
  cfg.block_k = 32;
  cfg.warps = 2;
  ASSERT_EQ(sage::ref::quant_config_error(cfg), "");
  p.variant = SAGE_VARIANT_CUSTOM;
  Call custom = make_call(p, in, uniform(Layout::kHnd));
  custom.args.quant = cfg;
  ASSERT_NO_FATAL_FAILURE(run_ok(custom));
  std::vector<float> out(size_t(p.B * p.Hq * p.Nq * p.D)), lse(size_t(p.B * p.Hq * p.Nq));
  sage::ref::attention_quant(p.ref(), cfg, custom.q.view(), custom.k.view(), custom.v.view(),
                             out.data(), lse.data());
  std::vector<uint32_t> want;
  for (float x : out) want.push_back(round_bits(p.dtype, double(x)));
  EXPECT_EQ(first_difference(custom.o.elements(), want), -1);

  // CUSTOM with the SAGE2_8B preset == SAGE2_8B; SAGE2_8B ignores whatever args.quant holds.
  Call custom8 = make_call(p, in, uniform(Layout::kHnd));
  custom8.args.quant = preset(SAGE_VARIANT_SAGE2_8B);
  ASSERT_NO_FATAL_FAILURE(run_ok(custom8));
  p.variant = SAGE_VARIANT_SAGE2_8B;
  Call preset8 = make_call(p, in, uniform(Layout::kHnd));
  preset8.args.quant = cfg;
  preset8.args.quant.block_q = -5;  // invalid, and ignored
  ASSERT_NO_FATAL_FAILURE(run_ok(preset8));
  EXPECT_EQ(first_difference(custom8.o.elements(), preset8.o.elements()), -1);
  EXPECT_EQ(first_difference(custom8.lse.elements(), preset8.lse.elements()), -1);
  EXPECT_NE(first_difference(custom.o.elements(), preset8.o.elements()), -1)
      << "the custom config made no difference";
}

TEST(ApiReference, ScaleAndThreads) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  for (sage_variant variant : {SAGE_VARIANT_EXACT, SAGE_VARIANT_SAGE2_8B}) {
    Problem p;
    p.B = 2;
    p.Hq = 2;
    p.Hkv = 1;
    p.Nq = 65;
    p.Nk = 129;
    p.variant = variant;
    SCOPED_TRACE(p.str());
    const Inputs in = random_inputs(p, rng);
    Call base = make_call(p, in, uniform(Layout::kHnd));
    ASSERT_NO_FATAL_FAILURE(run_ok(base));
    // scale 0 means 1/sqrt(head_dim) = 0.125 for D = 64, exactly.
    Call explicit_scale = make_call(p, in, uniform(Layout::kHnd));
    explicit_scale.args.scale = 0.125f;
    ASSERT_NO_FATAL_FAILURE(run_ok(explicit_scale));
    EXPECT_EQ(first_difference(explicit_scale.o.elements(), base.o.elements()), -1);
    // The thread count changes nothing.
    for (int32_t threads : {1, 3, 7}) {
      Call t = make_call(p, in, uniform(Layout::kHnd));
      t.args.num_threads = threads;
      ASSERT_NO_FATAL_FAILURE(run_ok(t));
      EXPECT_EQ(first_difference(t.o.elements(), base.o.elements()), -1) << threads << " threads";
      EXPECT_EQ(first_difference(t.lse.elements(), base.lse.elements()), -1) << threads;
    }
    // Other scales, negative included, are used as given.
    if (variant == SAGE_VARIANT_EXACT)
      for (float scale : {0.3f, -0.2f}) {
        Problem ps = p;
        ps.scale = scale;
        Call c = make_call(ps, in, uniform(Layout::kHnd));
        ASSERT_NO_FATAL_FAILURE(run_ok(c));
        const Expected e = naive_attention(c);
        EXPECT_LE(max_rel_error(c.o.values(), e.o), 1e-6) << "scale " << scale;
        EXPECT_LE(max_rel_error(c.lse.values(), e.lse), 1e-6) << "scale " << scale;
      }
  }
}

// =============================================================================================
// ApiLse: custom LSE strides, padding untouched, LSE optional.

TEST(ApiLse, CustomStridesAndOptional) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  Problem p;
  p.B = 2;
  p.Hq = 3;
  p.Hkv = 3;
  p.Nq = 41;
  p.Nk = 58;
  const Inputs in = random_inputs(p, rng);
  std::vector<uint32_t> lse0;
  for (Layout l :
       {Layout::kHndDefault, Layout::kPadded, Layout::kHeadsOuter, Layout::kTransposed}) {
    SCOPED_TRACE(layout_name(l));
    Layouts ls = uniform(Layout::kHnd);
    ls.lse = l;
    Call c = make_call(p, in, ls);  // run_ok checks the LSE padding kept its poison
    ASSERT_NO_FATAL_FAILURE(run_ok(c));
    const Expected e = naive_attention(c);
    EXPECT_LE(max_rel_error(c.lse.values(), e.lse), 1e-6);
    if (lse0.empty()) lse0 = c.lse.elements();
    EXPECT_EQ(first_difference(c.lse.elements(), lse0), -1);
  }
  // A strided LSE with the batch stride the smallest: [N][H][B] with gaps.
  Layouts ls = uniform(Layout::kHnd);
  Call c = make_call(p, in, ls);
  c.lse =
      Tensor(SAGE_DTYPE_FP32, p.B, p.Hq, p.Nq, 1, {1, p.B + 1, p.Hq * (p.B + 1) + 3}, kLsePoison);
  c.args.lse = static_cast<float*>(c.lse.data());
  c.args.lse_strides = c.lse.strides();
  ASSERT_NO_FATAL_FAILURE(run_ok(c));
  EXPECT_EQ(first_difference(c.lse.elements(), lse0), -1);

  // Without LSE the output is the same.
  for (sage_variant variant : {SAGE_VARIANT_EXACT, SAGE_VARIANT_SAGE2_8B}) {
    Problem with = p;
    with.variant = variant;
    Problem without = with;
    without.lse = false;
    Call a = make_call(with, in, uniform(Layout::kHnd));
    Call b = make_call(without, in, uniform(Layout::kHnd));
    b.args.lse_strides = {-1, -1, -1};  // ignored when lse is NULL
    ASSERT_NO_FATAL_FAILURE(run_ok(a));
    ASSERT_NO_FATAL_FAILURE(run_ok(b));
    EXPECT_EQ(first_difference(a.o.elements(), b.o.elements()), -1) << int(variant);
  }
}

// =============================================================================================
// ApiGqa: Hq = 4 with Hkv = 2 (GQA) and Hkv = 1 (MQA): query head h reads kv head
// h / (Hq / Hkv), exactly as if K and V were repeated per query head.

TEST(ApiGqa, GroupedHeadsEqualRepeatedKv) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  for (int64_t hkv : {2, 1})
    for (sage_variant variant : {SAGE_VARIANT_EXACT, SAGE_VARIANT_SAGE2_8B}) {
      Problem p;
      p.B = 2;
      p.Hq = 4;
      p.Hkv = hkv;
      p.Nq = 37;
      p.Nk = 75;
      p.dtype = SAGE_DTYPE_BF16;
      p.variant = variant;
      p.mask = SAGE_MASK_CAUSAL_TOP_LEFT;
      SCOPED_TRACE(p.str());
      const Inputs in = random_inputs(p, rng);
      Call gqa = make_call(p, in, uniform(Layout::kNhdDefault));
      ASSERT_NO_FATAL_FAILURE(run_ok(gqa));

      Problem mha = p;
      mha.Hkv = p.Hq;
      Inputs rep = in;
      const int64_t ratio = p.Hq / p.Hkv, row = p.Nk * p.D;
      rep.k.assign(size_t(p.B * p.Hq * row), 0.0);
      rep.v = rep.k;
      for (int64_t b = 0; b < p.B; ++b)
        for (int64_t h = 0; h < p.Hq; ++h) {
          const size_t src = size_t((b * p.Hkv + h / ratio) * row),
                       dst = size_t((b * p.Hq + h) * row);
          std::copy_n(in.k.begin() + long(src), row, rep.k.begin() + long(dst));
          std::copy_n(in.v.begin() + long(src), row, rep.v.begin() + long(dst));
        }
      Call full = make_call(mha, rep, uniform(Layout::kNhdDefault));
      ASSERT_NO_FATAL_FAILURE(run_ok(full));
      EXPECT_EQ(first_difference(gqa.o.elements(), full.o.elements()), -1);
      EXPECT_EQ(first_difference(gqa.lse.elements(), full.lse.elements()), -1);

      // The same through a kv head stride of 0 with Hkv = Hq (MQA only).
      if (hkv == 1) {
        Call bcast = make_call(p, in, uniform(Layout::kHnd));
        bcast.args.heads_kv = p.Hq;
        bcast.args.k_strides.head = bcast.args.v_strides.head = 0;
        ASSERT_NO_FATAL_FAILURE(run_ok(bcast));
        EXPECT_EQ(first_difference(bcast.o.elements(), gqa.o.elements()), -1);
      }
      if (variant == SAGE_VARIANT_EXACT) {
        const Expected e = naive_attention(gqa);
        EXPECT_LE(max_rel_error(gqa.o.values(), e.o), 1e-2);  // bf16 output rounding
        EXPECT_LE(max_rel_error(gqa.lse.values(), e.lse), 1e-6);
      }
    }
}

// =============================================================================================
// ApiMask: both causal alignments with Nq != Nk. Bottom-right with Nq > Nk leaves the first
// Nq - Nk query rows with no key: their output is 0 and their LSE -inf.

TEST(ApiMask, CausalAlignmentsAndFullyMaskedRows) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  const int64_t shapes[][2] = {{37, 91}, {91, 37}, {64, 64}, {130, 3}};
  for (const auto& shape : shapes)
    for (sage_mask mask : {SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_MASK_CAUSAL_BOTTOM_RIGHT})
      for (sage_variant variant : {SAGE_VARIANT_EXACT, SAGE_VARIANT_SAGE2_8B}) {
        Problem p;
        p.B = 1;
        p.Hq = 2;
        p.Hkv = 1;
        p.Nq = shape[0];
        p.Nk = shape[1];
        p.mask = mask;
        p.variant = variant;
        SCOPED_TRACE(p.str());
        Call c = make_call(p, random_inputs(p, rng), uniform(Layout::kPadded));
        ASSERT_NO_FATAL_FAILURE(run_ok(c));
        const Expected e = naive_attention(c);
        const std::vector<double> o = c.o.values(), lse = c.lse.values();
        // Fully masked rows: known in closed form, independent of visible_keys().
        const int64_t empty_rows =
            mask == SAGE_MASK_CAUSAL_BOTTOM_RIGHT ? std::max<int64_t>(0, p.Nq - p.Nk) : 0;
        int64_t seen_empty = 0;
        for (int64_t h = 0; h < p.Hq; ++h)
          for (int64_t i = 0; i < p.Nq; ++i) {
            const size_t row = size_t(h * p.Nq + i);
            const bool empty = i < empty_rows;
            seen_empty += std::isinf(lse[row]);
            if (empty) {
              EXPECT_EQ(lse[row], -kInf) << "row " << i;
              for (int64_t d = 0; d < p.D; ++d)
                ASSERT_EQ(o[row * size_t(p.D) + size_t(d)], 0.0) << "row " << i << " col " << d;
            } else {
              EXPECT_TRUE(std::isfinite(lse[row])) << "row " << i;
            }
          }
        EXPECT_EQ(seen_empty, p.Hq * empty_rows);
        if (variant == SAGE_VARIANT_EXACT) {
          EXPECT_LE(max_rel_error(o, e.o), 1e-6);
          EXPECT_LE(max_rel_error(lse, e.lse), 1e-6);
        } else {
          EXPECT_GT(cosine(o, e.o), 0.99);
          EXPECT_LE(max_abs_error(lse, e.lse), 0.1);
        }
      }
}

// EXACT never reads a key a row cannot see: NaN in the last keys changes no row that is blind to
// them.
TEST(ApiMask, MaskedKeysAreNotRead) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  std::mt19937_64 rng(seed);
  for (sage_mask mask : {SAGE_MASK_CAUSAL_TOP_LEFT, SAGE_MASK_CAUSAL_BOTTOM_RIGHT}) {
    Problem p;
    p.Hq = p.Hkv = 2;
    p.Nq = 30;
    p.Nk = 50;
    p.mask = mask;
    SCOPED_TRACE(p.str());
    const Inputs in = random_inputs(p, rng);
    Call clean = make_call(p, in, uniform(Layout::kHnd));
    ASSERT_NO_FATAL_FAILURE(run_ok(clean));
    Call dirty = make_call(p, in, uniform(Layout::kHnd));
    const int64_t poisoned = 10;  // keys Nk-10 .. Nk-1
    for (int64_t h = 0; h < p.Hkv; ++h)
      for (int64_t j = p.Nk - poisoned; j < p.Nk; ++j)
        for (int64_t d = 0; d < p.D; ++d) {
          dirty.k.set_raw(dirty.k.offset(0, h, j, d), nan_bits(p.dtype));
          dirty.v.set_raw(dirty.v.offset(0, h, j, d), nan_bits(p.dtype));
        }
    ASSERT_NO_FATAL_FAILURE(run_ok(dirty));
    int64_t checked = 0;
    for (int64_t h = 0; h < p.Hq; ++h)
      for (int64_t i = 0; i < p.Nq; ++i) {
        if (visible_keys(p, i) > p.Nk - poisoned) continue;
        ++checked;
        for (int64_t d = 0; d < p.D; ++d)
          ASSERT_EQ(dirty.o.raw(dirty.o.offset(0, h, i, d)),
                    clean.o.raw(clean.o.offset(0, h, i, d)))
              << "row " << i << " read a masked key";
      }
    EXPECT_GT(checked, 0);
  }
}

}  // namespace
