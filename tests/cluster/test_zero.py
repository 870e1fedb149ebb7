"""Scale to zero and back on the cluster's mechanics (docs/data-paths.md, "From and to zero"):
the running cluster's Serve config changed in place to `min_replicas: 0`, as KubeRay applies a
changed serveConfigV2; idle, every GPU pod goes and Ray has no `triton` resource left; a
client's first calls then get the gateway's answers at once (a job start the start-of-job
gate's CANCELLED, inference UNAVAILABLE / 503 saying a GPU pod is starting and when to retry),
a GPU pod starts, and calls succeed once its Triton is ready: none hangs, none reaches a
Triton that is not ready. Then an operator's pre-warm request (make prewarm) brings a second
GPU pod with no call made, and Serve lets go of it once the time of a request replacing it
has passed. Last of this folder (file order): it leaves the cluster as it is."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from local_stack.harness import serve_config_with
from local_stack.polling import until
from local_stack.ray_cluster import application, deployment_of, triton_resources
from local_stack.triton_inputs import simple_inputs
from tests.support.cluster import Cluster
from tests.support.prewarm import request_prewarm

# The gateway's answers while no Triton is ready (gateway/client-checks.lua).
NO_TRITON = "no Triton is ready behind this endpoint"
STARTING = re.compile(r"a GPU pod is starting \(asked for \d+ s ago; one takes about \d+ s "
                      r"here\); retry in about \d+ s")
# An answer that takes longer than this would be a call held, not answered at once.
AT_ONCE_S = 1.0
# How long the pre-warm request holds: Serve's upscale_delay_s (10 s) and a GPU pod's start
# here with room to spare; an operator asks for hours.
PREWARM_S = 60
# The request that replaces it once both pods are up, ending the campaign sooner.
SOONER_S = 8
HEAD = re.compile(r"(ray-head(?:-\d+)?): Ray head of cluster (\S+) at \S+ \(dashboard (\S+)\)")
SELECTED = re.compile(r"\[cluster\] upgrade: KubeRay's Services select (\S+);")


def _active_head(cluster: Cluster) -> tuple[str, str]:
    """The dashboard and token of the Ray cluster KubeRay's Services select: the one the
    last upgrade switched to (test_upgrade.py), else the first; a pending cluster never."""
    heads = {m.group(2): m for line in cluster.process.lines if (m := HEAD.search(line))}
    switches = [m.group(1) for line in cluster.process.lines if (m := SELECTED.search(line))]
    name, _, dashboard = heads[switches[-1]].groups() if switches else next(
        iter(heads.values())).groups()
    return dashboard, (cluster.pods_dir / name / "ray-token").read_text()


def _pod_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=True).stdout.split()
    return [name for name in listed if name.startswith("srk-triton-")]


def _call(what: str, call: object) -> tuple[float, str]:
    started = time.monotonic()
    try:
        call()  # type: ignore[operator]
        outcome = "OK"
    except InferenceServerException as error:
        outcome = f"{error.status()}: {error.message()}"
    except urllib.error.HTTPError as error:
        outcome = (f"HTTP {error.code} Retry-After {error.headers.get('Retry-After')}: "
                   f"{error.read().decode(errors='replace')}")
    return time.monotonic() - started, f"{what} {outcome}"


def test_idle_to_zero_gpu_pods_then_the_first_calls_start_one(cluster: Cluster,
                                                               tmp_path: Path) -> None:
    dashboard, token = _active_head(cluster)
    config = serve_config_with(tmp_path, autoscaling={
        "min_replicas": 0, "max_replicas": 3, "downscale_delay_s": 5,
        "downscale_to_zero_delay_s": 5})
    mark = cluster.line_index()
    (cluster.pods_dir / "serve-config").write_text(config.read_text())
    cluster.wait_for(r"\[cluster\] serve config: updated in place", 200, after=mark)
    started = time.monotonic()
    timeline: list[tuple[float, int, int, int]] = []

    def sample() -> tuple[int, int, int]:
        found = (len(cluster.pods("triton")), len(cluster.ready_pods("triton")),
                 triton_resources(dashboard, token))
        timeline.append((round(time.monotonic() - started), *found))
        return found

    leaving = cluster.pods("triton")
    # Zero in Ray and in the gateways' rotation; a deleted pod's Triton still waits out its
    # preStop (base/rayservice.yaml), which the first calls below overlap. Its end is asserted
    # after them.
    until("no ready GPU pod and no triton resource in Ray",
          lambda: sample()[1:] == (0, 0) or timeline[-1], 400, every_s=2)
    at_zero = time.monotonic() - started

    # The first calls: each answered at once by the gateway, none reaching a Triton.
    ones = np.ones((1, 16), dtype=np.int32)
    client = tc.InferenceServerClient(cluster.grpc_url)
    infer = ("ModelInfer", lambda: client.infer("simple", simple_inputs(ones, ones),
                                                client_timeout=20))
    first = time.monotonic()
    outcomes = [_call(*infer),
                _call("RepositoryIndex", lambda: client.get_model_repository_index(
                    client_timeout=20)),
                _call("HTTP ready", lambda: urllib.request.urlopen(
                    f"http://{cluster.http_url}/v2/health/ready", timeout=20))]
    while not outcomes[-1][1].endswith(" OK") and time.monotonic() - first < 400:
        outcomes.append(_call(*infer))
        sample()
        time.sleep(0.5)
    first_ok_s = time.monotonic() - first
    refused = outcomes[:-1]
    print(f"to zero GPU pods {at_zero:.0f}s after the config; the first success "
          f"{first_ok_s:.0f}s after the first call, {len(refused)} calls before it, the "
          f"slowest answered in {max(s for s, _ in refused):.3f}s; first answers "
          f"{[o for _, o in outcomes[:4]]}; (s, GPU pods, ready, triton resources): "
          f"{timeline}")
    assert outcomes[-1][1] == "ModelInfer OK", outcomes[-5:]
    slow = [(s, o) for s, o in refused if s >= AT_ONCE_S]
    assert slow == [], f"calls held instead of answered at once: {slow[:5]}"
    job = outcomes[1][1]
    assert job.startswith("RepositoryIndex StatusCode.CANCELLED") and "no new jobs" in job, job
    assert outcomes[2][1].startswith("HTTP ready HTTP 503 Retry-After ") and NO_TRITON in \
        outcomes[2][1], outcomes[2]
    others = [o for _, o in refused[3:]] + [outcomes[0][1]]
    assert all(o.startswith("ModelInfer StatusCode.UNAVAILABLE") and NO_TRITON in o
               for o in others), [o for o in others if NO_TRITON not in o][:5]
    assert any(STARTING.search(o) for o in others), others[-3:]
    # Every GPU pod of before went, its network namespace with it.
    until("the idle GPU pods to be gone", lambda: not set(leaving) & set(
        cluster.pods("triton")) or cluster.pods("triton"), 120, every_s=1)
    left = [f"srk-{pod}" for pod in leaving if f"srk-{pod}" in _pod_namespaces()]
    assert left == [], f"a GPU pod's namespace outlived it: {left}"

    # Pre-warming: a second GPU pod ready with no call made, and let go after the time.
    prewarm_dir = cluster.wait_for(r"pre-warm: make prewarm .* DIR=(\S+)$", 1).group(1)
    ends = datetime.now(UTC) + timedelta(seconds=PREWARM_S)
    request_prewarm(2, ends, prewarm_dir, config)
    until("two GPU pods ready before the request's time passes",
          lambda: datetime.now(UTC) >= ends or len(cluster.ready_pods("triton")) == 2 or
          cluster.ready_pods("triton"), PREWARM_S, every_s=1)
    assert len(cluster.ready_pods("triton")) == 2 and datetime.now(UTC) < ends

    def target() -> int:
        return int(deployment_of(application(dashboard, token)).get("target_num_replicas", -1))

    # The operator ends the campaign sooner: a new request replaces the first whole, and Serve
    # lets go once its time has passed, not before.
    assert target() == 2
    ends = datetime.now(UTC) + timedelta(seconds=SOONER_S)
    request_prewarm(2, ends, prewarm_dir, config)
    early: list[int] = []

    def let_go() -> object:
        wanted, now = target(), datetime.now(UTC)
        if now < ends - timedelta(seconds=1) and wanted < 2:
            early.append(wanted)
        return (now > ends and wanted < 2) or f"target {wanted}"

    until("Serve to want fewer than two once the request's time passed", let_go,
          SOONER_S + 60, every_s=1)
    assert early == [], f"Serve wanted {early} before the request's time passed"
