"""bf16, the dtype --dtype auto picks where bf16 is fast (and README's sample): every stage at N = 2 against the bf16
single-process reference, with test_stages.py's model and training (6 steps, grad_accum 2, clipping that clips).
The ledgers' bf16 formulas are the pairs matrix's (test_pairs.py); here, the numbers."""
import pytest

from conftest import ROOT
from test_stages import BUCKETS, MODEL, TRAIN, compare_params, first_difference

BF16 = [a if a != "fp32" else "bf16" for a in TRAIN]
# Tolerances. bf16 keeps 8 significant bits: gradients summed in another order and rounded to bf16 differ by up to
# 2^-8 relative, and Adam turns a near-zero gradient's noise into a step of up to lr (1e-3 here). Measured on a
# 2-core AMD EPYC with AVX2 only (Zen 3; bf16 matmuls there run torch's fallback), every stage at N = 2 against the
# reference: losses within 5.5e-5, gradient norms within 4.1e-4 relative, no element more than 1.0e-3 apart (lr:
# Adam's noise), the median element of every tensor within 6.5e-5 of its largest value, and at least 99.31% of
# every tensor's elements within 1e-3 of its largest. Each tolerance is about twice that: a mistake the size of
# rounding noise is not a parity failure, one twice as large is.
LOSS_ATOL, NORM_RTOL, ATOL_ANY, MEDIAN_RTOL = 1.2e-4, 1e-3, 2e-3, 1.3e-4
BULK_RTOL, BULK_SHARE = 1e-3, 0.986


@pytest.fixture(scope="session")
def bf16_reference(runner):
    return runner.run(str(ROOT / "train_gpt.py"), None, *MODEL, *BF16)


def test_bf16_parity_with_reference(runner, bf16_reference, stage_file):
    buckets = BUCKETS if "--bucket_mb" in runner.options(stage_file) else []
    run = runner.run(stage_file, 2, *MODEL, *BF16, *buckets)
    ref, s = bf16_reference.summary, run.summary
    where = f"{s['stage']} in bf16 at N=2"
    assert s["dtype"] == ref["dtype"] == "bf16", f"{where}: ran in {s['dtype']}, the reference in {ref['dtype']}"
    assert len(s["losses"]) == len(ref["losses"]), f"{where}: {len(s['losses'])} losses, expected {len(ref['losses'])}"
    k = first_difference(ref["grad_norms"], s["grad_norms"], NORM_RTOL)
    assert k is None, f"{where}: global gradient norm at step {k} is {s['grad_norms'][k]:.7g}, expected " \
        f"{ref['grad_norms'][k]:.7g}"
    k = first_difference(ref["losses"], s["losses"], LOSS_ATOL)
    assert k is None, f"{where}: loss at step {k} is {s['losses'][k]:.7f}, expected {ref['losses'][k]:.7f}"
    assert abs(s["val_loss"] - ref["val_loss"]) <= LOSS_ATOL, f"{where}: val loss {s['val_loss']} != {ref['val_loss']}"
    compare_params(bf16_reference.master, run.master, where, BULK_RTOL, BULK_SHARE, ATOL_ANY, MEDIAN_RTOL)
