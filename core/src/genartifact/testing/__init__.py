"""Test kit for genartifact and third-party plugins: services and helpers that tests start on loopback."""
