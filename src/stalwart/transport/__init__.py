"""Wires: the controller's JSON-over-HTTP client, the WebSocket framing of agents' channels, newline-JSON
between workers and their agent."""
