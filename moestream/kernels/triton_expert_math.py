"""Shared pieces of the Triton expert kernels (moestream.kernels.triton_moe's gemv kernels and
moestream.kernels.triton_grouped's grouped ones): codes to floats, MXFP4's e2m1 values and E8M0
scales, the gated activations, and the projections' added biases."""
import triton
import triton.language as tl


@triton.jit
def _code_f32(words, j: tl.constexpr, BITS: tl.constexpr):
    """Code j of each uint32 word as the float 1 + q / 2^BITS: the code moved to the top of the
    mantissa under the exponent of 1.0. One shift and one and-or, no int->float conversion."""
    POS: tl.constexpr = j * BITS
    TOP: tl.constexpr = 23 - BITS
    if POS > TOP:
        v = words >> (POS - TOP)
    else:
        v = words << (TOP - POS)
    return ((v & (((1 << BITS) - 1) << TOP)) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_f32(c):
    """e2m1 codes (uint32, 0..15: sign bit 3, exponent bits 2..1, mantissa bit 0) -> their float32
    values, from the bits. Exponent e > 0 is (1 + m/2) * 2^(e - 1): the three magnitude bits moved
    under float32's exponent field, plus 126 there; e = 0 is m * 0.5. No subnormal is formed, so a
    flush to zero cannot change a value; code 8 is -0.0 as in the reference."""
    mag = c & 7
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), (c & 1) * 0x3F000000)
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_f32(s):
    """E8M0 scale bytes -> 2^(s - 127) in float32, exactly (s = 0: the subnormal 2^-127, as the reference)."""
    s = s.to(tl.uint32)
    return tl.where(s > 0, s << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def _gate_act(gate, alpha, limit, ACT: tl.constexpr):
    """The gate's factor of act(gate, up) in float32 (see the module doc); silu's is the expression
    the kernels always had, in the same place, so SwiGLU compiles to the code it always did."""
    if ACT == "gelu_tanh":
        # 0.5 * (1 + tanh(z)) = sigmoid(2z), z = sqrt(2/pi) * (g + 0.044715 g^3)
        z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
        a = gate / (1.0 + tl.exp(-z))
    elif ACT == "clamped_swiglu":
        g = tl.minimum(gate, limit)
        a = g * tl.sigmoid(g * alpha)
    else:
        a = gate / (1.0 + tl.exp(-gate))
    return a


@triton.jit
def _up_act(up, limit, ACT: tl.constexpr):
    """The up projection's factor of act(gate, up): clamped_swiglu's clamp(up, -limit, limit) + 1."""
    if ACT == "clamped_swiglu":
        up = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
    return up


@triton.jit
def _bias_f32(bias_ptr, cols, mask, DTYPE: tl.constexpr):
    """An added bias vector's entries `cols`, rounded to DTYPE (x's, as the reference rounds it) and widened."""
    return tl.load(bias_ptr + cols, mask=mask, other=0.0).to(DTYPE).to(tl.float32)


# The gemv kernels read their input vector in "split" order: v_split[j, m] = v[m * CPW + j], CPW
# codes per word. Then the inputs that meet code j of words m..m+3 are contiguous (one vector load)
# and every tensor in the loop has the layout of the word tile: no shuffles, no layout changes.
# Per group, with f = 1 + q/2^b:  sum (q*s + b) x = (2^b s) sum f x + (b - 2^b s) sum x.
# MXFP4 (MX) groups are 32 inputs (4 words):  sum e2m1(q) 2^(s-127) x = 2^(s-127) sum e2m1(q) x.
