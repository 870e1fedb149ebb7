"""Pods as network namespaces on one bridge, the cluster's addressing on this machine.

Every simulated pod is a network namespace of its own (its own `localhost`, the pod's real
ports) joined to one bridge by a veth pair, with an address from the pod subnet and no default
route: from a pod only the simulation's subnets are reachable. The Service subnet is routed to
the bridge too, so a packet for a Service IP whose rule is gone stays on this machine.

Every name the simulation makes starts with PREFIX: a run removes what a dead run left (its
namespaces, links, iptables chains) before it makes its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

PREFIX = "srk"
BRIDGE = f"{PREFIX}-br0"
# Private ranges no real interface of a machine like this one uses (checked at start).
POD_SUBNET = ipaddress.ip_network("10.213.0.0/24")
SERVICE_SUBNET = ipaddress.ip_network("10.213.1.0/24")
BRIDGE_IP = POD_SUBNET[1]
NETNS_DIR = Path("/etc/netns")


class NetworkError(RuntimeError):
    """A step of the simulated network failed; the message says which and why."""


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def require_root() -> None:
    if os.geteuid() != 0:
        raise SystemExit("make cluster needs root (network namespaces, veth pairs, iptables): "
                         "run it as root, as CI does; `make local` needs no root")


def _subnets_in_use() -> list[str]:
    routes = json.loads(run("ip", "-j", "route", "show", "table", "all").stdout or "[]")
    addresses = json.loads(run("ip", "-j", "addr").stdout or "[]")
    found = []
    for subnet in (POD_SUBNET, SERVICE_SUBNET):
        for route in routes:
            dst = route.get("dst", "")
            if route.get("dev") == BRIDGE or dst in ("default", "") or ("/" not in dst and not (
                    dst[:1].isdigit())):
                continue
            with contextlib.suppress(ValueError):
                if ipaddress.ip_network(dst, strict=False).overlaps(subnet):
                    found.append(f"route {dst} dev {route.get('dev')}")
        for link in addresses:
            if link.get("ifname") == BRIDGE:
                continue
            for info in link.get("addr_info", []):
                if info.get("family") != "inet":
                    continue
                net = ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", strict=False)
                if net.overlaps(subnet):
                    found.append(f"address {info['local']} on {link.get('ifname')}")
    return found


@dataclass(frozen=True)
class PodNetwork:
    """One pod's namespace: its name, its address, the host side of its veth pair."""

    namespace: str
    ip: str
    host_link: str

    def exec_prefix(self) -> list[str]:
        """Runs a command inside the pod: its network, /etc/netns/<ns> over /etc."""
        return ["ip", "netns", "exec", self.namespace]


LOCK = Path("/run/sonic-ray-cluster.lock")


