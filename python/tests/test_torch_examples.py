"""The torch.distributed examples as a user runs them: DistributedDataParallel on 2 and 4
processes and a two-stage pipeline, each with backend="tensorverbs" (on every protocol) and
again with gloo; the loss falls, and each step's loss matches gloo's to float tolerance (same
seeds, same data)."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
try:
    import tensorverbs.torch  # noqa: F401
except ImportError as e:
    pytest.skip(f"the torch backend is not built: {e}", allow_module_level=True)

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


PROTOCOLS = ["grpc+verbs", "grpc", "grpc+verbs-copy", "grpc+gdr"]


def losses(example, backend, *args, protocol="grpc+verbs"):
    run = subprocess.run([sys.executable, os.path.join(EXAMPLES, example, "train.py"),
                          "--backend", backend, *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240,
                         env=dict(os.environ, TENSORVERBS_PROTOCOL=protocol))
    assert run.returncode == 0, run.stdout
    found = [float(m.group(2)) for m in re.finditer(r"^step (\d+) loss ([0-9.]+)$", run.stdout,
                                                     re.MULTILINE)]
    assert found, run.stdout
    assert re.search(rf"^{backend}: .*median step [0-9.]+ ms$", run.stdout, re.MULTILINE), \
        run.stdout
    return found


_gloo_runs = {}


def gloo_losses(example, *args):
    """gloo's curve for the example, run once for every protocol compared with it."""
    key = (example, *args)
    if key not in _gloo_runs:
        _gloo_runs[key] = losses(example, "gloo", *args)
    return _gloo_runs[key]


def assert_same_curve(ours, gloo):
    assert len(ours) == len(gloo)
    for step, (a, b) in enumerate(zip(ours, gloo)):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), f"step {step}: {a} vs gloo's {b}"


@pytest.mark.parametrize("nprocs,protocol",
                         [(2, p) for p in PROTOCOLS] + [(4, "grpc+verbs")])
def test_ddp_trains_as_it_does_on_gloo(nprocs, protocol):
    args = ["--nprocs", str(nprocs), "--steps", "20"]
    ours = losses("torch_ddp", "tensorverbs", *args, protocol=protocol)
    assert len(ours) == 20
    assert ours[-1] < ours[0] / 2, ours
    assert_same_curve(ours, gloo_losses("torch_ddp", *args))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_pipeline_trains_as_it_does_on_gloo(protocol):
    ours = losses("torch_pipeline", "tensorverbs", "--steps", "30", protocol=protocol)
    assert ours[-1] < ours[0] / 3, ours
    assert_same_curve(ours, gloo_losses("torch_pipeline", "--steps", "30"))
