// Routed gated experts on the CPU, reading each weight byte once per step.
//
//   out[t] = sum over routes r of token t:  w[r] * (down[e_r] @ act(g, u) + bd[e_r]),
//   where [g; u] = gate_up[e_r] @ x[t] + bgu[e_r]   (gate rows [0, I), up rows [I, 2I)),
//   act = silu(g) * u (SwiGLU), or with g <= limit and |u| <= limit either
//   (u + 1) * g * sigmoid(alpha * g) (gpt-oss) or silu(g) * u. The biases are optional.
//
// Two passes over tasks shared by the intra-op threads: pass 1 walks (route, tile of rows of
// I) and writes h = act(g, u); pass 2 walks (route, tile of rows of H) for the down projections,
// which each token then sums over its routes. Threads take tasks one at a time from a shared
// counter, so a thread that the OS runs less (another process's, or the host's own thread
// waiting on the GPU) takes fewer; but each pass ends in a barrier, so a thread the OS has
// taken off its core altogether still holds up the pass until it runs again. Weights are bf16 or fp32, or
// packed blocks of a quantized format read in place (quant_dot.cpp), each bank its own;
// biases are bf16 or fp32; accumulation is fp32. The instruction set is chosen at run time:
// AVX-512-BF16, AVX-512, AVX2+FMA, or plain C++ (float_dot.cpp). Where the caller allows it
// (a model computing in BF16) and the CPU has an int8 kernel for the format (AVX-512 VNNI's,
// or AVX2's for the formats quant_avx2.cpp reads), packed banks take their activations
// quantized to int8, once per token for gate_up and once per route for down (quant_act.cpp,
// quant_vnni.cpp, quant_avx2.cpp).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

// float_dot.cpp
float (*float_dot(int tier))(const float*, const float*, int64_t);
void float_rows_dot(const void* base, bool bf16, int64_t row0, int rows, int64_t n, int64_t col0, const float* x,
                    const uint16_t* xb, float* y, int tier);
// quant_dot.cpp
int64_t quant_row_bytes(int64_t fmt, int64_t cols);
void quant_rows_dot(int64_t fmt, const uint8_t* base, int64_t row0, int rows, int64_t cols, const float* x,
                    float* y, float (*dot)(const float*, const float*, int64_t), bool avx512);
// quant_act.cpp, quant_vnni.cpp
int64_t quant_set_prefetch_bytes(int64_t bytes);
int64_t quant_act_bytes(int64_t fmt, int64_t n);
void quant_act_prepare(int64_t fmt, const float* x, int64_t n, uint8_t* buf);
bool quant_int8_ok(int64_t fmt);
void quant_rows_dot_int8(int64_t fmt, const uint8_t* base, int64_t row0, int rows, int64_t cols, const uint8_t* act,
                         float* y);
// quant_avx2.cpp
bool quant_int8_avx2_ok(int64_t fmt);
void quant_act_prepare_avx2(int64_t fmt, const float* x, int64_t n, uint8_t* buf);
void quant_rows_dot_int8_avx2(int64_t fmt, const uint8_t* base, int64_t row0, int rows, int64_t cols,
                              const uint8_t* act, float* y);

namespace {

constexpr int64_t kMaxTile = 256, kTileBytes = 64 << 10;
constexpr int64_t kChunk = 256;  // outputs of a token that one task of its route sums covers

enum Tier { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512BF16 = 3 };

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

int best_tier() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) return AVX512BF16;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
  return SCALAR;
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// How one expert's hidden activation is formed (ExpertSpec: activation, alpha, limit, biases).
struct Act {
  int64_t kind = 0;  // 0: silu(g) * u; 1: gpt-oss's clamped SwiGLU; 2: silu(g) * u, clamped
  float alpha = 1.702f, limit = 7.f;

  inline float operator()(float g, float u) const {
    if (kind == 0) return silu(g) * u;
    g = std::min(g, limit);
    u = std::min(std::max(u, -limit), limit);
    if (kind == 2) return silu(g) * u;
    return (u + 1.f) * g / (1.f + std::exp(-alpha * g));
  }
};

