"""Two hosts joined by a real, rate-limited TCP link, and the capstone across them.

Two network namespaces are two hosts: each gets one end of a veth pair, an address
of its own and a token-bucket filter (``tc qdisc ... tbf``) that holds what it sends
to RATE_MBIT. A torchrun per host, joined by torchrun's c10d rendezvous at host A's
address (no launcher of ours in between: what a reader runs on two nodes), trains
the capstone's DDP run with one rank per host; gloo talks over the veth only
(``GLOO_SOCKET_IFNAME``).

- The run equals the same run on one machine's two ranks, bit for bit (the same two
  gradients summed: a sum of two has one order).
- The link is real: no step can beat the bucket's rate, so every step after the
  first takes at least the bytes each rank sends in the gradient all-reduce over
  the rate (a lower bound, which a loaded machine cannot break; the burst the
  filter lets through is far below one step's bytes).

Needs root, ``ip`` and ``tc`` (CI runs as root); the namespaces, addresses and link
exist only while the test runs and are deleted afterwards, whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from typing import Iterator

import pytest

from dtlib.chapters.ch10_capstone.runs import run_script
from dtlib.runtime import launch
from dtlib.train.config import parse_args
from dtlib.train.model import count_params

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("ip")
    or not shutil.which("tc"), reason="needs root, ip and tc (network namespaces)")

RATE_MBIT = 20
BURST = "16kb"
FLAGS = ["--steps", "6", "--log-every", "1", "--dataset-size", "128",
         "--micro-batch", "2", "--save-every", "0"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, timeout=20, capture_output=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[str, str, str]]:
    """Namespaces A and B joined by a veth pair limited to RATE_MBIT each way;
    yields (A, B, A's address)."""
    tag = f"dt{os.getpid() % 10**6}"
    a, b = f"{tag}a", f"{tag}b"
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    try:
        try:
            _ip("netns", "add", a)
        except subprocess.CalledProcessError as exc:  # a container without the right
            pytest.skip(f"cannot create a network namespace here: "
                        f"{exc.stderr.decode(errors='replace').strip()}")
        _ip("netns", "add", b)
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for ns, dev, host in ((a, f"{tag}va", 1), (b, f"{tag}vb", 2)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{net}.{host}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                            "rate", f"{RATE_MBIT}mbit", "burst", BURST, "latency",
                            "400ms"], check=True, timeout=20, capture_output=True)
        yield a, b, f"{net}.1"
    finally:
        for ns in (a, b):  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], timeout=20, capture_output=True)


def _torchrun(ns: str, node_rank: int, endpoint: str, run_id: str, dev: str,
              argv: list[str]) -> subprocess.Popen:
    here = endpoint.rsplit(".", 1)[0] + f".{node_rank + 1}"
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
           "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={endpoint}:29511", f"--rdzv-id={run_id}",
           # the host names resolve to neither namespace's address: each agent is
           # told its own (the workers' master address is host A's), and host A
           # that it serves the rendezvous store
           f"--local-addr={here}",
           f"--rdzv-conf=is_host={int(node_rank == 0)},join_timeout=60",
           "-m", "dtlib.train", *argv]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_the_capstone_across_two_hosts_on_a_slow_link(tmp_path) -> None:
    two = [*FLAGS, "--summary-json", str(tmp_path / "two.json"), "--log-file",
           str(tmp_path / "two.jsonl")]
    with two_hosts() as (a, b, address):
        tag = a[:-1]
        procs = [_torchrun(ns, k, address, tag, f"{tag}v{ns[-1]}", two)
                 for k, ns in enumerate((a, b))]
        try:
            outs = [p.communicate(timeout=120)[0].decode(errors="replace")
                    for p in procs]
        finally:
            for p in procs:  # never leave a torchrun or its workers behind
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=20)
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)[-4000:]
    # the same run on one machine's two ranks
    launch.spawn(run_script, 2, [[*FLAGS, "--summary-json", str(tmp_path /
                                                                  "one.json")]],
                 stream=False, timeout=120)
    with open(tmp_path / "two.json") as f:
        across = json.load(f)
    with open(tmp_path / "one.json") as f:
        local = json.load(f)
    assert across["world_size"] == 2
    assert across["param_sha256"] == local["param_sha256"]
    assert across["losses"] == local["losses"]
    # every step after the first sends the gradients through the bucket: a ring
    # all-reduce of N bytes on 2 ranks sends N per rank
    grad_bytes = 4 * count_params(parse_args(FLAGS))
    with open(tmp_path / "two.jsonl") as f:
        steps = [r for r in map(json.loads, f) if "step_time_s" in r]
    floor = grad_bytes / (RATE_MBIT * 1e6 / 8)
    late = [r["step_time_s"] for r in steps if r["step"] > 1]
    assert late and min(late) >= 0.9 * floor, (late, floor)
