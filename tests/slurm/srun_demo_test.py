"""A real Slurm on this one host: munged, slurmctld and slurmd from Debian's packages, started
here with a configuration, a munge key and state that live in a temporary folder, then
`tensorverbs demo --launcher srun` trains over grpc+verbs with 1 ps + 3 workers, each task
placed by the SLURM_* variables srun gives it (`demo-task --cluster-from slurm`), and
`tensorverbs bench ps --launcher srun` runs ResNet-50's steps the same way, and `tensorverbs bench
scale --launcher srun` its all-to-all steps for 2 and 4 tasks.

    srun_demo_test.py TENSORVERBS_BINARY
    srun_demo_test.py TENSORVERBS_BINARY --bad-input

The second needs no Slurm: an srun that is not there and a Slurm environment that is missing
or inconsistent are each a clear error naming what is wrong.

Exit 0: it trained. Exit 77 (CTest's skip): the daemons are not installed or cannot start here,
with the reason. Anything else: a failure, with the daemons' logs. It leaves nothing behind:
the daemons are stopped and the folder removed.
"""

import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77


HELD = []  # port reservations, held for the process's life


def free_port_run(n):
    """A base port with the `n` ports from it free now (each node's k-th task listens on
    base + k), reserved as PickFreePorts reserves its ports (the abstract socket
    "tensorverbs/port/N", which every picker checks) so that no other test picks them. From
    10000 up and below the kernel's ephemeral range, which it hands to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    for _ in range(200):
        base = random.randrange(10000, max(10001, ephemeral_low - n))
        held, socks = [], []
        try:
            for p in range(base, base + n):
                r = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                held.append(r)
                r.bind(f"\0tensorverbs/port/{p}")
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            HELD.extend(held)
            return base
        except OSError:
            for r in held:
                r.close()
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports")


def free_ports(n):
    """`n` distinct free ports, reserved (not necessarily in a run)."""
    base = free_port_run(n)
    return list(range(base, base + n))


def die_with_parent():
    # The daemons run as root: if this script is killed (CTest's timeout), they go too.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Slurm:
    """munged, slurmctld and slurmd in the foreground, everything under `folder`."""

    def __init__(self, folder):
        self.folder = folder
        self.procs = []
        # Not the caller's job: run under sbatch or salloc, srun would join that one.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = os.path.join(folder, "slurm.conf")

    def path(self, name):
        return os.path.join(self.folder, name)

    def start(self):
        key = self.path("munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        # --force: the folder's parents (/tmp) are writable by others, which munged refuses
        # otherwise.
        self.spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                              f"--socket={self.path('munge.sock')}",
                              f"--pid-file={self.path('munged.pid')}",
                              f"--log-file={self.path('munged.log')}",
                              f"--seed-file={self.path('munge.seed')}"])
        self.wait_for(lambda: os.path.exists(self.path("munge.sock")), 10, "munged's socket")
        ctld_port, slurmd_port = free_ports(2)
        node = socket.gethostname().split(".")[0]
        os.makedirs(self.path("state"))
        os.makedirs(self.path("spool"))
        with open(self.path("slurm.conf"), "w") as f:
            f.write(f"""ClusterName=tensorverbs
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={self.path('munge.sock')}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool')}
SlurmctldPidFile={self.path('slurmctld.pid')}
SlurmdPidFile={self.path('slurmd.pid')}
SlurmctldLogFile={self.path('slurmctld.log')}
SlurmdLogFile={self.path('slurmd.log')}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        conf = self.path("slurm.conf")
        self.spawn("slurmctld", ["slurmctld", "-D", "-f", conf])
        self.spawn("slurmd", ["slurmd", "-D", "-f", conf])
        self.wait_for(self.node_idle, 30, "the node to be idle in sinfo")

    def spawn(self, name, argv):
        log = open(self.path(f"{name}.out"), "w")
        self.procs.append((name, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                  env=self.env, preexec_fn=die_with_parent)))

    def node_idle(self):
        for name, p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode}")
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                           env=self.env, timeout=10)
        return r.returncode == 0 and r.stdout.strip() == "idle"

    @staticmethod
    def wait_for(ready, timeout_s, what):
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.2)

    def logs(self):
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "munged.out", "slurmctld.out",
                     "slurmd.out"):
            try:
                with open(self.path(name)) as f:
                    tail = f.read()[-3000:]
            except OSError:
                continue
            out.append(f"--- {name}:\n{tail}")
        return "\n".join(out)

    def stop(self):
        # Job steps outlive srun (slurmstepd runs them): cancel what is left first.
        if any(name == "slurmctld" and p.poll() is None for name, p in self.procs):
            subprocess.run(["scancel", "--full", "--state=RUNNING", "--state=PENDING"],
                           env=self.env, capture_output=True, timeout=10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                q = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True,
                                   timeout=10)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.2)
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def bad_input(tool):
    failures = []

    def expect(what, argv, env, code, *needles):
        r = subprocess.run([tool] + argv, capture_output=True, text=True, env=env, timeout=60)
        text = r.stdout + r.stderr
        if r.returncode != code or not all(n in text for n in needles):
            failures.append(f"{what}: exit {r.returncode} (want {code}), output:\n{text}")
        else:
            print(f"ok: {what}: {text.strip().splitlines()[-1]}")

    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    expect("no srun on PATH", ["demo", "--launcher", "srun", "--protocol", "grpc"],
           dict(base, PATH="/nonexistent"), 1, "'srun' is not on PATH", "is Slurm installed")
    task = ["demo-task", "--cluster-from", "slurm", "--protocol", "grpc", "--steps", "1",
            "--step-base", "1", "--learning-rate", "0.1", "--device", "cpu"]
    expect("not under Slurm", task, base, 2, "SLURM_JOB_NODELIST", "srun or sbatch")
    slurm = dict(base, SLURM_JOB_NODELIST="node[1-2]", SLURM_TASKS_PER_NODE="2(x2)",
                 SLURM_NTASKS="4", TENSORVERBS_SLURM_JOBS="ps:1,worker:3")
    expect("a rank past the tasks", task, dict(slurm, SLURM_PROCID="4"), 2, "SLURM_PROCID")
    expect("jobs that do not add up", task,
           dict(slurm, SLURM_PROCID="0", TENSORVERBS_SLURM_JOBS="ps:1,worker:2"), 2,
           "TENSORVERBS_SLURM_JOBS")
    expect("no ps job", task, dict(slurm, SLURM_PROCID="0", TENSORVERBS_SLURM_JOBS="worker:4"),
           2, "one ps task")
    expect("bench scale placed twice", ["bench", "scale", "--launcher", "srun", "--netns"], base,
           2, "--launcher srun places the tasks", "leave out --netns")
    scale_task = ["bench-scale-task", "--cluster-from", "slurm", "--steps", "1", "--bytes", "4B",
                  "--protocol", "grpc"]
    expect("bench scale's task of another job", scale_task, dict(slurm, SLURM_PROCID="0"), 1,
           "bench scale's tasks are of job 'worker', not 'ps'")
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