// A float vector bank (a bias) of bf16 or fp32, or none.
struct Vec {
  const void* p = nullptr;
  bool bf16 = false;

  inline float at(int64_t i) const {
    if (p == nullptr) return 0.f;
    return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
  }
};

// A calling thread's own team in place of ATen's pool (the CPU lane's, lane.cpp): `run` calls
// loop(ctx) on each member and on the caller, and returns once all of them have returned.
using TeamRun = void (*)(void* team, void (*loop)(void*), void* ctx);
thread_local TeamRun tls_team_run = nullptr;
thread_local void* tls_team = nullptr;

// f(task) for every task in [0, n), each once, over the calling thread's team or else the
// intra-op threads.
template <typename F>
void for_tasks(int64_t n, const F& f) {
  std::atomic<int64_t> next{0};
  auto loop = [&] {
    for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < n;
         task = next.fetch_add(1, std::memory_order_relaxed)) {
      f(task);
    }
  };
  if (tls_team_run != nullptr) {
    tls_team_run(tls_team, [](void* ctx) { (*static_cast<decltype(loop)*>(ctx))(); }, &loop);
    return;
  }
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) { loop(); });
}

// One matrix bank [E, rows, cols]: bf16 or fp32 weights, or packed blocks (fmt > 0).
struct Mat {
  const uint8_t* p;
  int64_t fmt;  // 0: float (bf16 tells which); else the packed format's code
  bool bf16;
  int64_t expert_bytes;  // bytes from one expert to the next
};

// Which int8-activation kernel rows of format fmt take at a tier: AVX-512 VNNI's (every format
// it has one for), else AVX2's (the formats quant_avx2.cpp reads), else none (fp32 ones).
enum Int8Kernel { NO_INT8, VNNI_INT8, AVX2_INT8 };

Int8Kernel int8_kernel(int64_t fmt, int tier) {
  if (tier >= AVX512 && quant_int8_ok(fmt)) return VNNI_INT8;
  if (tier >= AVX2 && quant_int8_avx2_ok(fmt)) return AVX2_INT8;
  return NO_INT8;
}

// One row of activations prepared for an int8 kernel, and which kernel; `act` null where the
// bank takes fp32 activations.
struct Int8Row {
  Int8Kernel kernel;
  const uint8_t* act;
};

// Activations of one bank prepared for its int8 kernel, a buffer per row of x [rows, n]; none
// (`at` null) where the bank takes fp32 activations: a float bank, fp32 compute, no kernel.
struct Int8Act {
  std::vector<uint8_t> mem;
  uint8_t* base = nullptr;
  int64_t stride = 0, n = 0, fmt = 0;
  Int8Kernel kernel = NO_INT8;

  Int8Act(const Mat& m, bool allowed, int tier, int64_t rows, int64_t n) : n(n), fmt(m.fmt) {
    if (!allowed || !m.fmt) return;
    kernel = int8_kernel(m.fmt, tier);
    if (kernel == NO_INT8) return;
    stride = quant_act_bytes(m.fmt, n);  // a multiple of 64
    mem.resize(rows * stride + 64);
    base = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64;
  }

  // row `row` from x [n], by the kernel's own instruction set (the layout is the same)
  void prepare(int64_t row, const float* x) const {
    if (kernel == VNNI_INT8) quant_act_prepare(fmt, x, n, base + row * stride);
    if (kernel == AVX2_INT8) quant_act_prepare_avx2(fmt, x, n, base + row * stride);
  }

  Int8Row at(int64_t row) const { return {kernel, base ? base + row * stride : nullptr}; }
};

