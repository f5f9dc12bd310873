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

// The scales' type. SCALE_E8M0: MXFP4 records (moestream.quant.mxfp4): 4-bit e2m1 codes and one
// power-of-two scale byte per 32 inputs, w = e2m1(q) * 2^(e - 127), no biases in the groups.
enum ScaleType : int64_t { SCALE_BF16 = 0, SCALE_F16 = 1, SCALE_F32 = 2, SCALE_E8M0 = 3 };
constexpr int64_t MX_GROUP = 32;  // inputs per E8M0 scale

// The gate's activation: SwiGLU, silu(gate) * up; or gpt-oss's clamped SwiGLU, gate <= limit,
// |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate) (moestream.layers.clamped_swiglu).
enum Activation : int64_t { ACT_SILU = 0, ACT_CLAMPED_SWIGLU = 1 };
constexpr int64_t NO_BIAS = -1;  // the bias type of records without added biases

// The layout tensor's entries (int64 [LAYOUT_LEN]), written by moestream.cpu_share.kernels.layout:
// the sizes, the nine fields of the codes, the int8 choice, the activation (alpha and limit as
// float32 bits), the added biases' type (NO_BIAS: none) and offsets, and the record's bytes last.
enum LayoutIndex {
  L_HIDDEN, L_INTER, L_BITS_GU, L_BITS_D, L_GROUP, L_SCALE_TYPE,
  L_GATE_W, L_GATE_S, L_GATE_B, L_UP_W, L_UP_S, L_UP_B, L_DOWN_W, L_DOWN_S, L_DOWN_B,
  L_INT8_ACTS, L_ACTIVATION, L_ALPHA, L_LIMIT, L_BIAS_TYPE, L_GATE_BIAS, L_UP_BIAS, L_DOWN_BIAS,
  L_RECORD_BYTES, LAYOUT_LEN
};

