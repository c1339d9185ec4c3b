"""Stop-time diagnostics: the per-machine checks (`checks`, run by `worker`) and the pure
verdicts over their results (`pairs`)."""
