// The `sage` command-line tool: `sage accuracy` prints the papers' ablations (CPU reference
// against float64; SageAttention2's tables and SageAttention3's FP4 Table 1) on a built-in
// problem or the user's .npy tensors; `sage bench` times the GPU kernels; `sage info` says what
// was built and which GPU is there. Every command takes --help; a wrong command, option or input
// is one line on stderr and a non-zero exit. Host code.
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <type_traits>
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "api/backend.h"
#include "common/formats.h"
#include "bench.h"
#include "npy.h"
#include "ref/ablations.h"
#include "ref/reference.h"
#include "ref/synthetic.h"

namespace sage::tool {

std::string bench_impl_name(const std::string& variant, const BenchOptions& opt) {
  std::string name = variant;
  if (opt.kernel == SAGE_KERNEL_MMA) name += "-mma";
  if (opt.kernel == SAGE_KERNEL_SM90) name += "-sm90";
  if (opt.options & SAGE_OPTION_PREPASS_Q) name += "-prepass-q";
  if (opt.options & SAGE_OPTION_PREPASS_KV_SPLIT) name += "-kv-split";
  if (opt.options & SAGE_OPTION_WHOLE_TILES) name += "-whole-tiles";
  if (opt.options & SAGE_OPTION_PREPASS_KV_BLOCKS) name += "-kv-blocks";
  return name;
}

}  // namespace sage::tool

