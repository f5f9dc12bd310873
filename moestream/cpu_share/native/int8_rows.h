// The row products of expert_kernels.h with int8 activations (AVX-512 VNNI), included by it beside
// its float rows: the codes stay bytes and one vpdpbusd multiplies 64 of them (u8) by 64 quantized
// inputs (s8) and adds them in fours into 16 int32 lanes, where the float rows widen every code to
// a float and spend an FMA on it.
//
// A token's input (or a pair's h) is quantized once per 32 inputs (ACT_GROUP, within one weight
// group): qx = round(x * 127 / max|x|), xs = max|x| / 127, so per 32 inputs sum_k q_k x_k ~
// xs * sum_k q_k qx_k with the inner sum exact in int32. A lane's four codes lie in one such group
// (16 or 32 code bytes), so each vector's lanes are scaled by their group's scale_g * xs_j (a
// permute of 16 groups' products, formed once per 16) into a float32 accumulator; the biases' part
// is bias_g times the sum of the group's quantized inputs. The rounding costs about 1% of the
// output's norm (tests/unit/test_native_int8.py bounds it).
//
// MXFP4 records (SCALE_E8M0) take these rows as affine groups of 32: a code's 2 * e2m1 value is an
// integer in -12..12, so a lookup (vpshufb) turns each nibble into u = 2 * e2m1 + 12 in 0..24 (unsigned,
// as vpdpbusd multiplies) and w = e2m1 * 2^(e - 127) = s * u - 12 * s with s = 2^(e - 128): exact, as
// every s from 2^-128 (e = 0, a subnormal) to 2^126 (e = 254) is a float32. The bias part is -12 times
// s times the group's sum: the bits of -12 s times the sum (s * sum is exact), but -12 s overflows
// from e = 253 and -12 * sum where the inputs near 2^124 (as they may where e = 0).
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NATIVE_INT8_ROWS 1
#endif

namespace moestream_native {

#ifdef NATIVE_INT8_ROWS
constexpr bool INT8_ROWS = true;
#else
constexpr bool INT8_ROWS = false;
#endif

constexpr int64_t Q_PAD = 64;      // the quantized inputs' tail: a row's last, partial vector reads up to a vector past K
constexpr int64_t ACT_GROUP = 32;  // inputs per activation scale, whatever the weights' group (G is a multiple)

// x [K] as the int8 rows read it: in.q the codes' partners (4-bit: the even inputs, then the odd
// ones, K/2 each; 8-bit: as they are), in.qscale the xs of each ACT_GROUP inputs, in.sums each
// weight group's sum of the quantized inputs (sum of xs * qx): the biases then meet the same x as
// the scales, so the error is w's product with the rounding, not (scale * q)'s, whose codes are all
// positive (2-4x less error than the float sums on the unit tests' records). Scales per 32 inputs
// rather than per G: half the error at G = 128 or 256, and an outlier spoils only its 32.
void prepare_int8(const float* x, int64_t K, int64_t group, int64_t bits, Input& in) {
  const int64_t half = K / 2;
  in.q.assign(K + Q_PAD, 0);
  in.qscale.resize(K / ACT_GROUP);
  in.sums.assign(K / group, 0.f);
  for (int64_t j = 0; j < K / ACT_GROUP; ++j) {
    const float* xj = x + j * ACT_GROUP;
    float amax = 0.f;
    for (int64_t k = 0; k < ACT_GROUP; ++k) amax = std::max(amax, std::fabs(xj[k]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t qsum = 0;
    for (int64_t k = 0; k < ACT_GROUP; ++k) {
      const int64_t i = j * ACT_GROUP + k, at = bits == 4 ? (i & 1 ? half : 0) + i / 2 : i;
      const int8_t q = int8_t(std::nearbyint(std::min(127.f, std::max(-127.f, xj[k] * inv))));
      in.q[at] = q;
      qsum += q;
    }
    in.qscale[j] = amax / 127.f;
    in.sums[j * ACT_GROUP / group] += in.qscale[j] * float(qsum);
  }
}

#ifdef NATIVE_INT8_ROWS
constexpr float MX_OFFSET = 12.f;  // u = 2 * e2m1 + MX_OFFSET (see the top)

// 16 scales (or biases) of type ST as floats; those outside `m` are 0 (never read). E8M0: the affine
// scale s = 2^(e - 128), half of scale_at's 2^(e - 127) (built from the bits as it is: 255 gives inf).
template <int64_t ST>
inline __m512 load_scales(const uint8_t* p, __mmask16 m) {
  if constexpr (ST == SCALE_E8M0) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
    const __m512i bits = _mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                                               _mm512_set1_epi32(0x00400000));
    return _mm512_maskz_mul_ps(m, _mm512_castsi512_ps(bits), _mm512_set1_ps(0.5f));
  } else if constexpr (ST == SCALE_F32) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if constexpr (ST == SCALE_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}

// 64 nibbles (one a byte) as the unsigned codes vpdpbusd multiplies: as they are, or MXFP4's
// 2 * e2m1 + 12 looked up in a table of 16 (vpshufb reads each byte's low 4 bits).
template <int64_t ST>
inline __m512i unsigned_codes(__m512i nibbles) {
  if constexpr (ST == SCALE_E8M0)
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)),
                               nibbles);
  return nibbles;
}

