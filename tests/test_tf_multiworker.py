"""Two TensorFlow workers on this host, for real: examples/keras_train.py started twice with a
TF_CONFIG naming two free localhost ports, on CPU. Each worker decides (probing RING across both
workers), then trains. Asserted on the decision and training records the script writes
(``--result``), never on English."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.slow, pytest.mark.tensorflow]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "keras_train.py"
LIMIT_S = 120  # a bound on each worker, so that a bug fails the test instead of hanging it
SAMPLES, GLOBAL_BATCH, EPOCHS = 1024, 64, 2
KEY = "tensorflow:mw_ring:cpu"
AUTO = "tensorflow:mw_auto:cpu"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class Workers:
    """Two worker processes of one TF_CONFIG job; every process is killed at the end."""

    def __init__(self, out: Path, timeout_s: float, **env: str) -> None:
        self.out = out
        ports = free_ports(2)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        base = {k: v for k, v in os.environ.items()
                if not k.startswith("RESILIENT_STRATEGY_") and k != "TF_CONFIG"}
        (out / "tmp").mkdir()
        base.update({
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            "RESILIENT_STRATEGY_CACHE": "0", "TF_CPP_MIN_LOG_LEVEL": "2",
            "OMP_NUM_THREADS": "1", "TMPDIR": str(out / "tmp"), **env})
        self.started = time.monotonic()
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPT), "--samples", str(SAMPLES), "--epochs", str(EPOCHS),
                 "--global-batch-size", str(GLOBAL_BATCH), "--timeout", str(timeout_s),
                 "--result", str(out / f"w{i}")],
                env={**base, "TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": "worker", "index": i}})},
                cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True)
            for i in (0, 1)
        ]
        self.logs = ["", ""]
        self.elapsed_s = 0.0

    def wait(self) -> list[int | None]:
        end = self.started + deadline(LIMIT_S)
        codes = []
        for i, p in enumerate(self.procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                out, _ = p.communicate()
            self.logs[i] = out.decode(errors="replace")[-6000:]
            codes.append(p.returncode)
        self.elapsed_s = time.monotonic() - self.started
        return codes

    def kill(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    def read(self, what: str) -> dict[int, dict[str, Any]]:
        """worker -> its record ``what`` (decision / trained)."""
        return {i: json.loads(f.read_text()) for i in (0, 1)
                if (f := self.out / f"w{i}.{what}.json").exists()}

    def leftovers(self) -> list[str]:
        """Processes of this job still alive: the workers, or a probe (its files are in out/)."""
        left = []
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if str(self.out) in cmd and "pytest" not in cmd:
                    left.append(cmd)
        return left

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        for p in self.procs:
            p.wait()


def multi_worker_event(decision: dict[str, Any]) -> dict[str, Any]:
    (event,) = [e for e in decision["events"] if e["kind"] == "multi_worker"]
    return event


def test_two_healthy_workers_prove_ring_across_both_and_train_in_step(tmp_path: Path) -> None:
    with Workers(tmp_path, 60) as job:  # generous: a loaded CI machine must not time it out
        codes = job.wait()
    assert codes == [0, 0], job.logs
    decisions = job.read("decision")
    assert set(decisions) == {0, 1}
    for i, d in decisions.items():
        assert (d["backend"], d["num_replicas"], d["accumulation_steps"]) == ("mw_ring", 2, 1)
        assert (d["tf_workers"], d["tf_worker_rank"], d["active"], d["proven"]) == (2, i, True,
                                                                                   True)
        assert d["batch_size"] == GLOBAL_BATCH  # each worker feeds the global batch
        probe = d["probes"][KEY]
        assert probe["status"] == "ok" and ["workers", "2"] in probe["extra"]
        event = multi_worker_event(d)
        assert [(p["candidate"]["key"], p["status"]) for p in event["probed"]] == [(KEY, "ok")]
        assert (event["workers"], event["worker_rank"], event["alone"]) == (2, i, False)
    p0, p1 = (decisions[i]["probes"][KEY] for i in (0, 1))
    # the verdict all-reduce made both workers report the same figures: the same plan follows
    assert p0["bus_bandwidth_gbps"] == p1["bus_bandwidth_gbps"] > 0
    assert p0["step_seconds"] == p1["step_seconds"] > 0
    trained = job.read("trained")
    assert set(trained) == {0, 1}
    for t in trained.values():
        assert t["strategy"] == "KerasMultiWorkerMirroredStrategy"
        assert t["replicas_in_sync"] == 2
        assert t["optimizer_updates"] == SAMPLES // GLOBAL_BATCH * EPOCHS
    assert trained[0]["weights_sum"] == trained[1]["weights_sum"]  # the workers stayed in step
    assert trained[0]["loss"] == trained[1]["loss"]
    assert job.leftovers() == []


def test_hangs_in_the_ring_and_auto_probes_fall_back_to_worker_0_alone(tmp_path: Path) -> None:
    # every probe hangs: each is cut at its deadline whatever its size (6 s: the two rounds,
    # each followed by the kill grace and the settle time, are most of this test's time)
    with Workers(tmp_path, 6, RESILIENT_STRATEGY_PROBE_FAULT="hang:1") as job:
        codes = job.wait()
    assert codes == [0, 0], job.logs
    decisions = job.read("decision")
    assert set(decisions) == {0, 1}
    for i, d in decisions.items():  # the same fallback on both: no split
        assert (d["backend"], d["num_replicas"], d["accumulation_steps"]) == ("cpu", 1, 2)
        assert d["per_replica_batch_size"] * d["accumulation_steps"] == GLOBAL_BATCH
        assert d["probes"][KEY]["status"] == d["probes"][AUTO]["status"] == "timeout"
        event = multi_worker_event(d)
        assert [(p["candidate"]["key"], p["status"]) for p in event["probed"]] == [
            (KEY, "timeout"), (AUTO, "timeout")]
        assert (event["alone"], event["active"]) == (True, i == 0)
        assert d["active"] is (i == 0)
    trained = job.read("trained")
    assert set(trained) == {0}  # worker 1 exited 0 at scope(), before training
    assert trained[0]["strategy"] == "OneDeviceStrategy"
    assert trained[0]["optimizer_updates"] == SAMPLES // GLOBAL_BATCH * EPOCHS
    assert job.leftovers() == []


PROBE = """
import json, sys
from resilient_strategy.core.measures.probe import ProbeSpec
from resilient_strategy.probing.prober import run_probe
import os
backend = sys.argv[2]
spec = ProbeSpec(f"tensorflow:{backend}:cpu", "tensorflow", backend, (), timeout_s=45.0,
                 workers=2, worker_rank=int(sys.argv[1]), train_step=False)
