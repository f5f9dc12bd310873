// The expert kernels of cpu_experts.cpp without torch (its worker and bindings include them):
// see that file's comment.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "team.h"

namespace moestream_native {

enum ScaleType : int64_t { SCALE_BF16 = 0, SCALE_F16 = 1, SCALE_F32 = 2 };

// The layout tensor's entries (int64 [LAYOUT_LEN]), written by moestream.cpu_share.kernels.layout.
enum LayoutIndex {
  L_HIDDEN, L_INTER, L_BITS_GU, L_BITS_D, L_GROUP, L_SCALE_TYPE,
  L_GATE_W, L_GATE_S, L_GATE_B, L_UP_W, L_UP_S, L_UP_B, L_DOWN_W, L_DOWN_S, L_DOWN_B,
  L_INT8_ACTS, L_RECORD_BYTES, LAYOUT_LEN
};

constexpr int ROW_BLOCK = 8;  // output rows per task

struct Layout {
  int64_t hidden = 0, inter = 0, bits_gu = 0, bits_d = 0, group = 0, scale_type = 0;
  int64_t gate_w = 0, gate_s = 0, gate_b = 0, up_w = 0, up_s = 0, up_b = 0, down_w = 0, down_s = 0, down_b = 0;
  int64_t int8_acts = 0;  // 1: the int8 rows (int8_rows.h) where compiled in, else the float ones
  int64_t record_bytes = 0;

  static Layout of(const int64_t* v) {
    Layout l;
    l.hidden = v[L_HIDDEN]; l.inter = v[L_INTER]; l.bits_gu = v[L_BITS_GU]; l.bits_d = v[L_BITS_D];
    l.group = v[L_GROUP]; l.scale_type = v[L_SCALE_TYPE];
    l.gate_w = v[L_GATE_W]; l.gate_s = v[L_GATE_S]; l.gate_b = v[L_GATE_B];
    l.up_w = v[L_UP_W]; l.up_s = v[L_UP_S]; l.up_b = v[L_UP_B];
    l.down_w = v[L_DOWN_W]; l.down_s = v[L_DOWN_S]; l.down_b = v[L_DOWN_B];
    l.int8_acts = v[L_INT8_ACTS];
    l.record_bytes = v[L_RECORD_BYTES];
    return l;
  }

  // Empty where the layout is one these kernels compute, else why not.
  std::string refusal() const {
    if (hidden <= 0 || inter <= 0) return "no layout for this layer";
    if ((bits_gu != 4 && bits_gu != 8) || (bits_d != 4 && bits_d != 8)) return "codes of other than 4 or 8 bits";
    if (group != 32 && group != 64 && group != 128 && group != 256) return "a group size other than 32, 64, 128 or 256";
    if (hidden % group || inter % group) return "hidden or intermediate size not a multiple of the group size";
    if (scale_type < SCALE_BF16 || scale_type > SCALE_F32) return "scales of an unknown dtype";
    return "";
  }
};

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    float f = float(man) * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int64_t type>
inline float scale_at(const uint8_t* p, int64_t i) {
  if constexpr (type == SCALE_F32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  if constexpr (type == SCALE_BF16) return bf16_to_float(h);
  return f16_to_float(h);
}

// One token's input to a matrix of K inputs, as the rows' loops read it: 4-bit, the even inputs
// then the odd ones (K/2 each); 8-bit, as it is; then the K/G group sums. The int8 rows read q and
// qscale instead of v (int8_rows.h).
struct Input {
  std::vector<float> v, sums;
  std::vector<int8_t> q;
  std::vector<float> qscale;
};

void prepare_float(const float* x, int64_t K, int64_t group, int64_t bits, Input& in) {
  in.v.resize(K);
  in.sums.resize(K / group);
  if (bits == 4) {
    const int64_t half = K / 2;
    for (int64_t j = 0; j < half; ++j) {
      in.v[j] = x[2 * j];
      in.v[half + j] = x[2 * j + 1];
    }
  } else {
    std::memcpy(in.v.data(), x, K * sizeof(float));
  }
  for (int64_t g = 0; g < K / group; ++g) {
    float s = 0.f;
    for (int64_t k = 0; k < group; ++k) s += x[g * group + k];
    in.sums[g] = s;
  }
}

// A vector of floats and the steps the row loops take with it: AVX-512 or AVX2 where the compiler
// targets them (-march=native), else plain loops the compiler vectorizes as it can. Each step turns
// a run of code bytes into floats (zero-extended, the nibbles masked and shifted) and multiplies
// them into partial sums, so a group's products stay in registers until its scale.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int W = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vset(float s) { return _mm512_set1_ps(s); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline __m512i widen(const uint8_t* c) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))); }
inline Vec low_nibbles(__m512i b) { return _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))); }
inline Vec high_nibbles(__m512i b) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)); }
inline Vec bytes(__m512i b) { return _mm512_cvtepi32_ps(b); }
#define NATIVE_VECTORS 1
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int W = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vset(float s) { return _mm256_set1_ps(s); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline float vsum(Vec v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline __m256i widen(const uint8_t* c) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))); }
inline Vec low_nibbles(__m256i b) { return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))); }
inline Vec high_nibbles(__m256i b) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }
inline Vec bytes(__m256i b) { return _mm256_cvtepi32_ps(b); }
#define NATIVE_VECTORS 1
#endif

