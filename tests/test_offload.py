"""offload.py beyond the checks every stage gets (test_stages.py runs those on it too): the parameter shard offloaded
as well, the one-step-delayed update against a reference that applies each update one step late, and where each
model state lives."""
import pytest

from conftest import ROOT
from test_stages import LOSS_ATOL, MODEL, TRAIN, compare_params, first_difference, reference  # noqa: F401

OFFLOAD = str(ROOT / "offload.py")

DELAYED_REFERENCE = '''
import sys
sys.path.insert(0, {root!r})
from train_gpt import SingleDeviceEngine, main


class DelayedReference(SingleDeviceEngine):
    """The reference, updated one step late: step t's update is computed from step t's gradients as usual, but the
    model goes on with the weights of the update before it, so step t+1 runs on the weights of update t-1."""
    def step(self, lr):
        previous = [m.clone() for m in self.master]
        norm = super().step(lr)
        for p, m in zip(self.params, previous):
            p.data.copy_(m)
        return norm


main(DelayedReference, stage="reference", distributed=False)
'''


@pytest.mark.parametrize("nproc", [1, 2])
def test_offload_params_parity_and_placement(runner, reference, nproc):
    run = runner.run(OFFLOAD, nproc, *MODEL, *TRAIN, "--offload_params")
    s = run.summary
    k = first_difference(reference.summary["losses"], s["losses"], LOSS_ATOL)
    assert k is None, f"offload --offload_params at N={nproc}: loss at step {k} differs from the reference"
    compare_params(reference.master, run.master, f"offload --offload_params at N={nproc}")
    for category, v in s["model_state_bytes"].items():
        assert v["measured"] == v["theory"], f"{category}: measured {v['measured']:,}, formula {v['theory']:,}"
        assert v["where"] == "host", f"with --offload_params every model state lives on the host; {category} does not"


def test_default_placement(runner):
    s = runner.run(OFFLOAD, 2, *MODEL, *TRAIN).summary
    where = {k: v["where"] for k, v in s["model_state_bytes"].items()}
    assert where == {"params": "device", "grads": "host", "master": "host", "adam_m": "host", "adam_v": "host"}, where


@pytest.mark.parametrize("nproc", [1, 2])
def test_delayed_update_is_exactly_one_step_stale(runner, tmp_path_factory, nproc):
    script = tmp_path_factory.mktemp("delayed") / "delayed_reference.py"
    script.write_text(DELAYED_REFERENCE.format(root=str(ROOT)))
    expected = runner.run(str(script), None, *MODEL, *TRAIN)
    got = runner.run(OFFLOAD, nproc, *MODEL, *TRAIN, "--delayed_update")
    where = f"offload --delayed_update at N={nproc}"
    k = first_difference(expected.summary["losses"], got.summary["losses"], LOSS_ATOL)
    assert k is None, (f"{where}: loss at step {k} is {got.summary['losses'][k]:.7f}, a reference updated one step late "
                       f"has {expected.summary['losses'][k]:.7f}")
    compare_params(expected.master, got.master, where)


def test_delayed_update_differs_from_exact(runner, reference):
    """The staleness is real: step 0 is the same, but step 1 already runs on the initial weights again."""
    got = runner.run(OFFLOAD, 1, *MODEL, *TRAIN, "--delayed_update").summary["losses"]
    exact = reference.summary["losses"]
    assert got[0] == pytest.approx(exact[0], abs=LOSS_ATOL)
    assert all(abs(g - e) > 1e-4 for g, e in zip(got[1:], exact[1:])), (got, exact)


def test_delayed_update_second_gradient_shard_is_in_the_formula(runner):
    """--delayed_update holds two gradient shards (one filling, one read by the CPU update): the formula counts both,
    so measured equals theory for this option too."""
    s = runner.run(OFFLOAD, 1, *MODEL, *TRAIN, "--delayed_update").summary
    for category, v in s["model_state_bytes"].items():
        assert v["measured"] == v["theory"], f"{category}: measured {v['measured']:,}, formula {v['theory']:,}"
    assert s["model_state_bytes"]["grads"]["theory"] == 2 * s["model_state_bytes"]["params"]["theory"]
