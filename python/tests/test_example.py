"""The PyTorch example (examples/pytorch_ps/train.py) as a user runs it: one parameter server
and two workers as processes of their own, the loss falling step after step."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                       "pytorch_ps", "train.py")


@pytest.mark.parametrize("protocol", ["grpc+verbs", "grpc"])
def test_the_pytorch_parameter_server_example_trains(protocol):
    steps = 12
    run = subprocess.run([sys.executable, EXAMPLE, "--steps", str(steps), "--protocol", protocol,
                          "--timeout", "200"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert run.returncode == 0, run.stdout
    losses = [float(m.group(2)) for m in re.finditer(r"^step (\d+) loss ([0-9.]+)$", run.stdout,
                                                     re.MULTILINE)]
    assert len(losses) == steps, run.stdout
    assert losses[-1] < losses[0], run.stdout
    assert "loss fell from" in run.stdout
    # Worker 0 evaluated the trained parameters the server sent last.
    assert re.search(r"worker 0: loss on its shard with the trained parameters [0-9.]+",
                     run.stdout), run.stdout
