"""Several "hosts" on one machine for the multi-host tests: Linux network namespaces, each
joined by a veth pair to a bridge in a "switch" namespace (made here as root, removed
afterwards), Open MPI between them over TCP only.

``mpirun`` runs inside the first namespace and starts its daemons in the others through
``plm_rsh_agent`` = a small script running ``ip netns exec HOST sh -c CMD`` (the launch agent
in place of ssh); ``btl tcp,self`` (no shared memory at all) on the namespaces' subnet only.
``tc`` on the veth ends adds delay and loss (``netem``, where the kernel has it) or a slow link
(``tbf``). :func:`why_not` says what is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.mpi_env import mpirun_env

SUBNET = "10.77.{}.0/24"

RTC = ("--mca", "rtc", "^hwloc")
"""Open MPI 4.1's daemons share the hardware topology through a memory map placed at a hole
of their address space, and on this VM that has crashed one daemon at start-up (a segfault in
hwloc_shmem_topology_write): the tests' daemons do without it (nothing here binds by it)."""


def why_not() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"dtmprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, text=True, check=True)


@dataclass
class Hosts:
    """Two namespaces ``names`` with addresses ``addrs`` on their links ``links`` (each a veth
    to the bridge of namespace ``switch``)."""

    names: tuple[str, str]
    addrs: tuple[str, str]
    links: tuple[str, str]
    subnet: str
    agent: Path
    switch: str = ""  # the namespace of the bridge joining the hosts

    def mpirun(
        self,
        slots: tuple[int, int],
        *prog: str,
        timeout: float = 300,
        env: dict[str, str] | None = None,
        mpirun_args: tuple[str, ...] = (),
    ) -> subprocess.CompletedProcess[str]:
        """``mpirun`` from the first host with ``slots[i]`` ranks on host ``i`` (ranks in host
        order), over TCP only."""
        hostfile = self.agent.parent / f"hosts-{slots[0]}-{slots[1]}"
        hostfile.write_text(
            "".join(f"{n} slots={s}\n" for n, s in zip(self.names, slots, strict=True) if s)
        )
        full = mpirun_env(**(env or {}))
        forwarded = [
            a for k in full if k.startswith(("DTM_", "OMPI_ALLOW", "PYTHON")) for a in ("-x", k)
        ]
        cmd = [
            "ip",
            "netns",
            "exec",
            self.names[0],
            "mpirun",
            "--hostfile",
            str(hostfile),
            "-n",
            str(sum(slots)),
            "--timeout",
            str(int(timeout) - 10),
            "--mca",
            "plm_rsh_agent",
            str(self.agent),
            "--mca",
            "btl",
            "tcp,self",
            "--mca",
            "btl_tcp_if_include",
            self.subnet,
            "--mca",
            "oob_tcp_if_include",
            self.subnet,
            "--mca",
            "rmaps_base_oversubscribe",
            "1",
            *RTC,
            *forwarded,
            *mpirun_args,
            *prog,
        ]
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=full, check=False
        )

    def shape(self, qdisc: str) -> str | None:
        """Put ``tc`` queueing discipline ``qdisc`` (``netem delay 20ms loss 2%``, ``tbf rate
        8mbit burst 32kbit latency 50ms``) on both ends of the link; the reason it cannot
        be (e.g. a kernel without ``sch_netem``), else None."""
        for ns, link in zip(self.names, self.links, strict=True):
            got = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    link,
                    "root",
                    *qdisc.split(),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if got.returncode != 0:
                return f"tc qdisc {qdisc.split(maxsplit=1)[0]}: {got.stderr.strip() or got.returncode} (this kernel lacks it)"
        return None

    def unshape(self) -> None:
        for ns, link in zip(self.names, self.links, strict=True):
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", link, "root"],
                capture_output=True,
                check=False,
            )

    def remove(self) -> None:
        for ns in (*self.names, self.switch):
            if ns:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        shutil.rmtree(self.agent.parent, ignore_errors=True)


def make_hosts() -> Hosts:
    """Two host namespaces, each with a veth pair to a bridge in a third "switch" namespace (so
    removing one host leaves the other's link up, as a lost node does)."""
    tag = uuid.uuid4().hex[:6]
    names = (f"dtm-{tag}-a", f"dtm-{tag}-b")
    switch = f"dtm-{tag}-sw"
    links = (f"dtm{tag}a", f"dtm{tag}b")
    octet = int(tag[:2], 16) % 200 + 20
    subnet = SUBNET.format(octet)
    addrs = (f"10.77.{octet}.1", f"10.77.{octet}.2")
    work = Path(tempfile.mkdtemp(prefix="dtm-hosts-"))
    agent = work / "netns-rsh"
    # Open MPI launch agent: the daemon command in the host's namespace, with a session
    # directory of the host's own (the hosts share one /tmp and one host name, and two daemons
    # of a job making the same session directory at once fail: "mkdir ... File exists")
    agent.write_text(
        f'#!/bin/sh\nhost=$1; shift\nmkdir -p "{work}/tmp-$host"\nexec ip netns exec "$host" env OMPI_MCA_orte_tmpdir_base="{work}/tmp-$host" /bin/sh -c "$*"\n'
    )
    agent.chmod(0o755)
    hosts = Hosts(names, addrs, links, subnet, agent, switch)
    try:
        for ns in (*names, switch):
            _ip("netns", "add", ns)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, (ns, link, addr) in enumerate(zip(names, links, addrs, strict=True)):
            port = f"p{tag}{i}"
            _ip("link", "add", link, "type", "veth", "peer", "name", port)
            _ip("link", "set", link, "netns", ns)
            _ip("link", "set", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        _wait_connected(hosts)
    except BaseException:
        hosts.remove()
        raise
    return hosts


def _wait_connected(hosts: Hosts, timeout: float = 20.0) -> None:
    """Until a TCP connection from the second host reaches the first (the bridge has learnt
    the addresses): a launch right after would otherwise fail to reach a daemon."""
    import sys
    import time

    port = 40000 + int(hosts.addrs[0].split(".")[2])
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            hosts.names[0],
            sys.executable,
            "-c",
            f"import socket; s = socket.create_server(('{hosts.addrs[0]}', {port})); s.settimeout({timeout}); s.accept()",
        ]
    )
    try:
        deadline = time.monotonic() + timeout
        probe = f"import socket; socket.create_connection(('{hosts.addrs[0]}', {port}), timeout=1).close()"
        while time.monotonic() < deadline:
            if (
                subprocess.run(
                    ["ip", "netns", "exec", hosts.names[1], sys.executable, "-c", probe],
                    capture_output=True,
                    check=False,
                ).returncode
                == 0
            ):
                return
            time.sleep(0.2)
        raise RuntimeError(f"hosts {hosts.names}: no TCP connection within {timeout:g} s")
    finally:
        server.kill()
        server.wait()
