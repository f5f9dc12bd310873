"""Resident matrices the CPU keeps in their packed 4/8-bit affine form (PackedMatrix): a product
reads the codes (an eighth of the float32 matrix's bytes at 4 bits), never a dequantized copy, through
the native products (moestream.cpu_share.kernels' `packed_linear`; float32 models, where the native
build is): on int8 activations (per 32 inputs, VNNI dot products) where the CPU has AVX-512 VNNI,
as the experts' rows, else float32 throughout.

A PackedMatrix is a torch.Tensor of the matrix's shape and dtype that holds no float data; the
layers multiply it as they multiply any weight, and torch hands every function that meets it to
`__torch_function__` here:
  - products (F.linear, and rows_linear's mm / bmm over `.t()` and `.expand`): computed
    from the codes, each code read once per tile of rows (a prefill chunk's product is a
    matrix-matrix one), each output on its own, so a row's bits never depend on the rows beside it;
  - concatenation and row slices (AttentionWeights.fuse_qkv, GeluMLP's stacked gate and up): packed again;
  - row gathers: an embedding's F.embedding dequantizes only those rows; the hot head's index_select
    keeps them packed (its products then the head's, bit for bit);
  - metadata (shape, dtype, ...) as it is; anything else on the dequantized matrix.
Products differ from the dequantized weight's times the inputs as they take them (int8-rounded where
the CPU has VNNI: moestream.kernels.reference.int8_rounded) only in float32 rounding
(tests/unit/test_packed_matrix.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from moestream.cpu_share import kernels as native
from moestream.quant.affine import QuantSpec, dequantize

SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_T = torch.Tensor
METADATA = {_T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.ndim.__get__, _T.is_cuda.__get__,
            _T.layout.__get__, _T.requires_grad.__get__, _T.dim, _T.size, _T.numel, _T.element_size, _T.__len__}


def packs(spec: QuantSpec, shape, scales_dtype: torch.dtype, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a matrix of this spec and [N, K] shape stays packed in a `dtype` model on `device`: on
    the CPU where the native products take it (and are built); elsewhere it is dequantized at load."""
    return (device.type == "cpu" and dtype == torch.float32 and len(shape) == 2 and spec.quantized
            and spec.mode == "affine" and spec.bits in (4, 8) and spec.group_size in native.GROUPS
            and shape[1] % spec.group_size == 0 and scales_dtype in SCALE_DTYPES and native.load() is not None)


class PackedMatrix(torch.Tensor):
    codes: torch.Tensor  # int32 [N, K * bits / 32]
    scales: torch.Tensor  # [N, K / group]
    biases: torch.Tensor
    bits: int
    group: int
    view_ops: tuple  # ("t",) then ("expand", sizes): rows_linear's views of the matrix, replayed on dequantizing

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int,
                dtype: torch.dtype = torch.float32, view_ops: tuple = ()):
        N, K = codes.shape[0], codes.shape[1] * 32 // bits
        shape = (N, K)
        for op in view_ops:
            shape = shape[::-1] if op[0] == "t" else tuple(op[1])
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device)
        t.codes, t.scales, t.biases, t.bits, t.group, t.view_ops = codes, scales, biases, bits, group, view_ops
        return t

    def __repr__(self) -> str:
        return f"PackedMatrix({list(self.codes.shape[:1])} x {self.codes.shape[1] * 32 // self.bits}, {self.bits}-bit)"

    def _like(self, codes, scales, biases, view_ops=()) -> "PackedMatrix":
        return PackedMatrix(codes, scales, biases, self.bits, self.group, self.dtype, view_ops)

    def dequantized(self) -> torch.Tensor:
        w = dequantize(self.codes, self.scales, self.biases, self.bits, self.group, self.dtype)
        for op in self.view_ops:
            w = w.t() if op[0] == "t" else w.expand(*op[1])
        return w

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, K] @ the matrix's transpose -> [n, N] in x's dtype."""
        out = torch.empty((x.shape[0], self.codes.shape[0]), dtype=torch.float32)
        native.load().packed_linear(self.codes, self.scales, self.biases, self.bits, self.group,
                                    x.to(torch.float32).contiguous(), out, torch.get_num_threads(),
                                    native.activations() == "int8")
        return out.to(x.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        handled = _handle(func, args, kwargs)
        if handled is not NotImplemented:
            return handled
        return func(*_dequantized(args), **_dequantized(kwargs))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # what reaches ATen all the same
        return func(*_dequantized(args), **_dequantized(kwargs or {}))


def _dequantized(tree):
    return tree_map(lambda a: a.dequantized() if isinstance(a, PackedMatrix) else a, tree)


def _plain_embedding(kwargs) -> bool:
    """F.embedding's keywords (it passes them all to __torch_function__) at their defaults: a plain gather."""
    return not any(kwargs.get(k) for k in ("padding_idx", "max_norm", "scale_grad_by_freq", "sparse")) and \
        kwargs.get("norm_type", 2.0) == 2.0


