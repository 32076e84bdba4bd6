// The CPU lane: serves expert requests that GPU kernels post into pinned host memory.
//
// A decode step replayed from one CUDA graph cannot stop for the host. So the graph copies a
// layer's activations, CPU routes and layer position into a mailbox in pinned memory and
// then raises a sequence number; this loop, on a thread of its own with the GIL released, sees the number change,
// computes those routes with the expert kernel and raises `done`; a later kernel in the
// same graph spins on `done` before adding the CPU's output. No host round trip per layer.
//
// ctl (int64, pinned): [0] seq (GPU), [1] done (CPU), [2] routes computed (CPU), [3] stop
// (host), [4] requests served (CPU), [5] requests that failed (CPU), [6] waits the GPU gave
// up (GPU), [7] nanoseconds spent serving (CPU): with the GPU's polls they show which side
// a layer waits for; [8] the members a request may run on, the loop's thread included (host;
// 0: all), [9] members that ran the requests' passes, summed (CPU), [10] those passes (CPU).
// The mailbox: pos (the layer's position in the bank lists, the routes a token k, the tokens
// T), ids and wts (T·k routes, token-major), x [T rows of MAX_TOKENS]; the answer: out, T rows.
// The loop's thread and its team of workers are pinned one to a physical core (moe/lane.py
// chooses which: every one but the first, left to the threads that wake during a step).
//
// The team is the lane's own threads, not OpenMP's: libgomp's workers spin only 100 times
// before sleeping where its threads outnumber the cores (the engine's pool and the lane's
// together do), so each request woke 15 sleeping cores. On the 16-core GPU machine the lane
// at two routes a request read 30 GB/s where the kernel called back to back read 62, and
// through the server cpu-misses' requests read 14-18 GB/s. The lane's workers spin while
// requests keep coming, as its loop does, and nap when it idles.
#include <torch/extension.h>
#include <immintrin.h>

#include <sched.h>
#include <sys/prctl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

void moe_experts(torch::Tensor x, torch::Tensor gate_up, torch::Tensor down,
                 c10::optional<torch::Tensor> gu_bias, c10::optional<torch::Tensor> dn_bias,
                 torch::Tensor tok, torch::Tensor exp, torch::Tensor weights, torch::Tensor out,
                 int64_t tier, int64_t act, double alpha, double limit, int64_t gu_fmt, int64_t dn_fmt, bool int8,
                 int64_t first_row);
void set_thread_team(void (*run)(void*, void (*)(void*), void*), void* team);

// The banks of every layer the lane serves, their formats, and what their experts compute.
struct LaneBanks {
  std::vector<torch::Tensor> gate_ups, downs, gu_biases, dn_biases;  // biases: empty, or one per layer
  std::vector<int64_t> gu_fmts, dn_fmts;  // each layer's packed format codes (0: float)
  int64_t act;
  double alpha, limit;
  bool int8;  // packed banks may take int8 activations (moe_experts)
};

namespace {

inline int64_t load_acquire(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// Spin for `spin` after the last request (the lane's setting, moe/lane.py says why), then poll
// gently, and after a second without work more gently still: a server that idles keeps its
// lane, and a millisecond once per idle spell is nothing against a first token.
constexpr auto kNap = std::chrono::microseconds(50);
constexpr auto kDrowse = std::chrono::seconds(1);
constexpr auto kLongNap = std::chrono::milliseconds(1);

// One wait of a thread with nothing to do, `busy` when it last had something.
inline void idle(std::chrono::steady_clock::time_point busy, std::chrono::microseconds spin) {
  const auto quiet = std::chrono::steady_clock::now() - busy;
  if (quiet > kDrowse) std::this_thread::sleep_for(kLongNap);
  else if (quiet > spin) std::this_thread::sleep_for(kNap);
  else _mm_pause();
}

// Puts the calling worker under SCHED_IDLE, where the lane's setting asks. With the team
// spinning on every core but one, the engine, the server and its client shared that one (in
// split a step took the host's time, not the GPU's). Linux places a waking thread on a core
// that runs only SCHED_IDLE threads as on an idle one, and lets it preempt them at once;
// with no one else to run, such a worker has its core as before. An unprivileged thread may
// take the policy (not leave it: it keeps it until it ends). Best effort, as pinning is.
void idle_policy() {
  sched_param none{};
  none.sched_priority = 0;
  sched_setscheduler(0, SCHED_IDLE, &none);
}

// Pins the calling thread to `cpu` and makes its naps as long as asked. Linux lets a timed
// sleep run late by the thread's timer slack, 50 us by default: a 50 us nap took ~100 us,
// and a request that found the team napping waited that long for its threads to wake (135
// against 83 us a nap, measured with Python's sleep on a development VM).
void pin_to(int64_t cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(static_cast<int>(cpu), &set);
  sched_setaffinity(0, sizeof(set), &set);  // best effort: a refusal leaves the thread unpinned
  prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);  // 1 us; best effort as well
}

// Workers pinned one to each of `cpus`; run() has the caller and every worker that joins in
// time call a task loop. A worker joins a run while it is open, and the caller closes it when
// its own loop returns (the tasks are all taken by then), waiting only for the workers that
// joined: one napping, or off its core, holds up nothing it has not started. The loop's own
// thread never gives way (a request waits for it to see it), the workers do where asked.
//
// The host may cut the team (ctl[8]): the workers left out nap instead of spinning, so their
// cores serve the threads that wake during a step. Fewer workers may make the step faster:
// through the server at 12 layers (H200, split, near-uniform routing) 8 CPU threads served one
// stream at 675 tok/s where 15 served 451 (adaptive measures which serves faster, shares.py).
class Team {
 public:
  Team(const std::vector<int64_t>& cpus, std::chrono::microseconds spin, bool give_way, int64_t* ctl)
      : spin_(spin), give_way_(give_way), ctl_(ctl) {
    for (size_t i = 0; i < cpus.size(); ++i) {
      const int64_t cpu = cpus[i];
      workers_.emplace_back([this, i, cpu] { work(static_cast<int64_t>(i), cpu); });
    }
  }
  ~Team() {
    stop_.store(true, std::memory_order_relaxed);
    for (auto& t : workers_) t.join();
  }

