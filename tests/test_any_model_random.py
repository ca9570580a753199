"""Small models generated from seeds (tests/random_models.py: module reuse and call order, nesting, output structures,
frozen units, tied weights, odd sizes, 1-element parameters, parameters that leave their unit), trained 3 steps by
every engine at N = 1, 2, 4 against a single-process torch.optim.AdamW with the project's recipe, in fp32: losses,
gradient norms and final weights within 1e-5 relative; and each engine refuses sparse gradients in one line. One
process group per (engine, N) trains every seed; a failing seed prints its model."""
import pytest

from conftest import ROOT, last_lines

SCRIPT = str(ROOT / "tests" / "random_models.py")
# between them: reuse, nesting, every output structure, frozen units, a tied weight, width 1; a unit that returns
# its bias (seeds 1, 3, 5), a unit's weight read by the root (1, 4), one tied to the root's linear (2, 3, 5)
SEEDS = "0-5,10,12"


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_random_models_match_torch_adamw(runner, stage_file, nproc):
    p = runner.spawn(SCRIPT, nproc, ["--stage", stage_file, "--seeds", SEEDS], timeout=600)
    assert p.returncode == 0 and " 0 failed" in p.stdout, (
        f"tests/random_models.py --stage {stage_file} --seeds {SEEDS} at N={nproc} (exit code {p.returncode}):\n"
        + "\n".join(last_lines(p.stdout + p.stderr, 30)))