inline float float_bits(int64_t v) {
  const uint32_t u = uint32_t(v);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

constexpr int ROW_BLOCK = 8;  // output rows per task
// tokens (or pairs) whose inputs a task's rows read while they stay in the L2 cache (16 of 2,048
// inputs: 128 KiB)
constexpr int64_t TOKEN_BLOCK = 16;

struct Layout {
  int64_t hidden = 0, inter = 0, bits_gu = 0, bits_d = 0, group = 0, scale_type = 0;
  int64_t gate_w = 0, gate_s = 0, gate_b = 0, up_w = 0, up_s = 0, up_b = 0, down_w = 0, down_s = 0, down_b = 0;
  int64_t int8_acts = 0;  // 1: the int8 rows (int8_rows.h) where compiled in, else the float ones
  int64_t activation = ACT_SILU;
  float alpha = 0.f, limit = 0.f;
  int64_t bias_type = NO_BIAS, gate_bias = 0, up_bias = 0, down_bias = 0;
  int64_t record_bytes = 0;

  static Layout of(const int64_t* v) {
    Layout l;
    l.hidden = v[L_HIDDEN]; l.inter = v[L_INTER]; l.bits_gu = v[L_BITS_GU]; l.bits_d = v[L_BITS_D];
    l.group = v[L_GROUP]; l.scale_type = v[L_SCALE_TYPE];
    l.gate_w = v[L_GATE_W]; l.gate_s = v[L_GATE_S]; l.gate_b = v[L_GATE_B];
    l.up_w = v[L_UP_W]; l.up_s = v[L_UP_S]; l.up_b = v[L_UP_B];
    l.down_w = v[L_DOWN_W]; l.down_s = v[L_DOWN_S]; l.down_b = v[L_DOWN_B];
    l.int8_acts = v[L_INT8_ACTS];
    l.activation = v[L_ACTIVATION];
    l.alpha = float_bits(v[L_ALPHA]);
    l.limit = float_bits(v[L_LIMIT]);
    l.bias_type = v[L_BIAS_TYPE];
    l.gate_bias = v[L_GATE_BIAS]; l.up_bias = v[L_UP_BIAS]; l.down_bias = v[L_DOWN_BIAS];
    l.record_bytes = v[L_RECORD_BYTES];
    return l;
  }

  // Empty where the layout is one these kernels compute, else why not.
  std::string refusal() const {
    if (hidden <= 0 || inter <= 0) return "no layout for this layer";
    if ((bits_gu != 4 && bits_gu != 8) || (bits_d != 4 && bits_d != 8)) return "codes of other than 4 or 8 bits";
    if (group != 32 && group != 64 && group != 128 && group != 256) return "a group size other than 32, 64, 128 or 256";
    if (hidden % group || inter % group) return "hidden or intermediate size not a multiple of the group size";
    if (scale_type < SCALE_BF16 || scale_type > SCALE_E8M0) return "scales of an unknown dtype";
    if (scale_type == SCALE_E8M0 && (bits_gu != 4 || bits_d != 4 || group != MX_GROUP))
      return "MXFP4 codes other than 4 bits in groups of 32";
    if (activation != ACT_SILU && activation != ACT_CLAMPED_SWIGLU) return "an unknown activation";
    if (bias_type < NO_BIAS || bias_type > SCALE_F32) return "added biases of an unknown dtype";
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

// A scale's bytes per group.
constexpr int64_t scale_bytes(int64_t type) { return type == SCALE_F32 ? 4 : type == SCALE_E8M0 ? 1 : 2; }

// Whether a group holds a bias beside its scale (w = scale * q + bias): all but MXFP4's.
constexpr bool group_biases(int64_t type) { return type != SCALE_E8M0; }

// The 16 values of an e2m1 code (sign, two exponent bits, one mantissa bit: moestream.quant.mxfp4.E2M1).
alignas(64) constexpr float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                        -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// A 4-bit code's value: the code itself (affine records) or its e2m1 value (MXFP4).
template <int64_t type>
inline float code_value(unsigned q) {
  if constexpr (type == SCALE_E8M0) return E2M1[q];
  return float(q);
}

template <int64_t type>
inline float scale_at(const uint8_t* p, int64_t i) {
  if constexpr (type == SCALE_E8M0) {  // 2^(e - 127) from the bits, as mxfp4.scale_values: e = 0 the subnormal 2^-127
    const uint32_t e = p[i], u = e ? e << 23 : 0x00400000u;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
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
// a nibble's value as a float by a permute of a table of 16 (it reads each lane's low 4 bits): no
// mask, no conversion; 0..15, the same floats as converting the masked nibble, or MXFP4's e2m1 values
template <int64_t ST>
inline Vec nibble_values() {
  if constexpr (ST == SCALE_E8M0) return _mm512_load_ps(E2M1);
  return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
}
template <int64_t ST>
inline Vec low_nibbles(__m512i b) { return _mm512_permutexvar_ps(b, nibble_values<ST>()); }
template <int64_t ST>
inline Vec high_nibbles(__m512i b) { return _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), nibble_values<ST>()); }
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
// e2m1 values of each lane's low 4 bits: the magnitude by a permute of 8 (it reads the low 3 bits), the sign from bit 3
inline Vec e2m1_values(__m256i b) {
  const Vec magnitude = _mm256_permutevar8x32_ps(_mm256_load_ps(E2M1), b);
  return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(8)), 28)));
}
template <int64_t ST>
inline Vec low_nibbles(__m256i b) {
  if constexpr (ST == SCALE_E8M0) return e2m1_values(b);
  return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
}
template <int64_t ST>
inline Vec high_nibbles(__m256i b) {
  if constexpr (ST == SCALE_E8M0) return e2m1_values(_mm256_srli_epi32(b, 4));
  return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
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

// The products of R rows (1 or 2) with the inputs of N tokens: out[r][t * stride] = sum_k w_r[k] x_t[k],
// each run of code bytes turned into floats once for all N tokens, each token's input vector read
// once for all R rows. Rows of 4-bit codes (K/2 bytes: x as `prepare` left it, even inputs then odd
// ones) or 8-bit (K bytes), G inputs per group, scales of type ST; the biases times the group sums
// added apart. Every (row, token) product takes the same operations in the same order whatever R and
// N are, so its bits never depend on the rows or tokens computed with it.
template <int BITS, int G, int64_t ST, int R, int N>
void block(const uint8_t* const* w, const uint8_t* const* s, const uint8_t* const* b, const Input* const* in,
           int64_t K, float* const* out, int64_t stride) {
  constexpr int B = G * BITS / 8;  // code bytes per group
  const int64_t groups = K / G, odd = BITS == 4 ? K / 2 : 0;
  const float* x[N];
  const float* sums[N];
  for (int t = 0; t < N; ++t) x[t] = in[t]->v.data(), sums[t] = in[t]->sums.data();
  float bias_part[R][N];
#ifdef NATIVE_VECTORS
  static_assert(B % W == 0 && G % W == 0, "a group is whole vectors of bytes");
  constexpr int STEP = W;  // code bytes per step (4-bit: 2W inputs, 8-bit: W)
  Vec acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < N; ++t) acc[r][t] = vzero(), bias_part[r][t] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    if (PREFETCH_AHEAD) {  // one prefetch per 64-byte line the group starts
      for (int r = 0; r < R; ++r)
        for (int64_t k = (64 - (g * B) % 64) % 64; k < B; k += 64) prefetch_codes(w[r] + g * B + k + PREFETCH_AHEAD);
    }
    Vec d[R][N];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < N; ++t) d[r][t] = vzero();