namespace {

using namespace sage;

const char* const kAccuracyOptions =
    "  --q F --k F --v F      .npy inputs (float16/float32), [B,H,N,D] or [H,N,D] or\n"
    "                         [N,D]; float32 is rounded to fp16 as a kernel call would\n"
    "  --layout HND|NHD       layout of the .npy inputs (default HND)\n"
    "  --batch B --heads H --kv-heads H --seq N --seq-kv N --dim D --seed S\n"
    "                         the built-in problem (default 1 x 2 heads x 2048 x 128)\n"
    "  --q-bias X --q-outlier X --k-bias X --k-outlier X --v-bias X\n"
    "  --outlier-channels C --token-spread X --sink X\n"
    "                         its outlier structure (defaults 1, 12, 8, 16, 4, 8, 0.3, 9;\n"
    "                         see src/ref/synthetic.h)\n"
    "  --causal               bottom-right causal mask\n"
    "  --threads T            CPU threads (default: all)\n"
    "  --json                 print JSON instead of tables\n";

const char* const kBenchOptions =
    "  --variants sage-8b,sage-4b,sage-fp4  --dims 64,128  --seqs 1024,...,32768  --causal 0,1\n"
    "  --batch B --heads H    (default 4 x 32)   --seconds S (timed per figure, 0.5)\n"
    "  --bias                 channel-bias inputs (Q += 4·randn(H,D), K, V += 8·randn)\n"
    "  --accuracy-rows R      sampled rows per checked head (64)\n"
    "  --threads T            CPU threads of the accuracy check (default: all)\n"
    "  --kernel auto|mma|sm90 the kernel family (args.kernel; default auto, the plan's\n"
    "                         choice); a forced family skips the shapes it cannot run\n"
    "  --prepass-q            sm90: Q quantized by the pre-pass (SAGE_OPTION_PREPASS_Q)\n"
    "  --kv-split             K/V pre-pass in three launches, not one cluster launch\n"
    "                         (SAGE_OPTION_PREPASS_KV_SPLIT)\n"
    "  --whole-tiles          sm90: no split tail, the last round's tiles whole\n"
    "                         (SAGE_OPTION_WHOLE_TILES)\n"
    "  --kv-blocks            the three-launch K/V quantization a CTA per 64-key block, not\n"
    "                         the staged grid (SAGE_OPTION_PREPASS_KV_BLOCKS)\n"
    "  --out FILE             JSON in the bench/results schema; --commit C labels it\n";

struct Options {
  std::map<std::string, std::string> values;  // --name value, keyed by name
  std::set<std::string> flags;                // --name without a value
  bool help = false;
  std::string get(const std::string& k, const std::string& def) const {
    auto it = values.find(k);
    return it == values.end() ? def : it->second;
  }
  bool flag(const std::string& k) const { return flags.count(k) != 0; }
};

// A numeric option's value that is not wholly a number ("abc", "64x", "1e3" for an integer): the
// commands report it by the option's name.
struct BadNumber {
  std::string option, value;
};

// `text` as a T, every character of it (std::stoll alone takes "64x" as 64); else BadNumber.
template <typename T>
T parse_number(const std::string& option, const std::string& text) {
  size_t used = 0;
  T value{};
  try {
    if constexpr (std::is_floating_point_v<T>)
      value = T(std::stod(text, &used));
    else if constexpr (std::is_unsigned_v<T>)  // (std::stoull takes "-1" as 2^64 - 1)
      value = text.find('-') == std::string::npos ? T(std::stoull(text, &used)) : T(0);
    else
      value = T(std::stoll(text, &used));
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw BadNumber{option, text};
  return value;
}

// --name as a T, or `fallback` when it is not given.
template <typename T>
T number(const Options& o, const std::string& name, T fallback) {
  auto it = o.values.find(name);
  return it == o.values.end() ? fallback : parse_number<T>(name, it->second);
}

// A command: its usage, the options it takes (any other is an error, so that an option of
// another command is not silently ignored) and what runs it.
struct Command {
  const char* name;
  const char* summary;
  const char* options;              // usage text; nullptr: none
  std::vector<std::string> flags;   // options without a value
  std::vector<std::string> valued;  // options that take one
  int (*run)(const Options&);
};

int cmd_accuracy(const Options& o);
int cmd_bench(const Options& o);
int cmd_info(const Options& o);

const Command kCommands[] = {
    {"accuracy",
     "the papers' ablations (CPU emulation vs float64), all four metrics: SageAttention2's\n"
     "             tables and paper 004's FP4 Table 1 (MXFP4/NVFP4, direct/two-level P~)",
     kAccuracyOptions, {"causal", "json"},
     {"q", "k", "v", "layout", "batch", "heads", "kv-heads", "seq", "seq-kv", "dim", "seed",
      "q-bias", "k-bias", "v-bias", "token-spread", "q-outlier", "k-outlier", "outlier-channels",
      "sink", "threads"},
     cmd_accuracy},
    {"bench",
     "GPU speed over the standard grid (end-to-end and kernel-only TOPS) with\n"
     "             accuracy vs float64 on sampled rows; needs a CUDA build and a GPU",
     kBenchOptions, {"bias", "prepass-q", "kv-split", "whole-tiles", "kv-blocks"},
     {"variants", "dims", "seqs", "causal", "batch", "heads", "seconds", "accuracy-rows",
      "threads", "kernel", "out", "commit"},
     cmd_bench},
    {"info", "version, CUDA architectures built, GPUs visible (or why there is none)", nullptr,
     {}, {}, cmd_info},
};

void usage(FILE* f) {
  std::fprintf(f,
               "usage: sage <command> [options]\n"
               "       sage <command> --help\n"
               "       sage --version\n"
               "\n"
               "commands:\n");
  for (const Command& c : kCommands) std::fprintf(f, "  %-10s %s\n", c.name, c.summary);
  for (const Command& c : kCommands)
    if (c.options) std::fprintf(f, "\n%s options:\n%s", c.name, c.options);
}

void command_usage(const Command& c) {
  std::printf("usage: sage %s%s\n\n%s\n", c.name, c.options ? " [options]" : "", c.summary);
  if (c.options) std::printf("\noptions:\n%s", c.options);
}

bool parse_options(const Command& c, int argc, char** argv, Options* o) {
  auto has = [](const std::vector<std::string>& names, const std::string& n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      o->help = true;
      return true;
    }
    const std::string name = a.rfind("--", 0) == 0 ? a.substr(2) : std::string();
    if (has(c.flags, name)) {
      o->flags.insert(name);
    } else if (has(c.valued, name)) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "sage %s: option '%s' needs a value\n", c.name, a.c_str());
        return false;
      }
      o->values[name] = argv[++i];
    } else {
      std::fprintf(stderr, "sage %s: unknown option '%s' (sage %s --help lists the options)\n",
                   c.name, a.c_str(), c.name);
      return false;
    }
  }
  return true;
}