class Network:
    """The bridge, the routes and the pods' namespaces of one run."""

    def __init__(self) -> None:
        self._lock_file: IO[str] | None = None
        self._next_host = 2  # .1 is the bridge: the cluster DNS and the node's own address
        self._next_link = 0
        self.pods: dict[str, PodNetwork] = {}

    def start(self) -> None:
        # One simulated cluster per machine: a second would remove the first's namespaces.
        self._lock_file = LOCK.open("a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip()
            self._lock_file.close()
            self._lock_file = None
            raise SystemExit(f"another make cluster runs on this machine (pid {holder}); "
                             "stop it first") from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()
        remove_leftovers()
        clash = _subnets_in_use()
        if clash:
            raise SystemExit(f"the simulation's subnets {POD_SUBNET} and {SERVICE_SUBNET} are "
                             f"in use on this machine ({'; '.join(clash)}): nothing was changed")
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{BRIDGE_IP}/{POD_SUBNET.prefixlen}", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")
        # A Service IP is answered on the bridge or not at all, never routed off the machine.
        run("ip", "route", "add", str(SERVICE_SUBNET), "dev", BRIDGE, "src", str(BRIDGE_IP))

    def add_pod(self, name: str, resolv_conf: str, etc_files: dict[str, Path] | None = None
                ) -> PodNetwork:
        """A namespace `<PREFIX>-<name>` with its own address and lo, and its /etc/resolv.conf
        (and any other /etc entries, bind-mounted by `ip netns exec`)."""
        if self._next_host >= POD_SUBNET.num_addresses - 1:
            raise NetworkError(f"the pod subnet {POD_SUBNET} has no address left")
        namespace = f"{PREFIX}-{name}"
        ip = str(POD_SUBNET[self._next_host])
        self._next_host += 1  # a new pod gets a new address, as in a cluster
        host_link = f"{PREFIX}v{self._next_link}"
        self._next_link += 1
        etc = NETNS_DIR / namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(resolv_conf)
        for entry, source in (etc_files or {}).items():
            # A copy, as the kubelet projects a ConfigMap: the pod sees the files as built.
            if source.is_dir():
                shutil.copytree(source, etc / entry, dirs_exist_ok=True)
            else:
                shutil.copy2(source, etc / entry)
        run("ip", "netns", "add", namespace)
        run("ip", "link", "add", host_link, "type", "veth", "peer", "name", "eth0",
            "netns", namespace)
        run("ip", "link", "set", host_link, "master", BRIDGE, "up")
        inside = ["ip", "netns", "exec", namespace]
        run(*inside, "ip", "link", "set", "lo", "up")
        run(*inside, "ip", "addr", "add", f"{ip}/{POD_SUBNET.prefixlen}", "dev", "eth0")
        run(*inside, "ip", "link", "set", "eth0", "up")
        # No default route: the pod reaches the pod subnet on its link, Services via the node.
        run(*inside, "ip", "route", "add", str(SERVICE_SUBNET), "via", str(BRIDGE_IP))
        pod = PodNetwork(namespace, ip, host_link)
        self.pods[name] = pod
        return pod

    def cut(self, name: str) -> None:
        """The pod's node vanishes: its link goes down, nothing answers, nothing resets."""
        run("ip", "link", "set", self.pods[name].host_link, "down")

    def remove_pod(self, name: str) -> None:
        pod = self.pods.pop(name, None)
        if pod is not None:
            _remove_namespace(pod.namespace)

    @property
    def owned(self) -> bool:
        """Whether this run holds the machine's simulation (and so may remove it)."""
        return self._lock_file is not None

    def stop(self) -> None:
        if self._lock_file is None:
            return  # never started: what runs is another's
        for name in list(self.pods):
            self.remove_pod(name)
        remove_leftovers()
        self._lock_file.close()
        self._lock_file = None


def _kill_namespace_processes(namespace: str) -> None:
    pids = run("ip", "netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = run("ip", "netns", "pids", namespace, check=False).stdout.split()
        time.sleep(0.1)


def _remove_namespace(namespace: str) -> None:
    _kill_namespace_processes(namespace)
    run("ip", "netns", "delete", namespace, check=False)
    shutil.rmtree(NETNS_DIR / namespace, ignore_errors=True)


def remove_leftovers() -> None:
    """Everything of PREFIX's that exists now: a dead run's, or this run's at its end."""
    listed = run("ip", "-j", "netns", "list", check=False).stdout.strip()
    for entry in json.loads(listed) if listed else []:
        if str(entry.get("name", "")).startswith(f"{PREFIX}-"):
            _remove_namespace(entry["name"])
    links = json.loads(run("ip", "-j", "link", "show").stdout or "[]")
    for link in links:
        name = str(link.get("ifname", ""))
        if name.startswith(PREFIX):
            run("ip", "link", "delete", name, check=False)
    if NETNS_DIR.is_dir():
        for etc in NETNS_DIR.glob(f"{PREFIX}-*"):
            shutil.rmtree(etc, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_DIR.rmdir()  # only when empty: nothing else uses it