print(json.dumps(run_probe(spec, dict(os.environ)).to_dict()))
"""


def probe_both(tmp_path: Path, backend: str, fault_on_1: str = "") -> list[dict[str, Any]]:
    """One probe process per worker of a 2-worker TF_CONFIG on localhost: their results."""
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    base = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")}
    base.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    procs = []
    for i in (0, 1):
        env = {**base, "TF_CONFIG": json.dumps({"cluster": cluster,
                                                "task": {"type": "worker", "index": i}})}
        if i == 1 and fault_on_1:
            env["RESILIENT_STRATEGY_PROBE_FAULT"] = fault_on_1
        procs.append(subprocess.Popen([sys.executable, "-c", PROBE, str(i), backend], env=env,
                                      cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
    try:
        results = [json.loads(p.communicate(timeout=deadline(LIMIT_S))[0]) for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    return results


def test_a_wrong_value_on_one_worker_fails_the_probe_on_both(tmp_path: Path) -> None:
    # only worker 1 is told: its contribution is off by one
    results = probe_both(tmp_path, "mw_ring", "wrong:1:mw_ring")
    assert [(r["status"], r["cause"]) for r in results] == [("error", "wrong_result")] * 2, \
        json.dumps(results, indent=1)


def test_auto_is_proven_across_two_workers(tmp_path: Path) -> None:
    """CommunicationImplementation.AUTO, the rung after RING: both workers pass with the same
    verdict figures (TensorFlow resolves AUTO to its ring all-reduce on CPU)."""
    results = probe_both(tmp_path, "mw_auto")
    assert [(r["status"], r["candidate"]) for r in results] == [("ok", AUTO)] * 2, json.dumps(results, indent=1)
    assert results[0]["bus_bandwidth_gbps"] == results[1]["bus_bandwidth_gbps"] > 0


CHIEF_ALONE = """
import json, os
os.environ["KERAS_BACKEND"] = "tensorflow"
import numpy as np, keras
from resilient_strategy.frameworks.tensorflow import TfRuntime
rt = TfRuntime("hierarchical_copy", (0, 1), 1, 32, 16, logical_cpus=2)
with rt.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
x = np.random.default_rng(0).random((64, 4), dtype="float32")
model.fit(x, x.sum(1, keepdims=True), batch_size=rt.batch_size_to_feed, epochs=1, verbose=0)
print(json.dumps({"strategy": type(rt.strategy).__name__,
                  "replicas": int(rt.strategy.num_replicas_in_sync),
                  "updates": int(model.optimizer.iterations.numpy())}))
"""


def test_worker_0_alone_trains_under_mirrored_strategy_whatever_tf_config_says(
        tmp_path: Path) -> None:
    """Worker 0 alone on its own devices (2 logical CPUs standing in for its GPUs): TensorFlow's
    MirroredStrategy over local devices ignores the TF_CONFIG that names the absent workers."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path),
               TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}))
    out = subprocess.run([sys.executable, "-c", CHIEF_ALONE], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=deadline(LIMIT_S))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"strategy": "MirroredStrategy", "replicas": 2, "updates": 2}