#pragma GCC unroll 8
    for (int j = 0; j < B; j += STEP) {
      Vec lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        const auto c = widen(w[r] + g * B + j);
        if constexpr (BITS == 4) {
          lo[r] = low_nibbles<ST>(c);
          hi[r] = high_nibbles<ST>(c);
        } else {
          lo[r] = bytes(c);
        }
      }
      for (int t = 0; t < N; ++t) {
        const int64_t at = g * (BITS == 4 ? B : G) + j;
        const Vec e = vload(x[t] + at);
        for (int r = 0; r < R; ++r) d[r][t] = vfma(lo[r], e, d[r][t]);
        if constexpr (BITS == 4) {
          const Vec o = vload(x[t] + odd + at);
          for (int r = 0; r < R; ++r) d[r][t] = vfma(hi[r], o, d[r][t]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const Vec scale = vset(scale_at<ST>(s[r], g));
      for (int t = 0; t < N; ++t) acc[r][t] = vfma(scale, d[r][t], acc[r][t]);
      if constexpr (group_biases(ST)) {
        const float bias = scale_at<ST>(b[r], g);
        for (int t = 0; t < N; ++t) bias_part[r][t] = std::fma(bias, sums[t][g], bias_part[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < N; ++t) out[r][t * stride] = vsum(acc[r][t]) + bias_part[r][t];
#else
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < N; ++t) {  // one (row, token) at a time: the loop's vectorization is its own
      float acc = 0.f, bp = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* c = w[r] + g * B;
        float dsum = 0.f;
        if constexpr (BITS == 4) {
          const float* e = x[t] + g * B;
          const float* o = x[t] + odd + g * B;
          for (int j = 0; j < B; ++j)
            dsum = std::fma(code_value<ST>(c[j] & 15), e[j], std::fma(code_value<ST>(c[j] >> 4), o[j], 0.f) + dsum);
        } else {
          const float* e = x[t] + g * G;
          for (int j = 0; j < G; ++j) dsum = std::fma(float(c[j]), e[j], dsum);
        }
        acc = std::fma(scale_at<ST>(s[r], g), dsum, acc);
        if constexpr (group_biases(ST)) bp = std::fma(scale_at<ST>(b[r], g), sums[t][g], bp);
      }
      out[r][t * stride] = acc + bp;
    }
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

using BlockFn = void (*)(const uint8_t* const*, const uint8_t* const*, const uint8_t* const*, const Input* const*,
                         int64_t, float* const*, int64_t);
constexpr int TOKEN_TILE = 4;  // tokens of one block call (with 2 rows: 16 accumulators in registers)

#ifdef NATIVE_INT8_ROWS
// The int8 rows (one row and token at a time) behind the blocks' interface.
template <int BITS, int G, int64_t ST, int R, int N>
void block_int8(const uint8_t* const* w, const uint8_t* const* s, const uint8_t* const* b, const Input* const* in,
                int64_t K, float* const* out, int64_t stride) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < N; ++t) out[r][t * stride] = row_int8<BITS, G, ST>(w[r], s[r], b[r], *in[t], K);
}
#endif

// The block calls of one kind of row: [rows - 1][a token tile (1) or one token (0)].
struct Blocks {
  BlockFn fn[2][2];

  // out[r][t * stride] for r < rows (1 or 2) and t < n: tiles of TOKEN_TILE tokens, then one at a time.
  void run(int rows, const uint8_t* const* w, const uint8_t* const* s, const uint8_t* const* b, const Input* const* in,
           int64_t n, int64_t K, float* const* out, int64_t stride) const {
    float* at[2];
    for (int64_t t = 0; t < n;) {
      const bool tile = n - t >= TOKEN_TILE;
      for (int r = 0; r < rows; ++r) at[r] = out[r] + t * stride;
      fn[rows - 1][tile](w, s, b, in + t, K, at, stride);
      t += tile ? TOKEN_TILE : 1;
    }
  }
};

template <int BITS, int G, int64_t ST>
Blocks blocks_of([[maybe_unused]] bool int8) {
#ifdef NATIVE_INT8_ROWS
  if (int8) return Blocks{{{block_int8<BITS, G, ST, 1, 1>, block_int8<BITS, G, ST, 1, TOKEN_TILE>},
                           {block_int8<BITS, G, ST, 2, 1>, block_int8<BITS, G, ST, 2, TOKEN_TILE>}}};
#endif
  return Blocks{{{block<BITS, G, ST, 1, 1>, block<BITS, G, ST, 1, TOKEN_TILE>},
                 {block<BITS, G, ST, 2, 1>, block<BITS, G, ST, 2, TOKEN_TILE>}}};
}

template <int BITS, int64_t ST>
Blocks blocks_of(int64_t group, bool int8) {
  switch (group) {
    case 32: return blocks_of<BITS, 32, ST>(int8);
    case 64: return blocks_of<BITS, 64, ST>(int8);
    case 128: return blocks_of<BITS, 128, ST>(int8);
    default: return blocks_of<BITS, 256, ST>(int8);
  }
}

template <int64_t ST>
Blocks blocks_of(int64_t bits, int64_t group, bool int8) {
  return bits == 4 ? blocks_of<4, ST>(group, int8) : blocks_of<8, ST>(group, int8);
}

// The blocks for codes of `bits`, `group` inputs per scale, scales of `stype` (checked by
// Layout::refusal), on int8 activations with `int8` (where compiled in: see int8_activations).
Blocks blocks(int64_t bits, int64_t group, int64_t stype, bool int8) {
  if (stype == SCALE_E8M0) return blocks_of<4, MX_GROUP, SCALE_E8M0>(int8);
  if (stype == SCALE_BF16) return blocks_of<SCALE_BF16>(bits, group, int8);
  if (stype == SCALE_F16) return blocks_of<SCALE_F16>(bits, group, int8);
  return blocks_of<SCALE_F32>(bits, group, int8);
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

// Element i of a bias vector of type `type` (a ScaleType).
inline float bias_at(int64_t type, const uint8_t* p, int64_t i) {
  if (type == SCALE_BF16) return scale_at<SCALE_BF16>(p, i);
  if (type == SCALE_F16) return scale_at<SCALE_F16>(p, i);
  return scale_at<SCALE_F32>(p, i);
}

// One pair's h entry from its gate and up products (the records' added biases not yet in them):
// the torch reference's operations in its order (moestream.layers.clamped_swiglu, mlp.swiglu).
inline float gated(const Layout& L, float g, float u, const uint8_t* record, int64_t n) {
  if (L.bias_type != NO_BIAS) {
    g += bias_at(L.bias_type, record + L.gate_bias, n);
    u += bias_at(L.bias_type, record + L.up_bias, n);
  }
  if (L.activation == ACT_SILU) return silu(g) * u;
  g = std::min(g, L.limit);
  u = std::clamp(u, -L.limit, L.limit);
  return (u + 1.f) * (g * (1.f / (1.f + std::exp(-(g * L.alpha)))));
}

// A down row's product n plus the record's added bias, where it has them.
inline float down_out(const Layout& L, float y, const uint8_t* record, int64_t n) {
  return L.bias_type == NO_BIAS ? y : y + bias_at(L.bias_type, record + L.down_bias, n);
}

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
  // each expert's pairs, in order, and the inputs their gate/up and down rows read
  std::vector<std::vector<int>> of_expert(n_experts);
  for (int64_t p = 0; p < P; ++p) of_expert[pairs[p].expert].push_back(int(p));
  std::vector<std::vector<const Input*>> x_of(n_experts), h_of(n_experts);
  for (int64_t e = 0; e < n_experts; ++e)
    for (int p : of_expert[e]) x_of[e].push_back(&sc.x_in[pairs[p].token]), h_of[e].push_back(&sc.h_in[p]);
  const Blocks gu_rows = blocks(L.bits_gu, L.group, L.scale_type, int8), d_rows = blocks(L.bits_d, L.group, L.scale_type, int8);
  const int64_t gu_blocks = (I + ROW_BLOCK - 1) / ROW_BLOCK, d_blocks = (H + ROW_BLOCK - 1) / ROW_BLOCK;
  std::vector<Matrix> gate(n_experts), up(n_experts), down(n_experts);
  for (int64_t e = 0; e < n_experts; ++e) {
    gate[e] = matrix(records[e], L.gate_w, L.gate_s, L.gate_b, H, L.bits_gu, L.group);
    up[e] = matrix(records[e], L.up_w, L.up_s, L.up_b, H, L.bits_gu, L.group);
    down[e] = matrix(records[e], L.down_w, L.down_s, L.down_b, I, L.bits_d, L.group);
  }
  const int64_t scale_item = scale_bytes(L.scale_type);
  Dealer gu_tasks, h_tasks, d_tasks;
  const int members = team.size();
  team.run([&](int, int) {
    // gate row n and up row n of an expert together, over its pairs TOKEN_BLOCK at a time
    gu_tasks.deal(n_experts * gu_blocks, Dealer::chunk_for(n_experts * gu_blocks, members), [&](int64_t task) {
      const int64_t e = task / gu_blocks, n0 = (task % gu_blocks) * ROW_BLOCK, n1 = std::min(I, n0 + ROW_BLOCK);
      const Matrix& g = gate[e];
      const Matrix& u = up[e];
      const std::vector<int>& ps = of_expert[e];
      float hg[TOKEN_BLOCK], hu[TOKEN_BLOCK];
      float* const out[2] = {hg, hu};
      for (int64_t c = 0; c < int64_t(ps.size()); c += TOKEN_BLOCK) {
        const int64_t m = std::min<int64_t>(TOKEN_BLOCK, int64_t(ps.size()) - c);
        for (int64_t n = n0; n < n1; ++n) {
          const int64_t sc_at = n * g.row_groups * scale_item;
          const uint8_t* w[2] = {g.w + n * g.row_bytes, u.w + n * u.row_bytes};
          const uint8_t* s[2] = {g.s + sc_at, u.s + sc_at};
          const uint8_t* b[2] = {g.b + sc_at, u.b + sc_at};
          gu_rows.run(2, w, s, b, x_of[e].data() + c, m, H, out, 1);
          for (int64_t i = 0; i < m; ++i) sc.h[ps[c + i] * I + n] = gated(L, hg[i], hu[i], records[e], n);
        }
      }
    });
    team.barrier();
    h_tasks.deal(P, 1, [&](int64_t p) { prepare(sc.h.data() + p * I, I, L.group, L.bits_d, int8, sc.h_in[p]); });
    team.barrier();
    // down rows two at a time, over the expert's pairs TOKEN_BLOCK at a time
    d_tasks.deal(n_experts * d_blocks, Dealer::chunk_for(n_experts * d_blocks, members), [&](int64_t task) {
      const int64_t e = task / d_blocks, n0 = (task % d_blocks) * ROW_BLOCK, n1 = std::min(H, n0 + ROW_BLOCK);
      const Matrix& d = down[e];
      const std::vector<int>& ps = of_expert[e];
      float r0[TOKEN_BLOCK], r1[TOKEN_BLOCK];
      float* const out[2] = {r0, r1};
      for (int64_t c = 0; c < int64_t(ps.size()); c += TOKEN_BLOCK) {
        const int64_t m = std::min<int64_t>(TOKEN_BLOCK, int64_t(ps.size()) - c);
        for (int64_t n = n0; n < n1; n += 2) {
          const int rows = int(std::min<int64_t>(2, n1 - n));
          const uint8_t *w[2], *s[2], *b[2];
          for (int r = 0; r < rows; ++r) {
            w[r] = d.w + (n + r) * d.row_bytes;
            s[r] = d.s + (n + r) * d.row_groups * scale_item;
            b[r] = d.b + (n + r) * d.row_groups * scale_item;
          }
          d_rows.run(rows, w, s, b, h_of[e].data() + c, m, I, out, 1);
          for (int r = 0; r < rows; ++r)
            for (int64_t i = 0; i < m; ++i)
              pairs[ps[c + i]].out[n + r] = pairs[ps[c + i]].weight * down_out(L, out[r][i], records[e], n + r);
        }
      }
    });
  });
}

}  // namespace moestream_native