// The user's tensors as fp16 HND, shaped like the synthetic problem so both paths share code.
// Inputs the comparison cannot use (an empty axis, NaN or infinity, float32 values beyond fp16's
// range, which rounding would make infinite) are errors naming the file, not a table of NaNs.
bool load_user_inputs(const Options& o, ref::SyntheticInputs* in) {
  tool::NpyArray arr[3];
  const char* names[3] = {"q", "k", "v"};
  std::string paths[3], err;
  for (int i = 0; i < 3; ++i) {
    paths[i] = o.get(names[i], "");
    if (!tool::read_npy(paths[i], &arr[i], &err)) {
      std::fprintf(stderr, "sage accuracy: --%s %s\n", names[i], err.c_str());
      return false;
    }
    if (arr[i].shape.size() < 2 || arr[i].shape.size() > 4) {
      std::fprintf(stderr, "sage accuracy: --%s %s: %zu dimensions; need [B,H,N,D], [H,N,D] or "
                   "[N,D]\n", names[i], paths[i].c_str(), arr[i].shape.size());
      return false;
    }
    while (arr[i].shape.size() < 4) arr[i].shape.insert(arr[i].shape.begin(), 1);
  }
  const bool nhd = o.get("layout", "HND") == "NHD";
  if (!nhd && o.get("layout", "HND") != "HND") {
    std::fprintf(stderr, "sage accuracy: --layout must be HND or NHD\n");
    return false;
  }
  auto dims = [&](int i, int64_t* b, int64_t* h, int64_t* n, int64_t* d) {
    *b = arr[i].shape[0];
    *h = nhd ? arr[i].shape[2] : arr[i].shape[1];
    *n = nhd ? arr[i].shape[1] : arr[i].shape[2];
    *d = arr[i].shape[3];
  };
  int64_t b[3], h[3], n[3], d[3];
  for (int i = 0; i < 3; ++i) {
    dims(i, &b[i], &h[i], &n[i], &d[i]);
    const int64_t size[4] = {b[i], h[i], n[i], d[i]};
    for (int j = 0; j < 4; ++j)
      if (size[j] < 1) {
        std::fprintf(stderr, "sage accuracy: --%s %s: %c = 0: the tensor is empty\n", names[i],
                     paths[i].c_str(), "BHND"[j]);
        return false;
      }
  }
  if (b[1] != b[0] || b[2] != b[0] || d[1] != d[0] || d[2] != d[0] || h[1] != h[2] ||
      n[1] != n[2] || h[0] % h[1] != 0) {
    std::fprintf(stderr,
                 "sage accuracy: shapes do not fit: need q [B,Hq,Nq,D], k and v [B,Hkv,Nk,D] with "
                 "Hq %% Hkv == 0 (in the given layout)\n");
    return false;
  }
  if (d[0] > api::kMaxHeadDim) {
    std::fprintf(stderr, "sage accuracy: --q %s: D = %" PRId64 " is above the largest head dim, "
                 "%" PRId64 "\n", paths[0].c_str(), d[0], api::kMaxHeadDim);
    return false;
  }
  in->spec.batch = b[0];
  in->spec.heads_q = h[0];
  in->spec.heads_kv = h[1];
  in->spec.seq_q = n[0];
  in->spec.seq_kv = n[1];
  in->spec.head_dim = d[0];
  std::vector<uint16_t>* dst[3] = {&in->q, &in->k, &in->v};
  for (int i = 0; i < 3; ++i) {
    dst[i]->resize(size_t(b[i] * h[i] * n[i] * d[i]));
    int64_t nonfinite = 0;
    double max_abs = 0;
    for (int64_t bb = 0; bb < b[i]; ++bb)
      for (int64_t hh = 0; hh < h[i]; ++hh)
        for (int64_t nn = 0; nn < n[i]; ++nn)
          for (int64_t dd = 0; dd < d[i]; ++dd) {
            const int64_t src = nhd ? ((bb * n[i] + nn) * h[i] + hh) * d[i] + dd
                                    : ((bb * h[i] + hh) * n[i] + nn) * d[i] + dd;
            const int64_t out = ((bb * h[i] + hh) * n[i] + nn) * d[i] + dd;
            uint16_t bits;
            float x;
            if (arr[i].is_fp16) {
              std::memcpy(&bits, &arr[i].bytes[size_t(src * 2)], 2);
              x = decode_float(kFp16, bits);
            } else {
              std::memcpy(&x, &arr[i].bytes[size_t(src * 4)], 4);
              bits = uint16_t(encode_float(kFp16, x, false));
            }
            if (std::isfinite(x)) {
              max_abs = std::max(max_abs, double(std::fabs(x)));
            } else {
              ++nonfinite;
            }
            (*dst[i])[size_t(out)] = bits;
          }
    if (nonfinite) {
      std::fprintf(stderr,
                   "sage accuracy: --%s %s: %" PRId64 " of %zu values are NaN or infinite\n",
                   names[i], paths[i].c_str(), nonfinite, dst[i]->size());
      return false;
    }
    if (max_abs > 65504.0) {
      std::fprintf(stderr, "sage accuracy: --%s %s: values up to %.3g overflow fp16 (max 65504)\n",
                   names[i], paths[i].c_str(), max_abs);
      return false;
    }
  }
  return true;
}