// y[j] = row (row0 + j) of expert e's matrix . x, for j < rows; `q` is x prepared for the
// bank's int8 kernel, if it takes one. A float matrix reads only columns [col0, n) (x's
// earlier entries are zero: another path's); a packed one reads whole rows (its blocks span
// columns), so its x must hold zeros there.
inline void mat_rows(const Mat& m, int64_t e, int64_t row0, int rows, int64_t n, const float* x, const uint16_t* xb,
                     Int8Row q, float* y, int tier, int64_t col0 = 0) {
  const uint8_t* base = m.p + e * m.expert_bytes;
  if (m.fmt && q.kernel == VNNI_INT8) {
    quant_rows_dot_int8(m.fmt, base, row0, rows, n, q.act, y);
  } else if (m.fmt && q.kernel == AVX2_INT8) {
    quant_rows_dot_int8_avx2(m.fmt, base, row0, rows, n, q.act, y);
  } else if (m.fmt) {
    quant_rows_dot(m.fmt, base, row0, rows, n, x, y, float_dot(tier), tier >= AVX512);
  } else {
    float_rows_dot(base, m.bf16, row0, rows, n, col0, x, xb, y, tier);
  }
}

// Rows per task of a bank whose rows hold `cols` weights: as many as hold 64 KB, a multiple of
// 16 from 16 to 256. With 16 rows a task of packed rows was a few KB, and two threads reading
// neighbouring few-KB tiles at once each ran at about half their speed alone (Q4_K, 2 threads:
// 15-19 GB/s in all, against 25 with tiles of 64 KB); bf16 rows of 2048 weights stay at 16.
int64_t tile_rows(const Mat& m, int64_t cols) {
  const int64_t bytes = m.fmt ? quant_row_bytes(m.fmt, cols) : cols * (m.bf16 ? 2 : 4);
  return std::clamp<int64_t>((kTileBytes / bytes + 15) / 16 * 16, 16, kMaxTile);
}

struct Experts {
  Mat gate_up, down;
  Vec gu_bias, dn_bias;  // rows of E x 2I and E x H
};

// Rows [i0, i0 + rows) of route's h = act(gate, up) (and its bf16 copy `hb`, if any).
void gate_up_tile(const float* x, const uint16_t* xb, const Experts& w, Int8Row q, int64_t t, int64_t e,
                  int64_t i0, int64_t rows, int64_t H, int64_t I, float* h, uint16_t* hb, int tier,
                  const Act& act) {
  float g[kMaxTile], u[kMaxTile];
  const float* xr = x + t * H;
  const uint16_t* xbr = xb ? xb + t * H : nullptr;
  mat_rows(w.gate_up, e, i0, static_cast<int>(rows), H, xr, xbr, q, g, tier);
  mat_rows(w.gate_up, e, I + i0, static_cast<int>(rows), H, xr, xbr, q, u, tier);
  const int64_t b0 = e * 2 * I;
  for (int64_t j = 0; j < rows; ++j) {
    const float v = act(g[j] + w.gu_bias.at(b0 + i0 + j), u[j] + w.gu_bias.at(b0 + I + i0 + j));
    h[i0 + j] = v;
    if (hb) hb[i0 + j] = f32_to_bf16(v);
  }
}

// out[j0, j0 + n) += each route's weighted down output y[r] (and its bias), over `routes`
// in order (n at most kChunk).
void add_routes(const float* y, const std::vector<int64_t>& routes, const Experts& w, const int64_t* exp,
                const float* wt, int64_t H, int64_t j0, int64_t n, float* out) {
  float acc[kChunk];
  std::fill(acc, acc + n, 0.f);
  for (int64_t r : routes) {
    const float* yr = y + r * H + j0;
    for (int64_t j = 0; j < n; ++j) acc[j] += wt[r] * (yr[j] + w.dn_bias.at(exp[r] * H + j0 + j));
  }
  for (int64_t j = 0; j < n; ++j) out[j0 + j] += acc[j];
}