def _handle(func, args, kwargs):
    """The functions computed on the packed form (NotImplemented: dequantize and call func)."""
    if func is F.linear:
        x, w, bias = (list(args) + [kwargs.get("bias")])[:3]
        if isinstance(w, PackedMatrix) and not w.view_ops and not isinstance(x, PackedMatrix):
            y = w.rows(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
            return y if bias is None else y + bias
    elif func is _T.t and not args[0].view_ops:
        return args[0]._like(args[0].codes, args[0].scales, args[0].biases, (("t",),))
    elif func is _T.expand and args[0].view_ops == (("t",),):
        sizes = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else tuple(args[1:])
        return args[0]._like(args[0].codes, args[0].scales, args[0].biases, (("t",), ("expand", sizes)))
    elif func in (torch.mm, torch.bmm) and isinstance(args[1], PackedMatrix) and args[1].view_ops[:1] == (("t",),):
        x, out = args[0], kwargs.get("out")
        if isinstance(x, PackedMatrix) or (func is torch.bmm and x.shape[1] != 1):
            return NotImplemented
        y = args[1].rows(x.reshape(x.shape[0], -1)).view(*x.shape[:-1], -1)
        return y if out is None else out.copy_(y.view(out.shape))
    elif func is torch.cat:
        parts, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if dim == 0 and all(isinstance(p, PackedMatrix) and not p.view_ops for p in parts) and \
                len({(p.bits, p.group, p.scales.dtype, p.dtype) for p in parts}) == 1:
            return parts[0]._like(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "biases")))
    elif func is F.embedding and isinstance(args[1], PackedMatrix) and not args[1].view_ops and \
            not isinstance(args[0], PackedMatrix) and len(args) == 2 and _plain_embedding(kwargs):  # its rows
        ids, m = args[0].reshape(-1), args[1]
        rows = dequantize(m.codes[ids], m.scales[ids], m.biases[ids], m.bits, m.group, m.dtype)
        return rows.view(*args[0].shape, rows.shape[-1])
    elif func in (_T.index_select, torch.index_select) and not args[0].view_ops and \
            kwargs.get("dim", args[1] if len(args) > 1 else None) == 0:  # hot_head's rows: packed, the head's products
        m, index = args[0], kwargs.get("index", args[2] if len(args) > 2 else None)
        return m._like(m.codes[index], m.scales[index], m.biases[index])
    elif func is _T.contiguous and not args[0].view_ops:
        return args[0]
    elif func is _T.__getitem__ and not args[0].view_ops:
        key = args[1][0] if isinstance(args[1], tuple) and len(args[1]) == 1 else args[1]
        if isinstance(key, slice) and key.step in (None, 1):
            m = args[0]
            return m._like(m.codes[key], m.scales[key], m.biases[key])
    return NotImplemented


def packed_matrix(codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, spec: QuantSpec,
                  dtype: torch.dtype = torch.float32) -> PackedMatrix:
    return PackedMatrix(codes.view(torch.int32).contiguous(), scales.contiguous(), biases.contiguous(), spec.bits,
                        spec.group_size, dtype)
