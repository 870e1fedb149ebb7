"""Code the tests share: builds, load, NetworkPolicy evaluation, raw HTTP, polling."""