// Spins until `a` holds `v`: a task whose inputs other threads are still computing. Every task
// it depends on was taken before it (tasks are taken in order) by a thread now running it.
// After a while it yields its core, in case the thread it waits for shares that core.
inline void wait_for(const std::atomic<int64_t>& a, int64_t v) {
  for (int spins = 0; a.load(std::memory_order_acquire) != v; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

// One parallel region over three runs of tasks, taken in order: gate_up tiles (route by route),
// down tiles (route by route), and each token's sums over its routes (in chunks of H). A down
// tile waits only for its own route's h, a sum only for its own token's down tiles. With a
// barrier after each pass (and a region each), a call of 8 packed routes ran its fixed costs
// and each pass's last tile alone on a 16-core machine: Q4_K's experts (2.6 MB) read 0.61 of
// DRAM where BF16's (9.4 MB) read 0.80.
// Only the intermediate rows [first, I) of each expert are computed (h is zero below them):
// the GPU reads the others of a miss split by its rows.
void run(const float* x, const uint16_t* xb, const Experts& w, const int64_t* tok, const int64_t* exp,
         const float* wt, int64_t R, int64_t T, int64_t H, int64_t I, int64_t first, float* out, int tier,
         const Act& act, bool int8) {
  const Int8Act xq(w.gate_up, int8, tier, T, H);
  at::parallel_for(0, T, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) xq.prepare(r, x + r * H);
  });
  const Int8Act hq(w.down, int8, tier, R, I);
  const bool h_bf16 = xb != nullptr && w.down.bf16 && !w.down.fmt;  // down's bf16 dot takes bf16 h
  std::vector<float> h(R * I), y(R * H);
  std::vector<uint16_t> hb(h_bf16 ? R * I : 0);
  const int64_t itile = tile_rows(w.gate_up, H), itiles = (I - first + itile - 1) / itile;
  const int64_t htile = tile_rows(w.down, I), htiles = (H + htile - 1) / htile;
  // routes of each token, in order (routes arrive grouped by nothing in particular)
  std::vector<std::vector<int64_t>> by_tok(T);
  for (int64_t r = 0; r < R; ++r) by_tok[tok[r]].push_back(r);
  // gate_up tiles left per route (-1 once its h is prepared), down tiles left per token
  std::vector<std::atomic<int64_t>> h_left(R), y_left(T);
  for (int64_t r = 0; r < R; ++r) h_left[r].store(itiles, std::memory_order_relaxed);
  for (int64_t t = 0; t < T; ++t) y_left[t].store(by_tok[t].size() * htiles, std::memory_order_relaxed);
  // the sums in chunks of H (kChunk): one token's alone took a thread 1-2% of a call's time
  const int64_t chunks = (H + kChunk - 1) / kChunk, n1 = R * itiles, n2 = R * htiles;
  for_tasks(n1 + n2 + T * chunks, [&](int64_t task) {
    if (task < n1) {
      const int64_t r = task / itiles, i0 = first + (task % itiles) * itile;
      gate_up_tile(x, xb, w, xq.at(tok[r]), tok[r], exp[r], i0, std::min(itile, I - i0), H, I,
                   h.data() + r * I, hb.empty() ? nullptr : hb.data() + r * I, tier, act);
      if (h_left[r].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        hq.prepare(r, h.data() + r * I);
        h_left[r].store(-1, std::memory_order_release);
      }
      return;
    }
    if ((task -= n1) < n2) {
      // Walked (route, tile of H) like pass 1, so that consecutive tasks read one expert's rows
      // in order: every route's tile per token read 8 runs of a few KB by turns, which the
      // prefetchers followed badly.
      const int64_t r = task / htiles, r0 = (task % htiles) * htile;
      wait_for(h_left[r], -1);
      mat_rows(w.down, exp[r], r0, static_cast<int>(std::min(htile, H - r0)), I, h.data() + r * I,
               hb.empty() ? nullptr : hb.data() + r * I, hq.at(r), y.data() + r * H + r0, tier, first);
      y_left[tok[r]].fetch_sub(1, std::memory_order_release);
      return;
    }
    task -= n2;
    const int64_t t = task / chunks, j0 = (task % chunks) * kChunk;
    wait_for(y_left[t], 0);
    add_routes(y.data(), by_tok[t], w, exp, wt, H, j0, std::min(kChunk, H - j0), out + t * H);
  });
}

