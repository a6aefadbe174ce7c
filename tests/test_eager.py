"""training/eager.py: a training rank builds, steps, checkpoints and counts FLOPs without
importing ``torch._dynamo``, and its optimizers compute exactly what torch's own do.

Each case runs in a fresh interpreter: whether ``torch._dynamo`` is imported, and the marks
on torch's wrappers, are per process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from rigenv import base_env

SCRIPT = r"""
import sys, torch
from hpcai.training import eager, tasks
from hpcai.training.config import parse
plain = sys.argv[1] == "plain"
if plain:
    eager.optimizer = lambda cls, params, **o: cls(params, **o)
    eager.skip_wrappers = lambda: 0
for argv in (["3dgan", "--generate", "8", "--batch-size", "2"],
             ["resnet-tiny", "--image-size", "16", "--classes", "4", "--batch-size", "2"]):
    task = tasks.make_task(parse(argv), 1e-3)
    assert task.flops_per_sample() > 0
    for opt in task.optimizers.values():
        opt.zero_grad(set_to_none=False)
        opt.load_state_dict(opt.state_dict())
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
"""

STEPS = r"""
import sys, torch
from hpcai.training import eager

def run(make, cls, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 1))
    opt = make(cls, model.parameters(), **options)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    x = torch.randn(16, 8)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()
    opt.load_state_dict(opt.state_dict())
    assert seen == ["pre", "post"] * 3, seen
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()

cases = [(torch.optim.Adam, dict(lr=1e-2)),
         (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)),
         (torch.optim.RMSprop, dict(lr=1e-2, alpha=0.9))]
ours = [run(eager.optimizer, cls, **o) for cls, o in cases]
assert "torch._dynamo" not in sys.modules
for (cls, o), (params, state) in zip(cases, ours):
    ref_params, ref_state = run(lambda c, p, **k: c(p, **k), cls, **o)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), cls.__name__
    for key, value in state["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, ref_state["state"][key][name]), (cls.__name__, name)
print("equal")
"""


def _python(code: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-c", code, *args], env=base_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("how, imported", [("eager", "no dynamo"), ("plain", "dynamo")],
                         ids=["eager", "plain-torch (control)"])
def test_a_training_task_never_imports_dynamo(how, imported):
    """Both built-in tasks' optimizers, their state round trip and the FLOP count (meta
    tensors under FlopCounterMode) leave ``torch._dynamo`` unimported; with torch's own
    optimizers and unmarked wrappers (the control) the same work imports it."""
    assert _python(SCRIPT, how) == imported


def test_eager_optimizers_step_exactly_as_torchs_with_their_hooks():
    """Adam, SGD (momentum, weight decay) and RMSprop: three steps give the same parameters
    and optimizer state, bit for bit, as torch's ``step``; the step hooks run around each."""
    assert _python(STEPS) == "equal"
