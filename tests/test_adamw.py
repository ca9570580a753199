"""train_gpt.AdamW, the optimizer every GPU-side stage uses, is torch.optim.AdamW element by element: decoupled weight
decay (not L2 added to the gradient), bias correction counted once per step, eps after the bias correction."""
from types import SimpleNamespace

import pytest
import torch

from train_gpt import AdamW


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch(weight_decay):
    torch.manual_seed(0)
    args = SimpleNamespace(beta1=0.9, beta2=0.99, weight_decay=weight_decay)
    p0 = torch.randn(10_007)
    ours, ref = p0.clone(), p0.clone().requires_grad_()
    opt = AdamW(ours, args)
    torch_opt = torch.optim.AdamW([ref], lr=1.0, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, foreach=False)
    for step, lr in enumerate([1e-3, 3e-3, 2e-3, 5e-4, 1e-4]):  # a learning rate that changes between steps
        grad = torch.randn_like(p0) * (10.0 ** -step)          # gradients that shrink, so bias correction matters
        opt.step([(slice(None), grad)], lr)
        torch_opt.param_groups[0]["lr"] = lr
        ref.grad = grad.clone()
        torch_opt.step()
        # fp32, the same operations in the same order: equal to the last bit but for libm's sqrt/pow rounding
        torch.testing.assert_close(ours, ref.detach(), rtol=1e-6, atol=1e-9, msg=lambda m: f"step {step}: {m}")
    assert opt.t == 5
    torch.testing.assert_close(opt.exp_avg_sq, torch_opt.state[ref]["exp_avg_sq"], rtol=1e-6, atol=0)