  static void run(void* self, void (*loop)(void*), void* ctx) { static_cast<Team*>(self)->run_all(loop, ctx); }

 private:
  // entry_: the open run's number above kJoinedBits, the workers that joined it below; 0: none
  static constexpr int kJoinedBits = 16;

  void run_all(void (*loop)(void*), void* ctx) {
    loop_ = loop;
    ctx_ = ctx;
    finished_.store(0, std::memory_order_relaxed);  // the last run's joiners all finished
    entry_.store(++runs_ << kJoinedBits, std::memory_order_release);
    loop(ctx);
    const uint64_t closed = entry_.exchange(0, std::memory_order_acq_rel);
    const uint64_t joined = closed & ((uint64_t{1} << kJoinedBits) - 1);
    while (finished_.load(std::memory_order_acquire) < joined) _mm_pause();
    ctl_[9] += static_cast<int64_t>(joined) + 1;
    ctl_[10] += 1;
  }

  // Whether worker `i` (the team's member i + 1) is in the team the host asks for.
  bool member(int64_t i) const {
    const int64_t size = load_acquire(ctl_ + 8);
    return size <= 0 || i + 1 < size;
  }

  // Joins run `run` if it is still open.
  bool join(uint64_t run) {
    uint64_t v = entry_.load(std::memory_order_acquire);
    while ((v >> kJoinedBits) == run) {
      if (entry_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
    }
    return false;
  }

  void work(int64_t i, int64_t cpu) {
    pin_to(cpu);
    if (give_way_) idle_policy();
    uint64_t seen = 0;
    auto busy = std::chrono::steady_clock::now();
    while (!stop_.load(std::memory_order_relaxed)) {
      if (!member(i)) {  // left out: its core is the host's, but for a wake-up a millisecond
        std::this_thread::sleep_for(kLongNap);
        busy = std::chrono::steady_clock::now();  // taken back, it spins for requests at once
        continue;
      }
      const uint64_t run = entry_.load(std::memory_order_acquire) >> kJoinedBits;
      if (run == 0 || run == seen) {
        idle(busy, spin_);
        continue;
      }
      seen = run;
      if (!join(run)) continue;
      loop_(ctx_);
      finished_.fetch_add(1, std::memory_order_release);
      busy = std::chrono::steady_clock::now();
    }
  }

  const std::chrono::microseconds spin_;
  const bool give_way_;
  int64_t* const ctl_;  // the lane's control block: the team's size, and its counts
  uint64_t runs_ = 0;  // the caller's count of runs
  std::atomic<uint64_t> entry_{0}, finished_{0};
  std::atomic<bool> stop_{false};
  void (*loop_)(void*) = nullptr;
  void* ctx_ = nullptr;
  std::vector<std::thread> workers_;
};

// The calling thread's kernel calls run on `team` (none: ATen's pool) while this lives.
struct TeamScope {
  explicit TeamScope(Team* team) {
    if (team) set_thread_team(&Team::run, team);
  }
  ~TeamScope() { set_thread_team(nullptr, nullptr); }
};

int64_t serve_one(const torch::Tensor& pos_t, const torch::Tensor& ids, const torch::Tensor& wts,
                  const torch::Tensor& x, torch::Tensor& out, const LaneBanks& b, int64_t tier) {
  const int64_t* head = pos_t.data_ptr<int64_t>();
  // head[3]: the first intermediate row the CPU computes (the GPU reads the rows before it)
  const int64_t pos = head[0], k = head[1], T = head[2], first = head[3];
  TORCH_CHECK(T >= 1 && T <= x.size(0) && k >= 1 && T * k <= ids.numel(), "lane: bad request size");
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* wp = wts.data_ptr<float>();
  std::vector<int64_t> tok, exp;
  std::vector<float> w;
  for (int64_t r = 0; r < T * k; ++r) {
    if (ip[r] >= 0) {
      tok.push_back(r / k);
      exp.push_back(ip[r]);
      w.push_back(wp[r]);
    }
  }
  torch::Tensor rows = out.narrow(0, 0, T);
  rows.zero_();
  if (exp.empty()) return 0;
  TORCH_CHECK(pos >= 0 && pos < static_cast<int64_t>(b.gate_ups.size()), "lane: layer position out of range");
  const int64_t n = static_cast<int64_t>(exp.size());
  auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  auto t = torch::from_blob(tok.data(), {n}, i64).clone();
  auto e = torch::from_blob(exp.data(), {n}, i64).clone();
  auto wt = torch::from_blob(w.data(), {n}, torch::TensorOptions().dtype(torch::kFloat32)).clone();
  c10::optional<torch::Tensor> gb, db;
  if (!b.gu_biases.empty()) gb = b.gu_biases[pos];
  if (!b.dn_biases.empty()) db = b.dn_biases[pos];
  moe_experts(x.narrow(0, 0, T), b.gate_ups[pos], b.downs[pos], gb, db, t, e, wt, rows, tier, b.act, b.alpha,
              b.limit, b.gu_fmts[pos], b.dn_fmts[pos], b.int8, first);
  return n;
}

}  // namespace

void lane_serve(torch::Tensor ctl, torch::Tensor pos, torch::Tensor ids, torch::Tensor wts, torch::Tensor x,
                torch::Tensor out, std::vector<torch::Tensor> gate_ups, std::vector<torch::Tensor> downs,
                std::vector<torch::Tensor> gu_biases, std::vector<torch::Tensor> dn_biases,
                std::vector<int64_t> gu_fmts, std::vector<int64_t> dn_fmts, std::vector<int64_t> cpus, int64_t tier,
                int64_t act, double alpha, double limit, bool int8, int64_t spin_us, bool give_way) {
  TORCH_CHECK(ctl.dtype() == torch::kInt64 && ctl.numel() >= 11, "lane: bad control block");
  TORCH_CHECK(ids.dtype() == torch::kInt64 && wts.dtype() == torch::kFloat32, "lane: bad routes");
  TORCH_CHECK(pos.dtype() == torch::kInt64 && pos.numel() >= 4, "lane: bad request head");
  TORCH_CHECK(x.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32 && x.dim() == 2 &&
                  x.sizes() == out.sizes(),
              "lane: bad activations");
  TORCH_CHECK(gate_ups.size() == downs.size(), "lane: banks disagree");
  TORCH_CHECK(gu_biases.empty() || gu_biases.size() == gate_ups.size(), "lane: biases disagree");
  TORCH_CHECK(dn_biases.empty() || dn_biases.size() == gate_ups.size(), "lane: biases disagree");
  TORCH_CHECK(gu_fmts.size() == gate_ups.size() && dn_fmts.size() == gate_ups.size(), "lane: formats disagree");
  const std::chrono::microseconds spin(spin_us);
  const LaneBanks banks{gate_ups, downs, gu_biases, dn_biases, gu_fmts, dn_fmts, act, alpha, limit, int8};
  // the loop's thread is the team's first member, its workers take the other cores; with no
  // cores named (their layout unknown) the requests run on ATen's pool
  std::unique_ptr<Team> team;
  if (!cpus.empty()) {
    pin_to(cpus[0]);
    team = std::make_unique<Team>(std::vector<int64_t>(cpus.begin() + 1, cpus.end()), spin, give_way,
                                  ctl.data_ptr<int64_t>());
  }
  const TeamScope scope(team.get());
  int64_t* c = ctl.data_ptr<int64_t>();
  int64_t last = load_acquire(c + 1);  // a request posted before the loop started is served
  auto busy = std::chrono::steady_clock::now();
  while (load_acquire(c + 3) == 0) {
    const int64_t s = load_acquire(c);
    if (s == last) {
      idle(busy, spin);
      continue;
    }
    last = s;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      c[2] += serve_one(pos, ids, wts, x, out, banks, tier);
    } catch (const std::exception&) {
      out.zero_();  // the GPU must not wait forever: it gets zeros, and the host sees the count
      c[5] += 1;
    }
    busy = std::chrono::steady_clock::now();
    c[7] += std::chrono::duration_cast<std::chrono::nanoseconds>(busy - t0).count();
    c[4] += 1;
    store_release(c + 1, s);
  }
}
