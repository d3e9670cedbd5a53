"""The analyses on a real Dask cluster: a `dask scheduler` and `dask worker` processes on 127.0.0.1.

A relative dump path works with workers started in another folder and gives the in-process JSON; a cluster
without workers, at the start or after losing them, ends within --worker-wait with one line naming the
scheduler; a worker whose environment lacks fa-forensics is named as such; --workers N with --scheduler is
refused; a local cluster's JSON is the in-process JSON even with port 8787 taken."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from fa_forensics.errors import NoWorkers
from fa_forensics.layers.fanout import Workers, map_in_order

pytestmark = pytest.mark.slow  # starts a Dask scheduler and worker processes

SMALL = dict(steps=(0,), layers=(0,), heads=4, seq=32, head_dim=8)
BARE_WORKER = textwrap.dedent('''
    """A dask worker in an environment where fa-forensics cannot be imported."""
    import sys

    class NoFaForensics:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] == "fa_forensics":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoFaForensics)
    from distributed.cli.dask_worker import main

    sys.argv = ["dask-worker", *sys.argv[1:]]
    main()
''')


def _cli(args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "fa_forensics.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


class Cluster:
    """A scheduler process and the worker processes started against it; stopped by their ids."""

    def __init__(self, where):
        self.where = where
        info = where / "scheduler.json"
        self.processes = [subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
             "--no-dashboard", "--scheduler-file", str(info)], cwd=where, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)]
        deadline = time.monotonic() + 120
        while not info.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.address = json.loads(info.read_text())["address"]

    def worker(self, cwd, *, bare: bool = False, name: str = "w") -> subprocess.Popen:
        """Start one single-threaded worker in `cwd` (no nanny: killing it loses it) and wait until it joined."""
        from dask.distributed import Client

        if bare:
            (cwd / "bare_worker.py").write_text(BARE_WORKER)
            command = [sys.executable, str(cwd / "bare_worker.py")]
        else:
            command = [sys.executable, "-m", "distributed.cli.dask_worker"]
        before = self.n_workers(Client)
        worker = subprocess.Popen([*command, self.address, "--nthreads", "1", "--no-nanny", "--no-dashboard",
                                   "--name", name], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        self.processes.append(worker)
        deadline = time.monotonic() + 120
        while self.n_workers(Client) <= before and time.monotonic() < deadline:
            time.sleep(0.3)
        return worker

    def n_workers(self, Client) -> int:
        with Client(self.address, timeout="10s") as client:
            return len(client.nthreads())

    def stop(self, process: subprocess.Popen) -> None:
        if process.poll() is None:
            process.kill()
            process.wait(30)

    def close(self) -> None:
        for process in reversed(self.processes):
            self.stop(process)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory, dump_builder):
    """A folder holding small.zarr, the in-process JSON of delta-bias on it, and a folder for workers elsewhere."""
    where = tmp_path_factory.mktemp("run")
    dump_builder(where / "small.zarr", **SMALL)
    done = _cli(["delta-bias", "small.zarr", "--preset", "bf16", "--json", "inproc.json"], where)
    assert done.returncode == 0, done.stderr
    (where / "elsewhere").mkdir()
    return where


def test_a_scheduler_without_workers_ends_within_the_wait_naming_it(cluster, small):
    t0 = time.monotonic()
    done = _cli(["delta-bias", "small.zarr", "--preset", "bf16", "--scheduler", cluster.address, "--worker-wait", "2",
                 "--json", "none.json"], small)
    assert done.returncode == 2 and time.monotonic() - t0 < 120
    line = done.stderr.strip().splitlines()
    assert len(line) == 1 and f"the Dask scheduler {cluster.address} has no workers (waited 2 s" in line[0]
    assert f"dask worker {cluster.address}" in line[0] and "--worker-wait" in line[0]


def test_conflicting_options_are_refused_in_one_line(cluster, small):
    done = _cli(["delta-bias", "small.zarr", "--workers", "2", "--scheduler", cluster.address], small)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "--workers: 2 starts a local cluster" in done.stderr and "give one of the two" in done.stderr


def test_a_worker_without_fa_forensics_is_named(cluster, small):
    bare = cluster.worker(small / "elsewhere", bare=True, name="bare")
    try:
        done = _cli(["delta-bias", "small.zarr", "--preset", "bf16", "--scheduler", cluster.address], small)
    finally:
        cluster.stop(bare)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"of the Dask scheduler {cluster.address}" in done.stderr and "worker tcp://127.0.0.1:" in done.stderr
    assert "cannot run fa-forensics: ModuleNotFoundError: No module named 'fa_forensics'" in done.stderr
    assert "unexpected" not in done.stderr


def test_a_relative_dump_path_on_workers_started_elsewhere_gives_the_in_process_json(cluster, small):
    worker = cluster.worker(small / "elsewhere", name="elsewhere")
    try:
        done = _cli(["delta-bias", "small.zarr", "--preset", "bf16", "--scheduler", cluster.address, "--json",
                     "cluster.json"], small)
        assert done.returncode == 0, done.stderr
        assert (small / "cluster.json").read_text() == (small / "inproc.json").read_text()

        # the last worker lost mid-run: the work item kills its worker (no nanny restarts it)
        t0 = time.monotonic()
        with pytest.raises(NoWorkers, match=f"the Dask scheduler {cluster.address} lost its workers during the run "
                                            "and got none back in 2 s") as lost:
            map_in_order(os._exit, [3], Workers(scheduler=cluster.address, wait=2))
        assert lost.value.lost and time.monotonic() - t0 < 90
        assert worker.wait(30) is not None
    finally:
        cluster.stop(worker)


def test_a_local_cluster_gives_the_in_process_json_with_the_dashboard_port_taken(small):
    taken = socket.socket()
    try:
        taken.bind(("0.0.0.0", 8787))
        taken.listen(1)
    except OSError:
        pass  # something else holds it: taken all the same
    try:
        done = _cli(["delta-bias", "small.zarr", "--preset", "bf16", "--workers", "2", "--json", "local.json"], small)
    finally:
        taken.close()
    assert done.returncode == 0, done.stderr
    assert (small / "local.json").read_text() == (small / "inproc.json").read_text()  # no dashboard line in warnings
    assert "8787" not in done.stderr and "distributed" not in done.stderr
