"""mlx-community checkpoints: their quantization config, read so they import without re-quantizing.

config.json says `"quantization": {"group_size": 64, "bits": 4, "<module path>": {...} | false}`
(newer files repeat it as `quantization_config`): a default, per-module overrides, and `false` for
a module left in float. A module is quantized exactly when its `.scales` tensor exists; its bits
and group size come from the override or the default, checked against the tensor shapes."""
from __future__ import annotations

from dataclasses import dataclass, field

from moestream.errors import UnsupportedModelError
from moestream.quant.affine import SUPPORTED_BITS, QuantSpec

SCALAR_KEYS = {"bits", "group_size", "mode", "quant_method"}


@dataclass(frozen=True)
class MlxQuantization:
    bits: int
    group_size: int
    overrides: dict[str, dict | bool] = field(default_factory=dict)

    @staticmethod
    def from_config(config: dict) -> "MlxQuantization | None":
        """The checkpoint's MLX quantization, None for a float checkpoint; other schemes are refused."""
        for key in ("quantization", "quantization_config"):
            q = config.get(key)
            if q is None:
                continue
            if not isinstance(q, dict):
                raise UnsupportedModelError(f"config.json: {key} is not an object")
            method = q.get("quant_method")
            if method in ("gptq", "awq"):
                return None  # read by convert's GPTQ/AWQ source, not as MLX
            if method is not None and method != "mlx":
                raise UnsupportedModelError(f"config.json: {key}.quant_method {method!r} is not supported (moestream "
                                            "reads float checkpoints, MLX affine, GPTQ and AWQ ones)")
            if q.get("mode", "affine") != "affine":
                raise UnsupportedModelError(f"config.json: {key}.mode {q['mode']!r} is not supported (only MLX affine)")
            if not isinstance(q.get("bits"), int) or not isinstance(q.get("group_size"), int):
                raise UnsupportedModelError(f"config.json: {key} lacks integer bits and group_size")
            overrides = {k: v for k, v in q.items() if k not in SCALAR_KEYS and (isinstance(v, dict) or v is False)}
            return MlxQuantization(q["bits"], q["group_size"], overrides)
        return None

    def spec_for(self, module: str) -> QuantSpec:
        """What config.json says for `module` (a path without `.weight`): float or (bits, group size)."""
        override = self.overrides.get(module)
        if override is False:
            return QuantSpec()
        if isinstance(override, dict):
            return QuantSpec(override.get("bits", self.bits), override.get("group_size", self.group_size))
        return QuantSpec(self.bits, self.group_size)


def mlx_input_size(name: str, weight_shape: tuple[int, ...], scales_shape: tuple[int, ...], spec: QuantSpec) -> int:
    """The unpacked input size of an MLX-quantized [..., O, W] weight, after checking its scales agree."""
    if spec.bits not in SUPPORTED_BITS:
        raise UnsupportedModelError(f"{name}: {spec.bits}-bit MLX quantization is not supported "
                                    f"(supported: {', '.join(map(str, SUPPORTED_BITS))})")
    in_features = weight_shape[-1] * 32 // spec.bits
    if weight_shape[:-1] != scales_shape[:-1] or scales_shape[-1] * spec.group_size != in_features:
        raise UnsupportedModelError(
            f"{name}: packed shape {list(weight_shape)} at {spec.bits} bits holds {in_features} inputs, but its scales "
            f"{list(scales_shape)} at group size {spec.group_size} cover {scales_shape[-1] * spec.group_size} "
            "(quantization in config.json disagrees with the tensors)")
    return in_features