// A bank as the kernel reads it, checked against its expected shape: [E, rows, cols] of float,
// or [E, rows, row bytes] of uint8 blocks in format fmt.
Mat mat_of(const torch::Tensor& t, int64_t fmt, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.dim() == 3 && t.size(1) == rows, name, ": bad bank shape");
  if (fmt) {
    TORCH_CHECK(t.dtype() == torch::kUInt8, name, ": packed banks are uint8");
    const int64_t rb = quant_row_bytes(fmt, cols);
    TORCH_CHECK(rb > 0 && t.size(2) * t.size(1) >= rb * rows, name, ": not whole blocks of its format");
  } else {
    TORCH_CHECK(t.size(2) == cols, name, ": bank shapes disagree");
    TORCH_CHECK(t.dtype() == torch::kBFloat16 || t.dtype() == torch::kFloat32, name, ": bfloat16 or float32");
  }
  return Mat{static_cast<const uint8_t*>(t.data_ptr()), fmt, t.dtype() == torch::kBFloat16,
             t.stride(0) * static_cast<int64_t>(t.element_size())};
}

Vec vec_of(const c10::optional<torch::Tensor>& b, int64_t E, int64_t n, const char* name) {
  if (!b.has_value() || !b->defined()) return Vec{};
  TORCH_CHECK(b->is_contiguous() && b->size(0) == E && b->size(1) == n, "bad ", name);
  TORCH_CHECK(b->dtype() == torch::kBFloat16 || b->dtype() == torch::kFloat32, name, ": bfloat16 or float32");
  return Vec{b->data_ptr(), b->dtype() == torch::kBFloat16};
}

}  // namespace

int64_t cpu_tier() { return best_tier(); }

void set_thread_team(TeamRun run, void* team) {
  tls_team_run = run;
  tls_team = team;
}

// x [T, H] float32; gate_up [E, 2I, H] and down [E, H, I] contiguous, each bf16 or float32 or
// packed (uint8 [E, rows, row bytes] in format gu_fmt / dn_fmt, freetoken/quant's codes; an
// expert's bytes start its row, which may be wider); the optional biases gu_bias [E, 2I] and
// dn_bias [E, H] in bf16 or float32; tok/exp [R] int64, weights [R] float32, out [T, H] float32
// (accumulated into); act: ExpertSpec's code; int8: packed banks may take int8 activations
// (about 0.5% relative error on a dot product: for models computing in BF16); first_row: the
// first intermediate row computed (0: the whole expert): the rows before it, with their
// gate_up bias, are the GPU's (a miss split by its rows); the down bias is added here.
void moe_experts(torch::Tensor x, torch::Tensor gate_up, torch::Tensor down,
                 c10::optional<torch::Tensor> gu_bias, c10::optional<torch::Tensor> dn_bias,
                 torch::Tensor tok, torch::Tensor exp, torch::Tensor weights, torch::Tensor out,
                 int64_t tier, int64_t act, double alpha, double limit, int64_t gu_fmt, int64_t dn_fmt,
                 bool int8, int64_t first_row) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.sizes() == x.sizes(), "bad out");
  TORCH_CHECK(tok.dtype() == torch::kInt64 && exp.dtype() == torch::kInt64, "routes must be int64");
  TORCH_CHECK(weights.dtype() == torch::kFloat32, "route weights must be float32");
  TORCH_CHECK(act >= 0 && act <= 2, "unknown expert activation");
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(1) % 2 == 0, "gate_up must be [E, 2I, ...]");
  const int64_t T = x.size(0), H = x.size(1), I = gate_up.size(1) / 2, R = tok.numel(), E = gate_up.size(0);
  TORCH_CHECK(down.size(0) == E, "banks disagree on the expert count");
  TORCH_CHECK(first_row >= 0 && first_row < I, "first intermediate row out of range");
  const Experts w{mat_of(gate_up, gu_fmt, 2 * I, H, "gate_up"), mat_of(down, dn_fmt, H, I, "down"),
                  vec_of(gu_bias, E, 2 * I, "gate_up bias"), vec_of(dn_bias, E, H, "down bias")};
  auto tk = tok.data_ptr<int64_t>();
  auto ex = exp.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(tk[r] >= 0 && tk[r] < T && ex[r] >= 0 && ex[r] < E, "route out of range");
  }
  if (R == 0) return;
  if (tier < 0) tier = best_tier();
  TORCH_CHECK(tier <= best_tier(), "this CPU does not support the requested instruction set");
  Act a{act, static_cast<float>(alpha), static_cast<float>(limit)};
  const float* xp = x.data_ptr<float>();
  std::vector<uint16_t> xb;  // bf16 activations for AVX-512-BF16's dot products of bf16 weights
  if (tier == AVX512BF16 && (w.gate_up.bf16 || w.down.bf16)) {
    xb.resize(T * H);
    for (int64_t i = 0; i < T * H; ++i) xb[i] = f32_to_bf16(xp[i]);
  }
  run(xp, xb.empty() ? nullptr : xb.data(), w, tk, ex, weights.data_ptr<float>(), R, T, H, I, first_row,
      out.data_ptr<float>(), tier, a, int8);
}

