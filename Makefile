# sonic-ray: every command the README, docs/ and CI use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
OVERLAYS := $(sort $(wildcard overlays/*))
MANIFEST ?=

KUBECTLS := $(VENV)/bin/kubectl $(wildcard /usr/bin/kubectl)
# The Kubernetes version whose schemas the built objects are checked against lives in
# schema/check.py (DEFAULT_KUBERNETES_VERSION).
CHECK := $(PY) -m schema.check

.PHONY: venv test unit gateway-tests lint local cluster cluster-tools observe bench bench-node bench-sequences bench-warmup validate check check-cluster-crd prewarm schemas gateway-config observability generate prometheus lock clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

# make unit first: its tier's rule (a test that starts a process is marked so) holds in CI too.
test: venv prometheus cluster-tools lint unit
	$(PY) -m pytest

# Every test that starts no process and needs no root: seconds, while editing (a test that
# starts one unmarked fails here: tests/conftest.py).
unit: venv
	SONIC_RAY_UNIT=1 $(PY) -m pytest -m "not stack and not processes" -q

# The gateway tier: one Envoy with the shipped config before a stand-in Triton (tests/gateway/).
gateway-tests: venv
	$(PY) -m pytest -q tests/gateway

lint: venv
	$(PY) -m ruff check serve tests schema gateway tools bench local_stack observability
	$(PY) -m mypy
	$(PY) -m yamllint -s .
	$(PY) -m pytest -q -p no:cacheprovider tests/unit/test_import_direction.py

# Builds every overlay with the pinned kubectl and the machine's (when there is one) and
# checks each build: invariants, KubeRay's schema, Kubernetes' schemas, the Serve config.
validate: venv prometheus
	$(PY) -m yamllint -s .
	$(PY) -m gateway.routes --check
	$(PY) -m gateway.tls --check
	$(PY) -m gateway.jwt --check
	$(PY) -m gateway.tenant_shares --check
	$(PY) -m observability.dashboard --check
	$(PY) -m schema.invariants_doc --check
	promtool check rules observability/alerts.yaml
	promtool test rules observability/alerts_test.yaml
	$(PY) -m gateway.local
	@mkdir -p build
	@set -e; for overlay in $(OVERLAYS); do for kubectl in $(KUBECTLS); do \
	  case $$kubectl in /usr/*) which=system;; *) which=pinned;; esac; \
	  out=build/$$(basename $$overlay).$$which.yaml; \
	  echo "$$kubectl kustomize $$overlay"; \
	  $$kubectl kustomize $$overlay > $$out; \
	  $(CHECK) $$out; \
	done; done

# Checks any built manifest stream: make check MANIFEST=built.yaml (or MANIFEST=- for stdin).
check: venv
	@test -n "$(MANIFEST)" || { echo "usage: make check MANIFEST=<built manifest file>"; exit 2; }
	@$(CHECK) $(MANIFEST)

# Checks every overlay against the RayService CRD a cluster has installed:
#   kubectl get crd rayservices.ray.io -o yaml > crd.yaml && make check-cluster-crd CRD=crd.yaml
# An older KubeRay drops fields it does not know (worker-group resources before 1.5) silently.
check-cluster-crd: venv
	@test "$(origin CRD)" = "command line" || { echo "usage: make check-cluster-crd CRD=<the cluster's RayService CRD>"; exit 2; }
	@set -e; for overlay in $(OVERLAYS); do \
	  echo "$$overlay against $(CRD)"; \
	  $(VENV)/bin/kubectl kustomize $$overlay | $(CHECK) --crd $(CRD) -; \
	done

# At least PODS GPU pods until UNTIL (ISO 8601 with its zone), ahead of a campaign, undone when
# UNTIL passes (docs/operations.md, "Pre-warming"): OVERLAY=overlays/<site> applies the
# ConfigMap `prewarm` with kubectl (DRY_RUN=1 prints it), DIR=<a local stack's pre-warm
# directory> writes its files (SERVE_CONFIG for the bounds when the stack runs another).
prewarm: venv
	@test -n "$(PODS)" -a -n "$(UNTIL)" -a -n "$(OVERLAY)$(DIR)" || { echo "usage: make prewarm PODS=<n> UNTIL=<ISO 8601 time> (OVERLAY=overlays/<site> [DRY_RUN=1] | DIR=<pre-warm directory> [SERVE_CONFIG=<file>])"; exit 2; }
	@$(PY) -m tools.prewarm --pods "$(PODS)" --until "$(UNTIL)" \
	  $(if $(OVERLAY),--overlay "$(OVERLAY)",--dir "$(DIR)") \
	  $(if $(SERVE_CONFIG),--serve-config "$(SERVE_CONFIG)") $(if $(filter-out 0,$(DRY_RUN)),--dry-run)

# Regenerates the strict RayService schema from KubeRay's CRD (kept in schema/crd; CRD=<file or
# URL> for another) and base/openapi.json, the merge keys the kustomizations' patches use.
CRD ?= schema/crd/ray.io_rayservices.yaml
schemas: venv
	$(PY) -m schema.crd_to_jsonschema $(CRD) --out schema/generated/kuberay-v1.7.0-rayservice.json
	$(PY) -m tools.kustomize_openapi

# Writes the gateway's refused-RPC routes from the RPC table and the Serve config's
# allowed_admin_rpcs (gateway/envoy.yaml, between its markers) and its retries from the Serve
# config's max_replicas (its line `num_retries: &retries`), the TLS secrets' discovery
# documents (gateway/tls.py: gateway/sds-server-certificate.yaml, gateway/sds-client-ca.yaml),
# the token checks' configs (gateway/jwt.py: off, and
# each site's from its jwt.env and jwks.json) and the tenant shares' (gateway/tenant_shares.py:
# none, and each site's from its tenant-shares.env).
gateway-config: venv
	$(PY) -m gateway.routes
	$(PY) -m gateway.tls
	$(PY) -m gateway.jwt
	$(PY) -m gateway.tenant_shares

# Writes the Grafana dashboard (observability/dashboard.json) and the PrometheusRule of
# components/prometheus-monitors from their sources in observability/.
observability: venv
	$(PY) -m observability.dashboard

# Every generated, committed file at once: the strict CRD schema and base/openapi.json, the
# gateway's refused-RPC routes, the dashboard and the PrometheusRule, docs/invariants.md.
generate: schemas gateway-config observability
	$(PY) -m schema.invariants_doc

# Prometheus and promtool, Debian's package (the tests scrape the local stack with it).
PROMETHEUS_DEB := prometheus=2.42.0+ds-5+deb12u1
prometheus:
	@command -v promtool >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(PROMETHEUS_DEB); }

# The whole stack on this machine: Tritons, Ray Serve and (DATA_PATH=gateway, the default)
# Envoy, until Ctrl-C. TRITONS=N simulated pods.
local: venv
	$(PY) -m local_stack

# The gateway path on the cluster's mechanics (needs root): every pod a network namespace with
# the pod's own ports, a real DNS with the stock Corefile's TTL and cache, a Service IP balanced
# as kube-proxy does it, pods run and stopped as the kubelet does, from overlays/local as built.
# GATEWAYS=N gateway pods, DNS_TTL=s, and make local's TRITONS, MODEL_REPOSITORY, SERVE_CONFIG...
cluster: venv cluster-tools
	$(PY) -m local_stack.cluster

# Debian's dnsmasq (the cluster DNS) and iptables (the Service IP) for make cluster.
CLUSTER_DEBS := dnsmasq-base=2.90-4~deb12u2 iptables=1.8.9-2
cluster-tools:
	@command -v dnsmasq >/dev/null && command -v iptables-restore >/dev/null || { \
	  test "$$(id -u)" = 0 || { echo "make cluster needs root (and installs $(CLUSTER_DEBS))"; exit 2; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends $(CLUSTER_DEBS); }

# make local with a real Prometheus scraping it (PROMETHEUS_PORT, 9090) and loading the alerts:
# the dashboard's queries at http://localhost:9090/graph.
observe: venv prometheus
	OBSERVE=1 $(PY) -m local_stack

lock:
	rm -rf $(VENV).lock && $(PYTHON) -m venv $(VENV).lock
	$(VENV).lock/bin/pip install --quiet -r requirements.in
	{ echo '# Generated by `make lock` from requirements.in: every package pinned.'; \
	  $(VENV).lock/bin/pip freeze; } > requirements.txt
	rm -rf $(VENV).lock

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Each data path against Triton directly, same run, same client: a table, JSON and a PNG plot
# in bench-results/. MODES="gateway serve classic ..." (bench/data_paths.py lists them). Then
# the overload cell: the gateway at twice its Tritons' capacity (bench/overload.py).
MODES ?= gateway gateway-tls serve
OVERLOAD_SECONDS ?= 60
bench: venv
	$(PY) -m bench.data_paths --modes $(MODES)
	$(PY) -m bench.overload --seconds $(OVERLOAD_SECONDS)

# The gateway's hot path against its proxy's floor, Ray not needed (bench/node.py): one
# Triton; the shipped gateway, a bare Envoy, HAProxy L7 and L4 in front of it on the same
# cores (apart from Triton's and the clients' with 8 cores or more); ratios, CPU per call.
bench-node: venv
	$(PY) -m bench.node

# What a sequence's call costs through the gateway with two Tritons, beside a plain call, and
# against direct Triton (bench/sequences.py): calls/s, Envoy CPU and tries per call.
bench-sequences: venv
	$(PY) -m bench.sequences

# What the warm-up costs at start and saves the first calls (bench/warmup.py): make local with
# two pods, warm-up on and off; the ready line's time and the first calls' latencies.
bench-warmup: venv
	$(PY) -m bench.warmup
