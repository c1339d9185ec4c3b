"""The controller's edge: the HTTP API, the agents' channels, the commands waiting for them, enrollment,
the rendezvous store, Prometheus metrics and the dashboard's data."""
