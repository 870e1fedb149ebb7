"""A ClusterIP Service as kube-proxy (iptables mode) writes it, with Debian's iptables.

Connections from this machine to the Service IP are DNATed to one ready endpoint, picked per
connection with the `statistic` match's random probabilities (1/n, 1/(n-1), ..., 1), as
kube-proxy's KUBE-SVC chains do; an established connection keeps its endpoint (conntrack), so
a terminating pod keeps the connections it has and gets no new one. With no endpoint the
Service rejects the connection at once (icmp port unreachable), as kube-proxy's
"has no endpoints" rule does, reached as kube-proxy reaches it: only for a connection's first
packet (`--ctstate NEW`), so that no rule of this Service ever touches an established one.
Each rewrite is one iptables-restore: atomic, never a moment without rules.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping

from local_stack.cluster.network import PREFIX, NetworkError

NAT_CHAIN = f"{PREFIX.upper()}-SERVICES"
FILTER_CHAIN = f"{PREFIX.upper()}-NO-ENDPOINTS"


def _iptables(*args: str, check: bool = True) -> None:
    done = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NetworkError(f"iptables {' '.join(args)}: {done.stderr.strip()}")


def _restore(rules: str) -> None:
    done = subprocess.run(["iptables-restore", "-w", "--noflush"], input=rules, text=True,
                          capture_output=True, check=False)
    if done.returncode != 0:
        raise NetworkError(f"iptables-restore: {done.stderr.strip()}\n{rules}")


# kube-proxy's jumps from OUTPUT: every new connection to the NAT chain, and, in the filter
# table, only a connection's first packet to the "has no endpoints" rules.
_JUMPS = (("nat", NAT_CHAIN, ()), ("filter", FILTER_CHAIN, ("-m", "conntrack", "--ctstate", "NEW")))


def remove_leftovers() -> None:
    """This simulation's chains and the jumps to them, whoever made them (a run before
    kube-proxy's `--ctstate NEW` jumped to the filter chain without it)."""
    for table, chain, match in _JUMPS:
        for spec in {match, ()}:
            while subprocess.run(["iptables", "-w", "-t", table, "-D", "OUTPUT", *spec, "-j",
                                  chain], capture_output=True, check=False).returncode == 0:
                pass
        _iptables("-t", table, "-F", chain, check=False)
        _iptables("-t", table, "-X", chain, check=False)


class ServiceIp:
    """One Service IP with its ports (port -> the endpoints' target port)."""

    def __init__(self, ip: str, ports: Mapping[int, int]) -> None:
        self.ip = ip
        self.ports = dict(ports)
        self.endpoints: list[str] = []
        self._written = False

    def start(self) -> None:
        remove_leftovers()
        for table, chain, match in _JUMPS:
            _iptables("-t", table, "-N", chain)
            _iptables("-t", table, "-A", "OUTPUT", *match, "-j", chain)
        self._written = False  # fresh chains: the "has no endpoints" rule is written here
        self.set_endpoints([])

    def set_endpoints(self, addresses: list[str]) -> bool:
        """Writes the rules for `addresses` unless they are already written (in any order, as
        the cluster's loop asks five times a second); says whether it wrote them."""
        addresses = sorted(addresses)
        if self._written and addresses == self.endpoints:
            return False
        nat = [f":{NAT_CHAIN} - [0:0]"]
        reject = [f":{FILTER_CHAIN} - [0:0]"]
        for port, target in sorted(self.ports.items()):
            match = f"-d {self.ip}/32 -p tcp -m tcp --dport {port}"
            if not addresses:
                reject.append(f"-A {FILTER_CHAIN} {match} -j REJECT "
                              "--reject-with icmp-port-unreachable")
            for index, address in enumerate(addresses):
                left = len(addresses) - index
                pick = (f"-m statistic --mode random --probability {1 / left:.10f} "
                        if left > 1 else "")
                nat.append(f"-A {NAT_CHAIN} {match} {pick}-j DNAT "
                           f"--to-destination {address}:{target}")
        _restore("*nat\n" + "\n".join(nat) + "\nCOMMIT\n*filter\n" + "\n".join(reject)
                 + "\nCOMMIT\n")
        self.endpoints = addresses
        self._written = True
        return True

    def stop(self) -> None:
        remove_leftovers()