def main():
    tool = sys.argv[1]
    if sys.argv[2:] == ["--bad-input"]:
        return bad_input(tool)
    missing = [d for d in ("munged", "slurmctld", "slurmd", "srun", "sinfo")
               if shutil.which(d) is None]
    if missing:
        print(f"SKIP: {', '.join(missing)} not installed (scripts/install-deps.sh installs them)")
        return SKIP
    if os.geteuid() != 0:
        print("SKIP: the Slurm daemons run as root here (SlurmUser=root); run as root")
        return SKIP
    # With the start (40 s at most) and the stop, within CTest's 180 s.
    deadline = time.monotonic() + 120

    def left():
        return max(1.0, deadline - time.monotonic())

    folder = tempfile.mkdtemp(prefix="tv-slurm-")
    slurm = Slurm(folder)
    try:
        try:
            slurm.start()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"SKIP: Slurm could not start here: {e}\n{slurm.logs()}")
            return SKIP
        env = dict(slurm.env, TENSORVERBS_SLURM_PORT=str(free_port_run(4)))
        started = time.monotonic()
        r = subprocess.run([tool, "demo", "--launcher", "srun", "--workers", "3", "--steps", "10",
                            "--protocol", "grpc+verbs"],
                           capture_output=True, text=True, env=env, timeout=left())
        print(r.stdout)
        print(r.stderr, file=sys.stderr)
        if r.returncode != 0:
            print(f"FAIL: the demo under srun exited with code {r.returncode}\n{slurm.logs()}")
            return 1
        checks = {
            "launched by srun": "launched by srun" in r.stdout,
            "every step": all(f"step {s} loss" in r.stdout for s in range(1, 11)),
            "1 ps + 3 workers over grpc+verbs":
                "protocol grpc+verbs, 1 ps + 3 workers, 10 steps" in r.stdout,
        }
        loss = re.search(r"loss: ([0-9.]+) -> ([0-9.]+)", r.stdout)
        checks["the loss went down"] = bool(loss) and float(loss[2]) < float(loss[1])
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            print(f"FAIL: {', '.join(failed)}")
            return 1
        print(f"ok: trained under srun in {time.monotonic() - started:.1f} s")
        # bench ps the same way: each run one job step, each rank's result read from srun's
        # labelled output. 80 steps make each worker's result line a few KiB, more than srun
        # may pass on in one piece.
        r = subprocess.run([tool, "bench", "ps", "--launcher", "srun", "--model", "resnet50",
                            "--workers", "2", "--steps", "80", "--warmup", "1", "--protocols",
                            "grpc+verbs"], capture_output=True, text=True, env=env, timeout=left())
        print(r.stdout)
        print(r.stderr, file=sys.stderr)
        row = re.search(r"^\s*grpc\+verbs\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)", r.stdout, re.M)
        if r.returncode != 0 or "1 ps + 2 workers launched by srun" not in r.stdout or not row:
            print(f"FAIL: bench ps under srun (exit {r.returncode})\n{slurm.logs()}")
            return 1
        # bench scale the same way: each task count one job step of all-to-all steps.
        json_path = os.path.join(folder, "scale.json")
        r = subprocess.run([tool, "bench", "scale", "--launcher", "srun", "--tasks", "2,4",
                            "--steps", "5", "--json", json_path],
                           capture_output=True, text=True, env=env, timeout=left())
        print(r.stdout)
        print(r.stderr, file=sys.stderr)
        rows = []
        if r.returncode == 0 and os.path.exists(json_path):
            with open(json_path) as f:
                rows = json.load(f)
        counts = [row.get("tasks") for row in rows
                  if row.get("launcher") == "srun" and "error" not in row
                  and row.get("channels_per_task", 0) == 2 * (row.get("tasks", 0) - 1)]
        if r.returncode != 0 or "each count one Slurm job step" not in r.stdout or counts != [2, 4]:
            print(f"FAIL: bench scale under srun (exit {r.returncode}, rows {rows})\n{slurm.logs()}")
            return 1
        print(f"PASS: the demo, bench ps and bench scale ran under srun in "
              f"{time.monotonic() - started:.1f} s")
        return 0
    finally:
        slurm.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
