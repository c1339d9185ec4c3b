"""Accounting and reports, rebuilt from the event log: the ETTR ledger, time series, start-up phases,
the JSON and HTML reports and their plots."""
