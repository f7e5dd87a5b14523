"""`pip install --no-build-isolation .` as the README documents it: into a virtual environment
that sees Debian's packages, offline, reusing the CMake build the tests run from (so it only
links what is already built), then used from outside the source tree and uninstalled."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("TENSORVERBS_CMAKE_BUILD_DIR", os.path.join(ROOT, "build"))

USE_IT = textwrap.dedent("""
    import numpy as np, tensorverbs as tv
    ports = tv.free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    with tv.Server(cluster, "worker", 0) as a, tv.Server(cluster, "worker", 1) as b:
        a.wait_for_peers(30); b.wait_for_peers(30)
        with a.step(1) as rx, b.step(1) as tx:
            tx.send("worker:0", "x", np.arange(10, dtype=np.int32))
            got = rx.recv("worker:1", "x", timeout=20)
    assert (got == np.arange(10)).all()
    print("installed", tv.__version__, tv.__file__)
    import os
    if any(f.startswith("_tensorverbs_torch.") for f in os.listdir(os.path.dirname(tv.__file__))):
        import torch.distributed as dist, tensorverbs.torch
        assert "TENSORVERBS" in dist.Backend._plugins
        print("torch backend registered")
""")


def run(args, env, cwd):
    return subprocess.run(args, env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)


def test_pip_installs_the_package_into_a_venv_offline(tmp_path):
    if not os.path.exists(os.path.join(BUILD, "CMakeCache.txt")):
        pytest.skip(f"no configured CMake build at {BUILD}")
    try:
        import venv  # noqa: F401 (python3-venv)
        import setuptools  # noqa: F401
        import wheel  # noqa: F401
    except ImportError as e:
        pytest.skip(f"{e.name} is not installed (scripts/install-deps.sh installs it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    env.update(TMPDIR=str(tmp_path), PIP_NO_CACHE_DIR="1", PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", TENSORVERBS_CMAKE_BUILD_DIR=BUILD,
               PYTHONDONTWRITEBYTECODE="1", HOME=str(tmp_path))
    venv_dir = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", "--system-site-packages", str(venv_dir)], env,
               tmp_path)
    assert made.returncode == 0, made.stdout
    python = str(venv_dir / "bin" / "python")
    installed = run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", ROOT],
                    env, tmp_path)
    assert installed.returncode == 0, installed.stdout
    assert "Successfully installed tensorverbs" in installed.stdout, installed.stdout

    used = run([python, "-c", USE_IT], env, tmp_path)
    assert used.returncode == 0, used.stdout
    assert "installed " in used.stdout
    assert str(venv_dir) in used.stdout, "imported from the venv, not the build tree"
    built = os.listdir(os.path.join(BUILD, "python", "tensorverbs"))
    if any(f.startswith("_tensorverbs_torch.") for f in built):
        assert "torch backend registered" in used.stdout, used.stdout

    removed = run([python, "-m", "pip", "uninstall", "-y", "tensorverbs"], env, tmp_path)
    assert removed.returncode == 0, removed.stdout
    gone = run([python, "-c", "import tensorverbs"], env, tmp_path)
    assert gone.returncode != 0
