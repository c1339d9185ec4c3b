"""The controller's durable state: the database (SQLite or PostgreSQL) and the lease that says which
controller acts."""
