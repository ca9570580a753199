"""train_gpt.py reads without unpacking: one value per assignment where the values are unrelated, and no call with
more than 6 positional parameters to keep apart. Read from the file's syntax tree; nothing runs."""
import ast

from conftest import ROOT


def test_train_gpt_assigns_one_value_at_a_time():
    """No `a, b, c = x, y, z`: a tuple of three or more values written out and assigned at once packs unrelated
    values into one line (unpacking one value, as `B, T, C = x.shape` or `q, k, v = ...split(...)`, is fine)."""
    tree = ast.parse((ROOT / "train_gpt.py").read_text())
    packed = [f"train_gpt.py:{node.lineno}: {ast.unparse(node)[:100]}" for node in ast.walk(tree)
              if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) and len(node.value.elts) >= 3
              and any(isinstance(t, ast.Tuple) for t in node.targets)]
    assert not packed, "tuple assignments of unrelated values; write one per line:\n" + "\n".join(packed)


def test_train_gpt_functions_take_at_most_6_positional_parameters():
    """A function of more than 6 positional parameters makes its callers line up arguments by position."""
    tree = ast.parse((ROOT / "train_gpt.py").read_text())
    wide = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            names = names[1:] if names[:1] in (["self"], ["cls"]) else names
            if len(names) > 6:
                wide.append(f"train_gpt.py:{node.lineno}: {node.name}({', '.join(names)})")
    assert not wide, "functions with more than 6 positional parameters:\n" + "\n".join(wide)
