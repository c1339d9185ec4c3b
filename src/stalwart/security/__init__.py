"""Who may talk to whom: API tokens and scopes, per-machine identities, and log text that cannot forge lines."""