// y = rows . x for packed rows [n, row bytes] in format fmt (x: cols float32): the packed dot
// products alone, for tests; int8 takes the int8 kernel where this CPU has one.
torch::Tensor quant_matvec(torch::Tensor rows, torch::Tensor x, int64_t fmt, int64_t tier, bool int8) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 1, "x must be float32 [cols]");
  TORCH_CHECK(rows.dtype() == torch::kUInt8 && rows.is_contiguous() && rows.dim() == 2,
              "rows must be uint8 [n, row bytes]");
  const int64_t n = rows.size(0), cols = x.numel();
  TORCH_CHECK(quant_row_bytes(fmt, cols) > 0 && rows.size(1) == quant_row_bytes(fmt, cols), "rows and x disagree");
  if (tier < 0) tier = best_tier();
  TORCH_CHECK(tier <= best_tier(), "this CPU does not support the requested instruction set");
  auto y = torch::empty({n}, x.options());
  const Mat m{rows.data_ptr<uint8_t>(), fmt, false, 0};
  const Int8Act q(m, int8, static_cast<int>(tier), 1, cols);
  q.prepare(0, x.data_ptr<float>());
  mat_rows(m, 0, 0, static_cast<int>(n), cols, x.data_ptr<float>(), nullptr, q.at(0), y.data_ptr<float>(),
           static_cast<int>(tier));
  return y;
}

// lane.cpp
void lane_serve(torch::Tensor ctl, torch::Tensor pos, torch::Tensor ids, torch::Tensor wts, torch::Tensor x,
                torch::Tensor out, std::vector<torch::Tensor> gate_ups, std::vector<torch::Tensor> downs,
                std::vector<torch::Tensor> gu_biases, std::vector<torch::Tensor> dn_biases,
                std::vector<int64_t> gu_fmts, std::vector<int64_t> dn_fmts, std::vector<int64_t> cpus, int64_t tier,
                int64_t act, double alpha, double limit, bool int8, int64_t spin_us, bool give_way);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_experts", &moe_experts, "routed gated experts on the CPU",
        py::call_guard<py::gil_scoped_release>());
  m.def("lane_serve", &lane_serve, "serve expert requests posted by GPU kernels until told to stop",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_matvec", &quant_matvec, "packed rows . x (the packed dot products alone, for tests)");
  m.def(
      "has_int8_kernel",
      [](int64_t fmt, int64_t tier) {
        return int8_kernel(fmt, tier < 0 ? best_tier() : static_cast<int>(tier)) != NO_INT8;
      },
      "whether this CPU has an int8-activation kernel for a format code at a tier (-1: its best)",
      py::arg("fmt"), py::arg("tier") = -1);
  m.def("quant_set_prefetch_bytes", &quant_set_prefetch_bytes,
        "bytes the int8 kernels prefetch ahead in software (0: none); returns the last value");
  m.def("cpu_tier", &cpu_tier, "best instruction-set tier of this CPU (0 scalar .. 3 AVX-512-BF16)");
}
