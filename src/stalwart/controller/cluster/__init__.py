"""The machines: the registry and its roles, heartbeat jitter, what the jobs ask of the backend, where a
standby goes and how many standbys a job keeps."""
