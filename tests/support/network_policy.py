"""NetworkPolicy ingress semantics, as Kubernetes defines them, for reading built policies:
a pod selected by no Ingress policy takes everything; otherwise a connection passes if any rule
of any selecting policy allows it. A rule without `from` (or with an empty one) allows every
source, a rule without `ports` every port; `podSelector` alone means pods of the policy's
namespace, `namespaceSelector` alone every pod of the matching namespaces, both in one peer
means both; selectors count their matchLabels and matchExpressions. Tested against the examples
of the Kubernetes documentation in tests/unit/test_network_policy.py."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str]
    namespace_labels: dict[str, str] = field(default_factory=dict)
    ip: str = "10.0.0.1"


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector: every matchLabels pair and every matchExpressions term must hold; an
    empty selector selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for term in selector.get("matchExpressions") or []:
        key, operator, values = term["key"], term["operator"], term.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def _namespace_labels(pod: Pod) -> dict[str, str]:
    # Kubernetes labels every namespace with its name.
    return {"kubernetes.io/metadata.name": pod.namespace, **pod.namespace_labels}


def _peer_allows(peer: dict[str, Any], source: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        address = ipaddress.ip_address(source.ip)
        return (address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(cidr) for cidr in block.get("except") or []))
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], _namespace_labels(source)):
            return False
    elif source.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], source.labels)


def _port_allows(rule_port: dict[str, Any], port: int, protocol: str,
                 named: dict[str, int]) -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    if "port" not in rule_port:
        return True  # every port of that protocol
    start = rule_port["port"]
    start = named.get(start, -1) if isinstance(start, str) else int(start)
    return start <= port <= int(rule_port.get("endPort", start))


def allowed(policies: list[dict[str, Any]], destination: Pod, source: Pod, port: int,
            protocol: str = "TCP", named_ports: dict[str, int] | None = None) -> bool:
    """Whether `source` may open a connection to `destination` on `port`."""
    selecting = []
    for policy in policies:
        spec = policy["spec"]
        namespace = policy["metadata"].get("namespace", destination.namespace)
        types = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec
                                            else ["Ingress"])
        if (namespace == destination.namespace and "Ingress" in types
                and selects(spec.get("podSelector"), destination.labels)):
            selecting.append((namespace, spec))
    if not selecting:
        return True
    for namespace, spec in selecting:
        for rule in spec.get("ingress") or []:
            peers = rule.get("from") or []
            ports = rule.get("ports") or []
            if ((not peers or any(_peer_allows(p, source, namespace) for p in peers))
                    and (not ports or any(_port_allows(p, port, protocol, named_ports or {})
                                          for p in ports))):
                return True
    return False
