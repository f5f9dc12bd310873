"""RoutedExperts is built with its backend and hooks and changes its own state: no module that holds
one assigns its attributes from outside (DESIGN.md, "Where experts are computed")."""
import ast
from pathlib import Path

import pytest
import torch

from moestream.layers.experts import RoutedExperts

ROOT = Path(__file__).resolve().parents[2] / "moestream"
HOLDERS = ("engine", "layers", "models", "experts", "cpu_share", "server", "bench")  # where a RoutedExperts lives


def own_attributes() -> set[str]:
    """The attributes RoutedExperts' methods assign on self."""
    tree = ast.parse((ROOT / "layers" / "experts.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "RoutedExperts")
    return {t.attr for t in assigned(cls) if isinstance(t.value, ast.Name) and t.value.id == "self"}


def assigned(tree: ast.AST):
    """Every attribute an assignment in `tree` writes."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute):
                        yield t


def test_no_module_sets_routed_experts_state_from_outside():
    attrs = own_attributes()
    assert {"tile_tokens", "last_real_row", "booked", "on_route"} <= attrs
    found = []
    for package in HOLDERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "layers" / "experts.py":
                continue
            for t in assigned(ast.parse(path.read_text())):
                if t.attr in attrs and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                    found.append(f"{path.relative_to(ROOT)}:{t.lineno} {ast.unparse(t)}")
    assert found == []


class _Provider:
    """The least a CPU RoutedExperts asks of its provider at construction."""

    def record_fields(self, layer):
        return {}

    def quant(self, layer):
        return {}


def test_a_padded_chunk_state_lasts_only_while_it_runs(monkeypatch):
    monkeypatch.setattr("moestream.layers.experts.native_layout", lambda fields, quant: None)
    experts = RoutedExperts(_Provider(), {0: 4}, device="cpu")
    last, booked = torch.tensor([2]), []
    with experts.padded(3, last, booked):
        assert experts.tile_tokens == 3 and experts.last_real_row is last and experts.booked is booked
    assert experts.tile_tokens is None and experts.last_real_row is None and experts.booked is None
    with pytest.raises(RuntimeError), experts.padded(3, last, booked):
        raise RuntimeError("a failed run")
    assert experts.tile_tokens is None and experts.booked is None
