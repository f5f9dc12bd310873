// Routed experts on the CPU straight from the project's expert records (moestream.cpu_share.kernels):
// the CPU device's own experts (expert_sum, moestream.layers.native_experts) and packed resident
// matrices (packed_linear, moestream.layers.packed_matrix), and the device-driven CPU share's worker
// loop around them (moestream.cpu_share.worker).
//
// A record holds, per projection, uint32 code words (least-significant bits first: byte j of a 4-bit
// row holds codes 2j and 2j+1 in its low and high nibble) and one scale and one bias per group of
// inputs (w = scale * q + bias). So a row's product with x is, per group g,
//   scale_g * sum_k q_k x_k + bias_g * sum_k x_k,
// with x split once into its even and odd inputs (the low and high nibbles' partners) and its group
// sums taken once per token. MXFP4 records (moestream.quant.mxfp4) hold the same nibbles as e2m1
// codes with one power-of-two scale byte per 32 inputs and no biases: scale_g * sum_k e2m1(q_k) x_k.
// The inner step (expert_kernels.h) turns a run of code bytes into floats and multiplies them into a
// group's partial sums with AVX-512 or AVX2 where -march=native has them (gcc's own vectorization of
// the plain loop, kept for other CPUs, ran at a fraction of that), then one FMA by the group's scale;
// no reduction until the row ends. Float32 throughout.
// Where the layout asks for int8 activations and the CPU has AVX-512 VNNI, x and h are instead
// quantized per group to int8 and the codes multiplied as bytes (int8_rows.h), float32 across groups.
//
// The worker loop (Worker, below) serves the mailbox of moestream.cpu_share.share: it never
// takes the GIL; Python starts and stops it and reads its counters and per-job ring.
//
// A job: pairs (expert, token, weight) of one layer; for each distinct expert its gate and up rows
// (h = silu(gate) * up per token of it, or gpt-oss's clamped SwiGLU with the record's added biases:
// the layout says which), then its down rows (out = weight * down h, per pair), on a
// team of threads (team.h: spinning, pinned to cores in the worker): the gate/up rows of
// all its experts dealt out to the members, a barrier, then the down rows.
#include <torch/extension.h>

#include <memory>

#include "expert_kernels.h"