// The int32 lanes of 64 code bytes times their inputs: 4-bit, the low nibbles with the even inputs
// at `a`, the high ones with the odd inputs at `b`; 8-bit, the bytes with the inputs at `a`.
template <int BITS, int64_t ST>
inline __m512i dot64(__m512i dot, __m512i c, const int8_t* a, const int8_t* b) {
  if constexpr (BITS == 4) {
    const __m512i nib = _mm512_set1_epi8(15);
    dot = _mm512_dpbusd_epi32(dot, unsigned_codes<ST>(_mm512_and_si512(c, nib)), _mm512_loadu_si512(a));
    return _mm512_dpbusd_epi32(dot, unsigned_codes<ST>(_mm512_and_si512(_mm512_srli_epi16(c, 4), nib)), _mm512_loadu_si512(b));
  } else {
    return _mm512_dpbusd_epi32(dot, c, _mm512_loadu_si512(a));
  }
}

// sum_k w[n, k] x[k] for one row of BITS-bit codes (K * BITS / 8 bytes), G inputs per group,
// scales of type ST; x as `prepare_int8` left it. Blocks of 16 activation groups: their 16 products
// scale_g * xs_j in one vector, each code vector's lanes scaled by a permute of it.
template <int BITS, int G, int64_t ST>
float row_int8(const uint8_t* __restrict codes, const uint8_t* __restrict scales, const uint8_t* __restrict biases,
               const Input& in, int64_t K) {
  constexpr int QB = ACT_GROUP * BITS / 8;  // code bytes per activation group: 16 or 32
  constexpr int QPV = 64 / QB;              // activation groups per vector (4 or 2), 16 / QPV lanes each
  constexpr int QPG = G / ACT_GROUP;        // activation groups per weight group
  constexpr int64_t item = scale_bytes(ST);
  const int64_t groups = K / G, qgroups = K / ACT_GROUP, row_bytes = K * BITS / 8;
  const int8_t* a = in.q.data();
  const int8_t* b = a + K / 2;
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i weight_group = _mm512_srli_epi32(iota, __builtin_ctz(QPG));  // of a block's activation group
  const __m512i step = _mm512_set1_epi32(QPV);
  __m512 bias_acc = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const __mmask16 m = __mmask16((1u << std::min<int64_t>(16, groups - g0)) - 1);
    const __m512 sums = _mm512_maskz_loadu_ps(m, in.sums.data() + g0);
    if constexpr (group_biases(ST)) {
      bias_acc = _mm512_fmadd_ps(load_scales<ST>(biases + g0 * item, m), sums, bias_acc);
    } else {  // MXFP4: the bias -12 s (see the top)
      bias_acc = _mm512_fmadd_ps(_mm512_mul_ps(load_scales<ST>(scales + g0 * item, m), sums), _mm512_set1_ps(-MX_OFFSET), bias_acc);
    }
  }
  // two accumulators, vectors taking turns: one would wait out each FMA's latency
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  constexpr int64_t ahead = PREFETCH_AHEAD;
  for (int64_t j0 = 0; j0 < qgroups; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, qgroups - j0);
    const __mmask16 m = __mmask16((1u << n) - 1), ms = __mmask16((1u << ((n + QPG - 1) / QPG)) - 1);
    const __m512 ws = load_scales<ST>(scales + j0 / QPG * item, ms);
    const __m512 comb = _mm512_mul_ps(_mm512_permutexvar_ps(weight_group, ws), _mm512_maskz_loadu_ps(m, in.qscale.data() + j0));
    __m512i lane_group = _mm512_srli_epi32(iota, __builtin_ctz(16 / QPV));  // lane l: activation group l / (16 / QPV)
    const int64_t end = std::min(row_bytes, (j0 + 16) * QB);
    int64_t at = j0 * QB;
    for (; at + 128 <= end; at += 128) {
      if (ahead) {
        prefetch_codes(codes + at + ahead);
        prefetch_codes(codes + at + 64 + ahead);
      }
      const __m512i d0 = dot64<BITS, ST>(_mm512_setzero_si512(), _mm512_loadu_si512(codes + at), a + at, b + at);
      const __m512i d1 = dot64<BITS, ST>(_mm512_setzero_si512(), _mm512_loadu_si512(codes + at + 64), a + at + 64, b + at + 64);
      acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(lane_group, comb), acc0);
      lane_group = _mm512_add_epi32(lane_group, step);
      acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(lane_group, comb), acc1);
      lane_group = _mm512_add_epi32(lane_group, step);
    }
    // a vector left, or part of one: the bytes past the row's end are zeros (MXFP4: u = 12), in lanes
    // of groups past the row's end, which comb scales by 0
    for (; at < end; at += 64) {
      const __mmask64 cm = end - at >= 64 ? ~__mmask64(0) : __mmask64((1ull << (end - at)) - 1);
      const __m512i d0 = dot64<BITS, ST>(_mm512_setzero_si512(), _mm512_maskz_loadu_epi8(cm, codes + at), a + at, b + at);
      acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(lane_group, comb), acc0);
      lane_group = _mm512_add_epi32(lane_group, step);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), bias_acc));
}
#endif

}  // namespace moestream_native