int cmd_accuracy(const Options& o) {
  ref::SyntheticInputs in;
  const bool user = !o.get("q", "").empty() || !o.get("k", "").empty() || !o.get("v", "").empty();
  int threads = 0;
  try {
    threads = number<int>(o, "threads", 0);
    if (user) {
      if (!load_user_inputs(o, &in)) return 2;
    } else {
      ref::SyntheticSpec s;
      s.batch = number<int64_t>(o, "batch", 1);
      s.heads_q = number<int64_t>(o, "heads", 2);
      s.heads_kv = number<int64_t>(o, "kv-heads", s.heads_q);
      s.seq_q = number<int64_t>(o, "seq", 2048);
      s.seq_kv = number<int64_t>(o, "seq-kv", s.seq_q);
      s.head_dim = number<int64_t>(o, "dim", 128);
      s.seed = number<uint64_t>(o, "seed", 1);
      s.q_bias = number<float>(o, "q-bias", s.q_bias);
      s.q_outlier = number<float>(o, "q-outlier", s.q_outlier);
      s.k_bias = number<float>(o, "k-bias", s.k_bias);
      s.k_outlier = number<float>(o, "k-outlier", s.k_outlier);
      s.v_bias = number<float>(o, "v-bias", s.v_bias);
      s.outlier_channels = number<int64_t>(o, "outlier-channels", s.outlier_channels);
      s.token_spread = number<float>(o, "token-spread", s.token_spread);
      s.sink = number<float>(o, "sink", s.sink);
      if (s.batch < 1 || s.heads_q < 1 || s.heads_kv < 1 || s.heads_q % s.heads_kv != 0 ||
          s.seq_q < 1 || s.seq_kv < 1 || s.head_dim < 1 || s.head_dim > api::kMaxHeadDim) {
        std::fprintf(stderr, "sage accuracy: the problem sizes are invalid (need >= 1, heads %% "
                     "kv-heads == 0, dim <= %" PRId64 ")\n", api::kMaxHeadDim);
        return 2;
      }
      in = ref::make_inputs(s);
    }
  } catch (const BadNumber& e) {
    std::fprintf(stderr, "sage accuracy: --%s %s: not a number\n", e.option.c_str(),
                 e.value.c_str());
    return 2;
  }
  const ref::Problem p =
      in.problem(o.flag("causal") ? SAGE_MASK_CAUSAL_BOTTOM_RIGHT : SAGE_MASK_NONE);
  const ref::TensorView q = in.q_view(), k = in.k_view(), v = in.v_view();

  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  std::vector<double> exact(static_cast<size_t>(p.out_elems()));
  ref::attention_exact(p, q, k, v, exact.data(), nullptr, threads);
  const double exact_s = std::chrono::duration<double>(clock::now() - t0).count();

  struct Result {
    ref::AblationRow row;
    ref::Metrics m;
    double seconds;
  };
  std::vector<Result> results;
  std::vector<float> out(static_cast<size_t>(p.out_elems()));
  for (const ref::AblationRow& row : ref::paper_ablations()) {
    const auto t = clock::now();
    ref::attention_quant(p, row.cfg, q, k, v, out.data(), nullptr, threads);
    const double s = std::chrono::duration<double>(clock::now() - t).count();
    results.push_back({row, ref::compare(exact.data(), out.data(), p.out_elems()), s});
  }
  const double total_s = std::chrono::duration<double>(clock::now() - t0).count();

  const char* input_name = user ? "user tensors" : "built-in outlier problem";
  if (o.flag("json")) {
    std::printf("{\"input\": \"%s\", \"batch\": %" PRId64 ", \"heads_q\": %" PRId64
                ", \"heads_kv\": %" PRId64 ", \"seq_q\": %" PRId64 ", \"seq_kv\": %" PRId64
                ", \"head_dim\": %" PRId64 ", \"causal\": %s, \"seconds\": %.3f, \"rows\": [",
                input_name, p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_kv, p.head_dim,
                o.flag("causal") ? "true" : "false", total_s);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::printf("%s\n  {\"table\": \"%s\", \"label\": \"%s\", \"cos\": %.8f, \"rel_l1\": %.8g, "
                  "\"rmse\": %.8g, \"max_abs\": %.8g, \"seconds\": %.3f}",
                  i ? "," : "", r.row.table.c_str(), r.row.label.c_str(), r.m.cos, r.m.rel_l1,
                  r.m.rmse, r.m.max_abs, r.seconds);
    }
    std::printf("\n]}\n");
    return 0;
  }
  std::printf("sage accuracy: %s, B=%" PRId64 " Hq=%" PRId64 " Hkv=%" PRId64 " Nq=%" PRId64
              " Nk=%" PRId64 " D=%" PRId64 "%s\n",
              input_name, p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_kv, p.head_dim,
              o.flag("causal") ? " causal" : "");
  std::printf("CPU emulation of each kernel configuration against float64 attention of the same "
              "fp16 inputs (float64: %.1f s)\n",
              exact_s);
  std::string table;
  for (const Result& r : results) {
    if (r.row.table != table) {
      table = r.row.table;
      std::printf("\n%s\n  %-42s %10s %10s %10s %10s\n", table.c_str(), "", "CosSim", "RelL1",
                  "RMSE", "MaxAbs");
    }
    std::printf("  %-42s %9.4f%% %10.5f %10.5f %10.5f\n", r.row.label.c_str(), 100.0 * r.m.cos,
                r.m.rel_l1, r.m.rmse, r.m.max_abs);
  }
  std::printf("\n%zu configurations in %.1f s\n", results.size(), total_s);
  return 0;
}

