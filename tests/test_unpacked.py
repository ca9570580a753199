"""train_gpt.py and the stage files read without unpacking: one value per assignment where the values are
unrelated, and no function or call with more than 6 positional arguments to keep apart. Read from each file's syntax
tree; nothing runs."""
import ast

import pytest

from conftest import ROOT, STAGES

FILES = ["train_gpt.py", *STAGES]


@pytest.mark.parametrize("name", FILES)
def test_one_value_at_a_time(name):
    """No `a, b, c = x, y, z`: a tuple of three or more values written out and assigned at once packs unrelated
    values into one line (unpacking one value, as `B, T, C = x.shape` or `q, k, v = ...split(...)`, is fine)."""
    tree = ast.parse((ROOT / name).read_text())
    packed = [f"{name}:{node.lineno}: {ast.unparse(node)[:100]}" for node in ast.walk(tree)
              if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) and len(node.value.elts) >= 3
              and any(isinstance(t, ast.Tuple) for t in node.targets)]
    assert not packed, "tuple assignments of unrelated values; write one per line:\n" + "\n".join(packed)


@pytest.mark.parametrize("name", FILES)
def test_at_most_6_positional_arguments(name):
    """A function of more than 6 positional parameters makes its callers line up arguments by position; so does a
    call that passes more than 6 (a C++ binding's, say, whose parameters have no names unless it gives them)."""
    tree = ast.parse((ROOT / name).read_text())
    wide = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            names = names[1:] if names[:1] in (["self"], ["cls"]) else names
            if len(names) > 6:
                wide.append(f"{name}:{node.lineno}: {node.name}({', '.join(names)})")
        if isinstance(node, ast.Call) and len(node.args) > 6:
            wide.append(f"{name}:{node.lineno}: {ast.unparse(node.func)}(...) with {len(node.args)} positional arguments")
    assert not wide, "more than 6 positional arguments:\n" + "\n".join(wide)
