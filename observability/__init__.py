"""Dashboards and alerts for sonic-ray: built from one source each, proven against a real
Prometheus scraping the local stack (tests/stack/test_observability.py)."""
