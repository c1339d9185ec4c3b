"""The job's code: immutable content-hashed copies of its directory, and the versions hot update and
rollback move between."""
