"""Tandem's own checkov policies (tests/deploy/test_policies.py loads them)."""
