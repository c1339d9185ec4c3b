"""Network namespaces, for the modules that still name them here; they live in `stalwart.devices.netns`."""

from stalwart.devices.netns import Machine, Network, available, cleanup_stale

__all__ = ["Machine", "Network", "available", "cleanup_stale"]