// How far ahead of the codes being read a row's loop asks for the next ones (bytes; 0: never). The
// records sit in 4 KiB pages of pinned host RAM, and the hardware's prefetchers stop at a page's
// end, so each page would start with misses taken one at a time.
constexpr int64_t PREFETCH_AHEAD = 1024;

inline void prefetch_codes(const uint8_t* p) {
#if defined(__x86_64__) || defined(__i386__)
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}

// sum_k w[n, k] x[k] for one row of 4-bit codes (K/2 bytes), G inputs per group, scales of type ST;
// x as `prepare` left it (even inputs, then odd ones; group sums). The biases times the group sums
// are added apart.
template <int G, int64_t ST>
float row4(const uint8_t* __restrict codes, const uint8_t* __restrict scales, const uint8_t* __restrict biases,
           const Input& in, int64_t K) {
  const float* __restrict xv = in.v.data();
  const float* __restrict xsums = in.sums.data();
  constexpr int B = G / 2;  // bytes per group
  const float* __restrict even = xv;
  const float* __restrict odd = xv + K / 2;
  const int64_t groups = K / G;
  float bias_part = 0.f;
#ifdef NATIVE_VECTORS
  static_assert(B % W == 0, "a group is whole vectors of bytes");
  Vec acc = vzero();
  constexpr int64_t ahead = PREFETCH_AHEAD;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * B;
    const float* e = even + g * B;
    const float* o = odd + g * B;
    if (ahead) {  // one prefetch per 64-byte line the group starts
      for (int64_t k = (64 - (g * B) % 64) % 64; k < B; k += 64) prefetch_codes(c + k + ahead);
    }
    Vec d = vzero();
#pragma GCC unroll 8
    for (int j = 0; j < B; j += W) {
      const auto b = widen(c + j);
      d = vfma(low_nibbles(b), vload(e + j), d);
      d = vfma(high_nibbles(b), vload(o + j), d);
    }
    acc = vfma(vset(scale_at<ST>(scales, g)), d, acc);
    bias_part += scale_at<ST>(biases, g) * xsums[g];
  }
  return vsum(acc) + bias_part;
#else
  float acc = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * B;
    const float* e = even + g * B;
    const float* o = odd + g * B;
    float d = 0.f;
#pragma omp simd reduction(+ : d)
    for (int j = 0; j < B; ++j) d += float(c[j] & 15) * e[j] + float(c[j] >> 4) * o[j];
    acc += scale_at<ST>(scales, g) * d;
    bias_part += scale_at<ST>(biases, g) * xsums[g];
  }
  return acc + bias_part;
#endif
}

// The same for 8-bit codes (K bytes; x as it is).
template <int G, int64_t ST>
float row8(const uint8_t* __restrict codes, const uint8_t* __restrict scales, const uint8_t* __restrict biases,
           const Input& in, int64_t K) {
  const float* __restrict xv = in.v.data();
  const float* __restrict xsums = in.sums.data();
  const int64_t groups = K / G;
  float bias_part = 0.f;
#ifdef NATIVE_VECTORS
  static_assert(G % W == 0, "a group is whole vectors of bytes");
  Vec acc = vzero();
  constexpr int64_t ahead = PREFETCH_AHEAD;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * G;
    const float* e = xv + g * G;
    if (ahead) {
      for (int64_t k = 0; k < G; k += 64) prefetch_codes(c + k + ahead);
    }
    Vec d = vzero();
#pragma GCC unroll 8
    for (int j = 0; j < G; j += W) d = vfma(bytes(widen(c + j)), vload(e + j), d);
    acc = vfma(vset(scale_at<ST>(scales, g)), d, acc);
    bias_part += scale_at<ST>(biases, g) * xsums[g];
  }
  return vsum(acc) + bias_part;
