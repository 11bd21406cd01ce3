"""A graph compiled with grad disabled runs below the autograd dispatch keys (``compat.below_autograd``): fp8fx's ops
skip custom_op's autograd kernel there, and nothing else changes; graphs that need autograd keep it."""
import pytest
import torch
from torch import nn

import fp8fx
from fp8fx.lowerings import compat


def _records_autograd(args):
    """Whether a product of a tensor that requires grad records autograd history here."""
    return (args[0] * 2).grad_fn is not None


def test_below_autograd_excludes_the_keys_only_inside_and_keeps_attributes():
    _records_autograd._boxed_call = True
    try:
        wrapped = compat.below_autograd(_records_autograd)
        leaf = torch.ones(2, requires_grad=True)
        assert not wrapped([leaf]) and _records_autograd([leaf]) and wrapped._boxed_call is True
    finally:
        del _records_autograd._boxed_call


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)  # a parameter that requires grad, as a model's have
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(self.norm(x))))


class EnablesGrad(Mlp):
    def forward(self, x):
        with torch.enable_grad():
            return super().forward(x)


@pytest.mark.parametrize("model_cls,grad,expect_below", [(Mlp, False, True), (Mlp, True, False),
                                                         (EnablesGrad, False, False)])
def test_backend_runs_no_grad_graphs_below_autograd(monkeypatch, model_cls, grad, expect_below):
    """Under no_grad the compiled graph runs below autograd, with the bits the same graph gives run with autograd;
    with grad enabled, or where the traced code enables it, the graph keeps autograd: its output requires grad, and
    fp8fx rewrites no linear there (it quantizes for inference; its ops have no autograd formula)."""
    torch.manual_seed(0)
    model = model_cls().to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config())
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    real = compat.below_autograd
    outputs, wrapped, backends = [], [], []
    for wrapper in (lambda fn: wrapped.append(fn) or real(fn), lambda fn: fn):
        torch._dynamo.reset()
        monkeypatch.setattr(compat, "below_autograd", wrapper)
        backends.append(fp8fx.Fp8Backend())
        with torch.set_grad_enabled(grad):
            outputs.append(torch.compile(model, backend=backends[-1])(x))
    got, want = outputs
    assert bool(wrapped) == expect_below and len(backends[0].report.rewritten) == (2 if expect_below else 0)
    assert got.requires_grad == want.requires_grad == (not expect_below)
    assert torch.equal(got.detach(), want.detach())