template <typename T>
std::vector<T> parse_list(const std::string& option, const std::string& text) {
  std::vector<T> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    if constexpr (std::is_same_v<T, std::string>) {
      out.push_back(item);
    } else {
      out.push_back(parse_number<T>(option, item));
    }
    start = end + 1;
  }
  return out;
}

int cmd_bench(const Options& o) {
  tool::BenchOptions b;
  try {
    const std::string variants = o.get("variants", ""), dims = o.get("dims", ""),
                      seqs = o.get("seqs", ""), causal = o.get("causal", "");
    if (!variants.empty()) b.variants = parse_list<std::string>("variants", variants);
    if (!dims.empty()) b.dims = parse_list<int64_t>("dims", dims);
    if (!seqs.empty()) b.seqs = parse_list<int64_t>("seqs", seqs);
    if (!causal.empty()) b.causal = parse_list<int>("causal", causal);
    b.batch = number<int64_t>(o, "batch", 4);
    b.heads = number<int64_t>(o, "heads", 32);
    b.seconds = number<double>(o, "seconds", 0.5);
    b.accuracy_rows = number<int>(o, "accuracy-rows", 64);
    b.threads = number<int>(o, "threads", 0);
  } catch (const BadNumber& e) {
    std::fprintf(stderr, "sage bench: --%s %s: not a number\n", e.option.c_str(),
                 e.value.c_str());
    return 2;
  }
  for (const std::string& v : b.variants)
    if (v != "sage-8b" && v != "sage-4b" && v != "sage-fp4") {
      std::fprintf(stderr, "sage bench: --variants takes sage-8b, sage-4b and/or sage-fp4, not '%s'\n",
                   v.c_str());
      return 2;
    }
  const std::string kernel = o.get("kernel", "auto");
  if (kernel == "auto") {
    b.kernel = SAGE_KERNEL_AUTO;
  } else if (kernel == "mma") {
    b.kernel = SAGE_KERNEL_MMA;
  } else if (kernel == "sm90") {
    b.kernel = SAGE_KERNEL_SM90;
  } else {
    std::fprintf(stderr, "sage bench: --kernel takes auto, mma or sm90, not '%s'\n",
                 kernel.c_str());
    return 2;
  }
  if (o.flag("prepass-q")) b.options |= SAGE_OPTION_PREPASS_Q;
  if (o.flag("kv-split")) b.options |= SAGE_OPTION_PREPASS_KV_SPLIT;
  if (o.flag("whole-tiles")) b.options |= SAGE_OPTION_WHOLE_TILES;
  if (o.flag("kv-blocks")) b.options |= SAGE_OPTION_PREPASS_KV_BLOCKS;
  if (o.flag("bias")) b.q_bias = 4, b.k_bias = 8, b.v_bias = 8;
  // Without a usable GPU, the reason in plain words, not the CUDA error of the first allocation.
  bool has_gpu = false;
  const std::string gpus = cuda::describe_devices(&has_gpu);
  if (!has_gpu) {
    std::fprintf(stderr, "sage bench: %s; the benchmark needs a GPU\n", gpus.c_str());
    return 1;
  }
  std::vector<tool::BenchRow> rows;
  if (!tool::run_bench(b, &rows)) return 1;
  const std::string out = o.get("out", "");
  if (out.empty()) return 0;
  FILE* f = std::fopen(out.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "sage bench: cannot write %s\n", out.c_str());
    return 1;
  }
  std::string gpu, driver, cuda_version;
  tool::device_strings(&gpu, &driver, &cuda_version);
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::fprintf(f,
               "{\"gpu\": \"%s\", \"driver\": \"%s\", \"cuda\": \"%s\", \"torch\": null, "
               "\"commit\": \"%s\", \"date\": \"%s\", \"input\": \"%s\", \"rows\": [",
               gpu.c_str(), driver.c_str(), cuda_version.c_str(), o.get("commit", "").c_str(), date,
               o.flag("bias") ? "channel-bias" : "normal");
  for (size_t i = 0; i < rows.size(); ++i) {
    const tool::BenchRow& r = rows[i];
    std::fprintf(f,
                 "%s\n  {\"impl\": \"%s\", \"head_dim\": %" PRId64 ", \"seq_len\": %" PRId64
                 ", \"batch\": %" PRId64 ", \"heads\": %" PRId64
                 ", \"causal\": %s, \"e2e_tops\": %.2f, \"kernel_tops\": %.2f, \"ms\": %.4f, "
                 "\"cos\": %.7f, \"rel_l1\": %.6f, \"rmse\": %.6f, \"max_abs\": %.6f}",
                 i ? "," : "", r.impl.c_str(), r.head_dim, r.seq_len, r.batch, r.heads,
                 r.causal ? "true" : "false", r.e2e_tops, r.kernel_tops, r.ms, r.acc.cos,
                 r.acc.rel_l1, r.acc.rmse, r.acc.max_abs);
  }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
  return 0;
}

int cmd_info(const Options&) {
  bool has_gpu = false;
  const std::string gpus = cuda::describe_devices(&has_gpu);
  std::printf("libsage %s\n", sage_version());
  std::printf("CUDA architectures built: %s\n", SAGE_CUDA_ARCHS_STRING);
  std::printf("%s\n", gpus.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help") {
    usage(stdout);
    return 0;
  }
  if (cmd == "--version") {
    std::printf("sage %s\n", sage_version());
    return 0;
  }
  for (const Command& c : kCommands) {
    if (cmd != c.name) continue;
    Options o;
    if (!parse_options(c, argc, argv, &o)) return 2;
    if (o.help) {
      command_usage(c);
      return 0;
    }
    return c.run(o);
  }
  std::string names;
  for (const Command& c : kCommands) names += std::string(names.empty() ? "" : ", ") + c.name;
  std::fprintf(stderr, "sage: unknown command '%s' (commands: %s; sage --help says more)\n",
               cmd.c_str(), names.c_str());
  return 2;
}