namespace {

using namespace moestream_native;

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// -- the entry points called from Python: the CPU's own experts (expert_sum), tests (weighted_rows) --
// Their team (unpinned), kept between calls while its size stays the same.
std::mutex standalone_lock;
std::unique_ptr<Team> standalone_team;

// Long enough to span the rest of a layer between two expert calls of a decode step on the CPU, short
// enough that a member does not keep spinning through the head and the sampling.
constexpr int64_t STANDALONE_SPIN_NS = 500'000;

// The team of `threads` members, made anew where the size changed; call with standalone_lock held.
Team& standalone(int64_t threads) {
  const int members = int(std::max<int64_t>(1, threads));
  if (!standalone_team || standalone_team->size() != members) {
    standalone_team.reset();  // its threads joined before the next one starts
    standalone_team = std::make_unique<Team>(members, STANDALONE_SPIN_NS, false);
  }
  return *standalone_team;
}

Layout checked_layout(const torch::Tensor& layout) {
  check(layout.dtype() == torch::kInt64 && layout.numel() == LAYOUT_LEN && layout.is_contiguous(),
        "layout: int64 [" + std::to_string(LAYOUT_LEN) + "]");
  const Layout L = Layout::of(layout.data_ptr<int64_t>());
  const std::string why = L.refusal();
  check(why.empty(), why);
  return L;
}

// out[t] = sum over a of weights[t, a] * ffn_{ids[t, a]}(x[t]) (float32 [T, H]): every pair's row from
// its expert's record in pool[table[ids[t, a]]] (pool uint8 [slots, slot bytes], table int32 [E]),
// each distinct record read once, then a token's rows added in the order of its picks. A pair whose
// expert has no slot (table < 0: a CPU share computes it) adds a row of zeros.
void expert_sum(torch::Tensor layout, torch::Tensor pool, torch::Tensor table, torch::Tensor ids, torch::Tensor weights,
                torch::Tensor x, torch::Tensor out, int64_t threads) {
  const Layout L = checked_layout(layout);
  check(pool.dtype() == torch::kUInt8 && pool.dim() == 2 && pool.stride(1) == 1, "pool: uint8 [slots, bytes]");
  check(table.dtype() == torch::kInt32 && table.dim() == 1 && table.is_contiguous(), "table: int32 [E]");
  check(ids.dtype() == torch::kInt64 && ids.dim() == 2 && ids.is_contiguous(), "ids: int64 [T, A]");
  check(weights.dtype() == torch::kFloat32 && weights.sizes() == ids.sizes() && weights.is_contiguous(),
        "weights: float32 [T, A]");
  const int64_t T = ids.size(0), A = ids.size(1), H = L.hidden, E = table.numel();
  check(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(0) == T && x.size(1) == H && x.is_contiguous(),
        "x: float32 [T, H]");
  check(out.dtype() == torch::kFloat32 && out.dim() == 2 && out.size(0) == T && out.size(1) == H && out.is_contiguous(),
        "out: float32 [T, H]");
  const int64_t* id = ids.data_ptr<int64_t>();
  const int32_t* slot = table.data_ptr<int32_t>();
  const float* w = weights.data_ptr<float>();
  const uint8_t* base = pool.data_ptr<uint8_t>();
  std::vector<int> record_of(E, -1);
  std::vector<const uint8_t*> records;
  std::vector<float> rows(T * A * H);
  std::vector<Pair> pairs;
  for (int64_t p = 0; p < T * A; ++p) {
    const int64_t e = id[p];
    check(e >= 0 && e < E, "an expert id out of range");
    check(slot[e] < pool.size(0), "a slot out of range");
    if (slot[e] < 0) continue;
    if (record_of[e] < 0) {
      record_of[e] = int(records.size());
      records.push_back(base + slot[e] * pool.stride(0));
    }
    pairs.push_back(Pair{record_of[e], int(p / A), w[p], rows.data() + p * H});
  }
  Scratch sc;
  float* y = out.data_ptr<float>();
  pybind11::gil_scoped_release free;
  std::lock_guard<std::mutex> hold(standalone_lock);
  compute_job(L, records, pairs, x.data_ptr<float>(), T, standalone(threads), sc);
  for (int64_t t = 0; t < T; ++t) {  // the same float32 adds, in the same order, as NativePlan.finish's
    const float* r = rows.data() + t * A * H;
    float* yt = y + t * H;
    std::memcpy(yt, r, H * sizeof(float));
    for (int64_t a = 1; a < A; ++a)
      for (int64_t h = 0; h < H; ++h) yt[h] += r[a * H + h];
  }
}

// out[t, n] = sum over k of w[n, k] x[t, k] (float32 [T, N]) for a resident matrix kept packed
// (moestream.layers.packed_matrix): codes int32 [N, K * bits / 32] (a record's layout: least
// significant bits first), scales and biases [N, K / group] of one dtype; x float32 [T, K]. Each
// row's codes are read once per TOKEN_BLOCK tokens (a prefill chunk's product is a matrix-matrix
// one); each output is one member's from start to end, in the same order whatever T or the team, so
// neither changes its bits. With `int8` (where compiled in) x is quantized per 32 inputs and the
// int8 rows run, as the experts' do.
void packed_linear(torch::Tensor codes, torch::Tensor scales, torch::Tensor biases, int64_t bits, int64_t group,
                   torch::Tensor x, torch::Tensor out, int64_t threads, bool int8) {
  check(codes.dtype() == torch::kInt32 && codes.dim() == 2 && codes.is_contiguous(), "codes: int32 [N, words]");
  const int64_t N = codes.size(0), K = codes.size(1) * 32 / bits, T = x.size(0);
  const int64_t stype = scales.dtype() == torch::kBFloat16 ? SCALE_BF16 : scales.dtype() == torch::kFloat16 ? SCALE_F16
                        : scales.dtype() == torch::kFloat32 ? SCALE_F32 : -1;
  check(stype >= 0 && biases.dtype() == scales.dtype(), "scales and biases: one of bfloat16, float16, float32");
  Layout L;
  L.hidden = K; L.inter = K; L.bits_gu = bits; L.bits_d = bits; L.group = group; L.scale_type = stype;
  const std::string why = L.refusal();
  check(why.empty(), why);
  for (const auto* t : {&scales, &biases})
    check(t->dim() == 2 && t->size(0) == N && t->size(1) == K / group && t->is_contiguous(), "scales, biases: [N, K / group]");
  check(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K && x.is_contiguous(), "x: float32 [T, K]");
  check(out.dtype() == torch::kFloat32 && out.dim() == 2 && out.size(0) == T && out.size(1) == N && out.is_contiguous(),
        "out: float32 [T, N]");
  const uint8_t* w = reinterpret_cast<const uint8_t*>(codes.data_ptr<int32_t>());
  const uint8_t* s = reinterpret_cast<const uint8_t*>(scales.data_ptr());
  const uint8_t* b = reinterpret_cast<const uint8_t*>(biases.data_ptr());
  const float* xs = x.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const int64_t row_bytes = K * bits / 8, row_scales = (K / group) * (stype == SCALE_F32 ? 4 : 2);
  const bool q8 = INT8_ROWS && int8;
  const Blocks kernels = blocks(bits, group, stype, q8);
  pybind11::gil_scoped_release free;
  std::vector<Input> in(T);
  std::vector<const Input*> inputs(T);
  for (int64_t t = 0; t < T; ++t) prepare(xs + t * K, K, group, bits, q8, in[t]), inputs[t] = &in[t];
  std::lock_guard<std::mutex> hold(standalone_lock);
  Team& team = standalone(threads);
  // a task: ROW_BLOCK rows, two at a time, for TOKEN_BLOCK tokens (their inputs stay in the L2)
  const int64_t row_blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK, tasks = row_blocks * ((T + TOKEN_BLOCK - 1) / TOKEN_BLOCK);
  Dealer rows;
  team.run([&](int, int members) {
    rows.deal(tasks, Dealer::chunk_for(tasks, members), [&](int64_t task) {
      const int64_t t0 = task / row_blocks * TOKEN_BLOCK, m = std::min(TOKEN_BLOCK, T - t0);
      const int64_t n0 = task % row_blocks * ROW_BLOCK, n1 = std::min(N, n0 + ROW_BLOCK);
      for (int64_t n = n0; n < n1; n += 2) {
        const int pair = int(std::min<int64_t>(2, n1 - n));
        const uint8_t *rw[2], *rs[2], *rb[2];
        float* out[2];
        for (int r = 0; r < pair; ++r) {
          rw[r] = w + (n + r) * row_bytes, rs[r] = s + (n + r) * row_scales, rb[r] = b + (n + r) * row_scales;
          out[r] = y + t0 * N + n + r;
        }
        kernels.run(pair, rw, rs, rb, inputs.data() + t0, m, K, out, N);
      }
    });
  });
}

// out[p] = weights[p] * ffn_{experts[p]}(x[tokens[p]]) for records at `addresses` (int64 [n]).

void weighted_rows(torch::Tensor layout, torch::Tensor addresses, torch::Tensor experts, torch::Tensor tokens,
                   torch::Tensor weights, torch::Tensor x, torch::Tensor out, int64_t threads) {
  const Layout L = checked_layout(layout);
  check(addresses.dtype() == torch::kInt64 && addresses.is_contiguous(), "addresses: int64");
  check(experts.dtype() == torch::kInt32 && tokens.dtype() == torch::kInt32 && weights.dtype() == torch::kFloat32,
        "experts, tokens: int32; weights: float32");
  check(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == L.hidden && x.is_contiguous(), "x: float32 [T, H]");
  check(out.dtype() == torch::kFloat32 && out.dim() == 2 && out.size(1) == L.hidden && out.is_contiguous() &&
            out.size(0) >= experts.numel(), "out: float32 [P, H]");
  const int64_t P = experts.numel(), T = x.size(0), n = addresses.numel();
  std::vector<const uint8_t*> records(n);
  for (int64_t i = 0; i < n; ++i) {
    records[i] = reinterpret_cast<const uint8_t*>(addresses.data_ptr<int64_t>()[i]);
    check(records[i] != nullptr, "a null record address");
  }
  std::vector<Pair> pairs(P);
  for (int64_t p = 0; p < P; ++p) {
    const int e = experts.data_ptr<int32_t>()[p], t = tokens.data_ptr<int32_t>()[p];
    check(e >= 0 && e < n && t >= 0 && t < T, "a pair's expert or token out of range");
    pairs[p] = Pair{e, t, weights.data_ptr<float>()[p], out.data_ptr<float>() + p * L.hidden};
  }
  Scratch sc;
  pybind11::gil_scoped_release free;
  std::lock_guard<std::mutex> hold(standalone_lock);
  compute_job(L, records, pairs, x.data_ptr<float>(), T, standalone(threads), sc);
}

// -- the worker loop of the device-driven share ----------------------------------------------------
// The mailbox (moestream.cpu_share.share): header int64 [5] (sequence number, layer, tokens,
// pairs, the call's misses), x_in [max tokens, H] (bfloat16 or float32), ids_in int32, w_in float32,
// mask_in int8 [max pairs], rows_out float32 [max pairs, H], ack int64 [1]. The device writes the
// sequence number last; the worker answers with it after the rows, or its negative on an error.
enum Counter { C_JOBS, C_EXPERTS, C_PAIRS, C_ERRORS, C_SKIPPED, C_BYTES, C_KERNEL_NS, C_JOB_NS, C_RING, C_LEN };
enum RingField { R_JOB_NS, R_KERNEL_NS, R_BYTES, R_EXPERTS, R_MISSES, R_LAYER, R_LEN };
enum Control { K_FAULT_AFTER, K_FAULT_DELAY_NS, K_LEN };

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline int64_t load_acquire(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void add_relaxed(int64_t* p, int64_t v) { __atomic_store_n(p, __atomic_load_n(p, __ATOMIC_RELAXED) + v, __ATOMIC_RELAXED); }

class Worker {
 public:
  // layouts: int64 [layers, LAYOUT_LEN] (a row of zeros: no share in that layer); addresses: int64 [layers,
  // experts] of record addresses in host RAM (0: not there); counters int64 [C_LEN] and ring int64
  // [R, R_LEN] for Python to read; control int64 [K_LEN] (tests' fault injection).
  Worker(torch::Tensor header, torch::Tensor x_in, torch::Tensor ids_in, torch::Tensor w_in, torch::Tensor mask_in,
         torch::Tensor rows_out, torch::Tensor ack, torch::Tensor layouts, torch::Tensor addresses,
         torch::Tensor counters, torch::Tensor ring, torch::Tensor control, int64_t threads, int64_t busy_ns,
         int64_t idle_sleep_ns)
      : header_(header), x_in_(x_in), ids_in_(ids_in), w_in_(w_in), mask_in_(mask_in), rows_out_(rows_out),
        ack_(ack), layouts_(layouts), addresses_(addresses), counters_(counters), ring_(ring), control_(control),
        threads_(int(std::max<int64_t>(1, threads))), busy_ns_(busy_ns), idle_sleep_ns_(idle_sleep_ns) {
    for (auto* t : {&header_, &ack_, &layouts_, &addresses_, &counters_, &ring_, &control_})
      check(t->dtype() == torch::kInt64 && t->is_contiguous(), "worker: an int64 tensor is not int64 or not contiguous");
    check(x_in_.dim() == 2 && (x_in_.dtype() == torch::kFloat32 || x_in_.dtype() == torch::kBFloat16) &&
              x_in_.is_contiguous(), "worker: x_in must be float32 or bfloat16 [T, H]");
    check(ids_in_.dtype() == torch::kInt32 && w_in_.dtype() == torch::kFloat32 && mask_in_.dtype() == torch::kInt8,
          "worker: ids int32, weights float32, mask int8");
    check(rows_out_.dtype() == torch::kFloat32 && rows_out_.dim() == 2 && rows_out_.is_contiguous() &&
              rows_out_.size(1) == x_in_.size(1), "worker: rows_out float32 [pairs, H]");
    check(layouts_.dim() == 2 && layouts_.size(1) == LAYOUT_LEN && addresses_.dim() == 2 &&
              addresses_.size(0) == layouts_.size(0),
          "worker: layouts [L, " + std::to_string(LAYOUT_LEN) + "] and addresses [L, E]");
    check(counters_.numel() >= C_LEN && ring_.dim() == 2 && ring_.size(1) == R_LEN && control_.numel() >= K_LEN,
          "worker: counters, ring or control too small");
    for (int64_t l = 0; l < layouts_.size(0); ++l) {
      const Layout L = Layout::of(layouts_.data_ptr<int64_t>() + l * LAYOUT_LEN);
      check(L.hidden == 0 || L.refusal().empty(), "worker: layer " + std::to_string(l) + ": " + L.refusal());
      check(L.hidden == 0 || L.hidden == x_in_.size(1), "worker: a layer's hidden size is not the mailbox's");
    }
  }

  ~Worker() { stop(); }

  void start() {
    check(!thread_.joinable(), "the worker is running");
    stop_.store(false);
    thread_ = std::thread([this] { serve(); });
  }

  void stop() {
    stop_.store(true);
    if (thread_.joinable()) {
      if (PyGILState_Check()) {
        pybind11::gil_scoped_release free;
        thread_.join();
      } else {
        thread_.join();
      }
    }
  }

  bool running() const { return thread_.joinable() && !finished_.load(); }

  // Whether the team's members are pinned to cores (known once serving started).
  bool pinned() const { return pinned_.load(); }

  std::string last_error() {
    std::lock_guard<std::mutex> hold(error_lock_);
    return last_error_;
  }

 private:
  void serve() {
    // the team lives on this thread: its member 0 is this poller, pinned with the others
    Team team(threads_, busy_ns_, true);
    pinned_.store(team.pinned() && team.pin_caller());
    team_ = &team;
    warm();
    int64_t* header = header_.data_ptr<int64_t>();
    int64_t* ack = ack_.data_ptr<int64_t>();
    int64_t done = 0, idle = now_ns();
    while (!stop_.load(std::memory_order_relaxed)) {
      const int64_t seq = load_acquire(header);
      if (seq == done) {
        if (now_ns() - idle < busy_ns_) {  // between a step's layers: poll, letting other threads run
          std::this_thread::yield();
        } else {  // between requests: nap
          std::this_thread::sleep_for(std::chrono::nanoseconds(idle_sleep_ns_));
        }
        continue;
      }
      const int64_t started = now_ns();
      read_request(header);
      if (load_acquire(header) != seq) {  // the device moved on while this was read: that call is lost
        add_relaxed(count(C_SKIPPED), 1);
        done = seq;
        continue;
      }
      int64_t kernel_ns = 0, nbytes = 0, experts = 0;
      try {
        run_job(kernel_ns, nbytes, experts);
        store_release(ack, seq);  // after the rows
        record(now_ns() - started, kernel_ns, nbytes, experts);
      } catch (const std::exception& exc) {
        {
          std::lock_guard<std::mutex> hold(error_lock_);
          last_error_ = "layer " + std::to_string(layer_) + ": " + exc.what();
        }
        add_relaxed(count(C_ERRORS), 1);
        store_release(ack, -seq);
      }
      done = seq;
      idle = now_ns();
    }
    team_ = nullptr;
    finished_.store(true);
  }

  // The team's threads started before the first job (its first run pays their start).
  void warm() {
    for (int r = 0; r < 3; ++r) team_->run([](int, int) { CPU_PAUSE(); });
  }

  int64_t* count(Counter c) { return counters_.data_ptr<int64_t>() + c; }

  void read_request(const int64_t* header) {
    layer_ = __atomic_load_n(header + 1, __ATOMIC_RELAXED);
    tokens_ = __atomic_load_n(header + 2, __ATOMIC_RELAXED);
    n_pairs_ = __atomic_load_n(header + 3, __ATOMIC_RELAXED);
    misses_ = __atomic_load_n(header + 4, __ATOMIC_RELAXED);
    const int64_t max_pairs = ids_in_.numel();
    if (n_pairs_ < 0 || n_pairs_ > max_pairs) n_pairs_ = 0;  // refused below, as an error
    ids_.assign(ids_in_.data_ptr<int32_t>(), ids_in_.data_ptr<int32_t>() + n_pairs_);
    w_.assign(w_in_.data_ptr<float>(), w_in_.data_ptr<float>() + n_pairs_);
    mask_.assign(mask_in_.data_ptr<int8_t>(), mask_in_.data_ptr<int8_t>() + n_pairs_);
  }

  void run_job(int64_t& kernel_ns, int64_t& nbytes, int64_t& experts) {
    const int64_t number = __atomic_load_n(count(C_JOBS), __ATOMIC_RELAXED);
    add_relaxed(count(C_JOBS), 1);
    const int64_t* control = control_.data_ptr<int64_t>();
    if (control[K_FAULT_DELAY_NS] > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(control[K_FAULT_DELAY_NS]));
    if (control[K_FAULT_AFTER] >= 0 && number >= control[K_FAULT_AFTER])
      throw std::runtime_error("injected fault in CPU job " + std::to_string(number));
    check(layer_ >= 0 && layer_ < layouts_.size(0), "layer out of range");
    const Layout L = Layout::of(layouts_.data_ptr<int64_t>() + layer_ * LAYOUT_LEN);
    check(L.hidden > 0, "no CPU share in this layer");
    const int64_t T = tokens_, max_tokens = x_in_.size(0), E = addresses_.size(1);
    check(T >= 1 && T <= max_tokens && n_pairs_ >= 1 && n_pairs_ % T == 0, "a malformed request");
    const int64_t picks = n_pairs_ / T, H = L.hidden;
    const int64_t* table = addresses_.data_ptr<int64_t>() + layer_ * E;
    records_.clear();
    pairs_.clear();
    slot_of_.assign(E, -1);
    float* rows = rows_out_.data_ptr<float>();
    for (int64_t p = 0; p < n_pairs_; ++p) {
      if (!mask_[p]) continue;
      const int32_t e = ids_[p];
      check(e >= 0 && e < E, "an expert id out of range");
      if (slot_of_[e] < 0) {
        check(table[e] != 0, "expert " + std::to_string(e) + " is not in host RAM");
        slot_of_[e] = int(records_.size());
        records_.push_back(reinterpret_cast<const uint8_t*>(table[e]));
      }
      pairs_.push_back(Pair{slot_of_[e], int(p / picks), w_[p], rows + p * H});
    }
    if (pairs_.empty()) return;
    // the tokens the pairs read, in float32
    x_.resize(T * H);
    if (x_in_.dtype() == torch::kFloat32) {
      std::memcpy(x_.data(), x_in_.data_ptr<float>(), T * H * sizeof(float));
    } else {
      const uint16_t* xb = reinterpret_cast<const uint16_t*>(x_in_.data_ptr<at::BFloat16>());
      for (int64_t i = 0; i < T * H; ++i) x_[i] = bf16_to_float(xb[i]);
    }
    const int64_t t0 = now_ns();
    compute_job(L, records_, pairs_, x_.data(), T, *team_, scratch_);
    kernel_ns = now_ns() - t0;
    experts = int64_t(records_.size());
    nbytes = L.record_bytes * experts;
  }

  void record(int64_t job_ns, int64_t kernel_ns, int64_t nbytes, int64_t experts) {
    add_relaxed(count(C_EXPERTS), experts);
    add_relaxed(count(C_PAIRS), int64_t(pairs_.size()));
    add_relaxed(count(C_BYTES), nbytes);
    add_relaxed(count(C_KERNEL_NS), kernel_ns);
    add_relaxed(count(C_JOB_NS), job_ns);
    const int64_t n = __atomic_load_n(count(C_RING), __ATOMIC_RELAXED), R = ring_.size(0);
    int64_t* slot = ring_.data_ptr<int64_t>() + (n % R) * R_LEN;
    slot[R_JOB_NS] = job_ns;
    slot[R_KERNEL_NS] = kernel_ns;
    slot[R_BYTES] = nbytes;
    slot[R_EXPERTS] = experts;
    slot[R_MISSES] = misses_;
    slot[R_LAYER] = layer_;
    store_release(count(C_RING), n + 1);  // the entry first, then its number
  }

  torch::Tensor header_, x_in_, ids_in_, w_in_, mask_in_, rows_out_, ack_, layouts_, addresses_, counters_, ring_,
      control_;
  int threads_;
  int64_t busy_ns_, idle_sleep_ns_;
  std::atomic<bool> pinned_{false};
  Team* team_ = nullptr;  // serve()'s, while it runs
  std::thread thread_;
  std::atomic<bool> stop_{false}, finished_{false};
  std::mutex error_lock_;
  std::string last_error_;
  // the request being served, and the job's scratch (kept between jobs)
  int64_t layer_ = 0, tokens_ = 0, n_pairs_ = 0, misses_ = 0;
  std::vector<int32_t> ids_;
  std::vector<float> w_;
  std::vector<int8_t> mask_;
  std::vector<int> slot_of_;
  std::vector<const uint8_t*> records_;
  std::vector<Pair> pairs_;
  std::vector<float> x_;
  Scratch scratch_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("expert_sum", &expert_sum, "out[t] = sum over a of weights[t, a] * ffn of the record of ids[t, a] at x[t]",
        pybind11::arg("layout"), pybind11::arg("pool"), pybind11::arg("table"), pybind11::arg("ids"),
        pybind11::arg("weights"), pybind11::arg("x"), pybind11::arg("out"), pybind11::arg("threads"));
  m.def("packed_linear", &packed_linear, "out = x @ w.T for a matrix of affine-quantized codes",
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("biases"), pybind11::arg("bits"),
        pybind11::arg("group"), pybind11::arg("x"), pybind11::arg("out"), pybind11::arg("threads"),
        pybind11::arg("int8"));
  m.def("weighted_rows", &weighted_rows, "out[p] = weights[p] * ffn of record experts[p] at x[tokens[p]]",
        pybind11::arg("layout"), pybind11::arg("addresses"), pybind11::arg("experts"), pybind11::arg("tokens"),
        pybind11::arg("weights"), pybind11::arg("x"), pybind11::arg("out"), pybind11::arg("threads"));
  m.attr("LAYOUT_LEN") = int(LAYOUT_LEN);
  m.attr("VNNI") = INT8_ROWS;  // whether layouts asking for int8 activations get them
  m.attr("COUNTERS") = int(C_LEN);
  m.attr("RING_FIELDS") = int(R_LEN);
  m.attr("CONTROLS") = int(K_LEN);
  pybind11::class_<Worker>(m, "Worker")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          int64_t, int64_t, int64_t>())
      .def("start", &Worker::start)
      .def("stop", &Worker::stop)
      .def("running", &Worker::running)
      .def("last_error", &Worker::last_error)
      .def("pinned", &Worker::pinned);
}
