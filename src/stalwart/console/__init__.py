"""What a terminal shows: a job's live progress bar and `stalwart status --watch`."""
