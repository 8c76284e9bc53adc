"""The long-running service: the HTTP API (server), the `up` pipeline (plan), the process (main)."""