#else
  float acc = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * G;
    const float* e = xv + g * G;
    float d = 0.f;
#pragma omp simd reduction(+ : d)
    for (int j = 0; j < G; ++j) d += float(c[j]) * e[j];
    acc += scale_at<ST>(scales, g) * d;
    bias_part += scale_at<ST>(biases, g) * xsums[g];
  }
  return acc + bias_part;
#endif
}

}  // namespace moestream_native

#include "int8_rows.h"

namespace moestream_native {

// x prepared for the float rows or, with `int8`, the int8 ones.
void prepare(const float* x, int64_t K, int64_t group, int64_t bits, bool int8, Input& in) {
  if (int8) {
    prepare_int8(x, K, group, bits, in);
  } else {
    prepare_float(x, K, group, bits, in);
  }
}

// Whether a job of layout L runs the int8 rows: asked for, and compiled in.
inline bool int8_activations(const Layout& L) { return INT8_ROWS && L.int8_acts != 0; }

using RowFn = float (*)(const uint8_t*, const uint8_t*, const uint8_t*, const Input&, int64_t);

template <int64_t ST>
RowFn row_fn_of(int64_t bits, int64_t group, [[maybe_unused]] bool int8) {
#ifdef NATIVE_INT8_ROWS
  if (int8 && bits == 4) {
    switch (group) { case 32: return row_int8<4, 32, ST>; case 64: return row_int8<4, 64, ST>; case 128: return row_int8<4, 128, ST>; default: return row_int8<4, 256, ST>; }
  }
  if (int8) {
    switch (group) { case 32: return row_int8<8, 32, ST>; case 64: return row_int8<8, 64, ST>; case 128: return row_int8<8, 128, ST>; default: return row_int8<8, 256, ST>; }
  }
#endif
  if (bits == 4) {
    switch (group) { case 32: return row4<32, ST>; case 64: return row4<64, ST>; case 128: return row4<128, ST>; default: return row4<256, ST>; }
  }
  switch (group) { case 32: return row8<32, ST>; case 64: return row8<64, ST>; case 128: return row8<128, ST>; default: return row8<256, ST>; }
}

// The row product for codes of `bits`, `group` inputs per scale, scales of `stype` (checked by
// Layout::refusal), on int8 activations with `int8` (where compiled in: see int8_activations).
RowFn row_fn(int64_t bits, int64_t group, int64_t stype, bool int8) {
  if (stype == SCALE_BF16) return row_fn_of<SCALE_BF16>(bits, group, int8);
  if (stype == SCALE_F16) return row_fn_of<SCALE_F16>(bits, group, int8);
  return row_fn_of<SCALE_F32>(bits, group, int8);
}

// One projection of one record: its rows' code bytes, scales and biases.
struct Matrix {
  const uint8_t* w;
  const uint8_t* s;
  const uint8_t* b;
  int64_t row_bytes, row_groups;
};

inline Matrix matrix(const uint8_t* record, int64_t w, int64_t s, int64_t b, int64_t K, int64_t bits, int64_t group) {
  return Matrix{record + w, record + s, record + b, K * bits / 8, K / group};
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

struct Pair {
  int expert;  // index into the job's records
  int token;
  float weight;
  float* out;  // [H]
};

// The job's scratch, kept between jobs (the worker's) or made per call (the standalone entry point).
struct Scratch {
  std::vector<Input> x_in;      // per token: x for gate/up
  std::vector<Input> h_in;      // per pair: h for down
  std::vector<float> h;         // per pair: [I]
  std::vector<int> token_used;  // per token: 1 where some pair reads it
};

// Splits `tasks` over a team's members as they come (one atomic counter per loop), so a member that
// starts late or is preempted takes fewer of them instead of holding the others at the barrier. In
// chunks of about half a member's share: one counter taken by 14 cores for every task of 8 rows
// serialized a job on that cache line (~22 GB/s whatever the arithmetic or the memory; the H200
// machine).
struct Dealer {
  std::atomic<int64_t> next{0};
  static int64_t chunk_for(int64_t tasks, int members) { return std::max<int64_t>(1, (tasks + 2 * members - 1) / (2 * members)); }
  template <class F>
  void deal(int64_t tasks, int64_t chunk, F&& f) {
    for (int64_t a = next.fetch_add(chunk, std::memory_order_relaxed); a < tasks;
         a = next.fetch_add(chunk, std::memory_order_relaxed))
      for (int64_t t = a, b = std::min(tasks, a + chunk); t < b; ++t) f(t);
  }
};

// The weighted rows of `pairs` (their experts' records at `records`) for tokens x [T, H] (float32),
// on `team`: the gate/up rows of all the experts, a barrier, the down inputs, a barrier, the down rows.
void compute_job(const Layout& L, const std::vector<const uint8_t*>& records, const std::vector<Pair>& pairs,
                 const float* x, int64_t T, Team& team, Scratch& sc) {
  const int64_t H = L.hidden, I = L.inter;
  const int64_t n_experts = int64_t(records.size()), P = int64_t(pairs.size());
  if (P == 0) return;
  const bool int8 = int8_activations(L);
  sc.x_in.resize(T);
  sc.token_used.assign(T, 0);
  for (const Pair& p : pairs) sc.token_used[p.token] = 1;
  for (int64_t t = 0; t < T; ++t)
    if (sc.token_used[t]) prepare(x + t * H, H, L.group, L.bits_gu, int8, sc.x_in[t]);
  sc.h.resize(P * I);
  sc.h_in.resize(P);
  // the pairs of each expert, in order
  std::vector<std::vector<int>> of_expert(n_experts);
  for (int64_t p = 0; p < P; ++p) of_expert[pairs[p].expert].push_back(int(p));
  const RowFn gu_row = row_fn(L.bits_gu, L.group, L.scale_type, int8), d_row = row_fn(L.bits_d, L.group, L.scale_type, int8);
  const int64_t gu_blocks = (I + ROW_BLOCK - 1) / ROW_BLOCK, d_blocks = (H + ROW_BLOCK - 1) / ROW_BLOCK;
  std::vector<Matrix> gate(n_experts), up(n_experts), down(n_experts);
  for (int64_t e = 0; e < n_experts; ++e) {
    gate[e] = matrix(records[e], L.gate_w, L.gate_s, L.gate_b, H, L.bits_gu, L.group);
    up[e] = matrix(records[e], L.up_w, L.up_s, L.up_b, H, L.bits_gu, L.group);
    down[e] = matrix(records[e], L.down_w, L.down_s, L.down_b, I, L.bits_d, L.group);
  }
  const int64_t stype = L.scale_type;
  const int64_t scale_item = stype == SCALE_F32 ? 4 : 2;
  Dealer gu_tasks, h_tasks, d_tasks;
  const int members = team.size();
  team.run([&](int, int) {
    gu_tasks.deal(n_experts * gu_blocks, Dealer::chunk_for(n_experts * gu_blocks, members), [&](int64_t task) {
      const int64_t e = task / gu_blocks, n0 = (task % gu_blocks) * ROW_BLOCK, n1 = std::min(I, n0 + ROW_BLOCK);
      const Matrix& g = gate[e];
      const Matrix& u = up[e];
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *gw = g.w + n * g.row_bytes, *gs = g.s + n * g.row_groups * scale_item,
                      *gb = g.b + n * g.row_groups * scale_item;
        const uint8_t *uw = u.w + n * u.row_bytes, *us = u.s + n * u.row_groups * scale_item,
                      *ub = u.b + n * u.row_groups * scale_item;
        for (int p : of_expert[e]) {
          const Input& in = sc.x_in[pairs[p].token];
          const float hg = gu_row(gw, gs, gb, in, H);
          const float hu = gu_row(uw, us, ub, in, H);
          sc.h[p * I + n] = silu(hg) * hu;
        }
      }
    });
    team.barrier();
    h_tasks.deal(P, 1, [&](int64_t p) { prepare(sc.h.data() + p * I, I, L.group, L.bits_d, int8, sc.h_in[p]); });
    team.barrier();
    d_tasks.deal(n_experts * d_blocks, Dealer::chunk_for(n_experts * d_blocks, members), [&](int64_t task) {
      const int64_t e = task / d_blocks, n0 = (task % d_blocks) * ROW_BLOCK, n1 = std::min(H, n0 + ROW_BLOCK);
      const Matrix& d = down[e];
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *dw = d.w + n * d.row_bytes, *ds = d.s + n * d.row_groups * scale_item,
                      *db = d.b + n * d.row_groups * scale_item;
        for (int p : of_expert[e]) {
          const Input& in = sc.h_in[p];
          pairs[p].out[n] = pairs[p].weight * d_row(dw, ds, db, in, I);
        }
      }
    });
  });
}

}  // namespace moestream_native
