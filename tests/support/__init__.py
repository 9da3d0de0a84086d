"""Test support: the tests' process launcher and helpers only tests use (product code never imports them)."""
