"""What checks a build: the invariants, the facts they are stated over, the checker; see
schema/check.py."""
