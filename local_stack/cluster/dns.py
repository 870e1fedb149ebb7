"""The cluster DNS on this machine, answering as the stock CoreDNS does.

Two real dnsmasq processes (Debian's dnsmasq-base) stand for CoreDNS's two plugins that
matter to the gateway: a back one answers the Services' records from a hosts file, as the
`kubernetes` plugin answers from the API (records with TTL `ttl`, NXDOMAIN for a name with
no ready endpoint); a front one, on port 53 of the bridge where every pod's resolv.conf
points, caches answers, positive and negative, up to the TTL as the `cache` plugin does
(`cache 30` in the stock Corefile of kubeadm, the CoreDNS addon and its Helm chart). So a
deleted pod stays in the gateway's answers up to the TTL after it left the endpoints, and a
new ready pod joins up to the TTL late, as in a cluster.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
from pathlib import Path

from local_stack.processes import spawn, terminate

# The cluster's domain and the namespace of overlays/local, as a pod's resolv.conf searches.
CLUSTER_DOMAIN = "cluster.local"
BACKEND_PORT = 5353


def resolv_conf(nameserver: str, namespace: str) -> str:
    """A pod's /etc/resolv.conf as the kubelet writes it (dnsPolicy ClusterFirst)."""
    return (f"nameserver {nameserver}\n"
            f"search {namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\n"
            "options ndots:5\n")


class ClusterDns:
    def __init__(self, workdir: Path, listen: str, namespace: str, ttl_s: int) -> None:
        self.listen = listen
        self.namespace = namespace
        self.ttl_s = ttl_s
        self._hosts = workdir / "dns-hosts"
        self._hosts.write_text("")
        self._workdir = workdir
        self._records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._back: subprocess.Popen[bytes] | None = None
        self._front: subprocess.Popen[bytes] | None = None

    def fqdn(self, service: str) -> str:
        return f"{service}.{self.namespace}.svc.{CLUSTER_DOMAIN}"

    def start(self) -> None:
        binary = shutil.which("dnsmasq")
        if binary is None:
            raise SystemExit("dnsmasq is missing: `make cluster` installs Debian's dnsmasq-base")
        common = [binary, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
                  "--no-hosts", f"--listen-address={self.listen}", "--bind-interfaces",
                  "--user=root", "--group=root", "--log-facility=-"]
        self._back = spawn([
            *common, f"--port={BACKEND_PORT}", f"--addn-hosts={self._hosts}",
            # Names of the cluster's domain are answered here or not at all (NXDOMAIN).
            f"--local=/{CLUSTER_DOMAIN}/", "--domain-needed", f"--local-ttl={self.ttl_s}",
        ], self._workdir / "dns-records.log", {})
        self._front = spawn([
            *common, "--port=53", f"--server={self.listen}#{BACKEND_PORT}",
            f"--max-cache-ttl={self.ttl_s}", f"--neg-ttl={self.ttl_s}", "--cache-size=1000",
        ], self._workdir / "dns-cache.log", {})

    def alive(self) -> str | None:
        for name, process in (("records", self._back), ("cache", self._front)):
            if process is not None and process.poll() is not None:
                return f"the cluster DNS ({name}) exited with {process.returncode}"
        return None

    def publish(self, service: str, addresses: list[str]) -> None:
        """The A records of a headless Service: its ready, non-terminating endpoints."""
        with self._lock:
            if self._records.get(service) == sorted(addresses):
                return
            self._records[service] = sorted(addresses)
            lines = [f"{ip} {self.fqdn(name)}" for name, ips in sorted(self._records.items())
                     for ip in ips]
            staged = self._hosts.with_suffix(".new")
            staged.write_text("".join(f"{line}\n" for line in lines))
            staged.replace(self._hosts)
            if self._back is not None and self._back.poll() is None:
                self._back.send_signal(signal.SIGHUP)  # re-reads the hosts file

    def stop(self) -> None:
        for process in (self._front, self._back):
            if process is not None and process.poll() is None:
                terminate(process, grace_s=5)
