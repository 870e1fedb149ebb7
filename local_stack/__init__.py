"""`make local`: the whole stack on this machine, for developers, the tests and `make bench`.

Not shipped: the pods run serve/triton_pod (the ConfigMap) and gateway/envoy.yaml; this
package starts the same parts here (a real Triton per simulated pod, Ray Serve, Envoy).
"""
