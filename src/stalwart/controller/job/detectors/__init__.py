"""The job core's implicit detectors: each watches the run's signals for one kind of partial or
silent fault and says what it found, behind one interface (`base.Detector`).

| module | detector | watches |
| --- | --- | --- |
| `hang.py` | `HangDetector` | no progress past the calibrated timeout; then every machine's stacks |
| `training.py` | `TrainingAnomalyDetector` | NaN/inf and jumps in loss or gradient norm |
| `failslow.py` | `FailSlowDetector` | throughput drops; rounds of stacks and per-rank compute times |
| `peers.py` | `PeerDetector` | machines whose metrics stay unlike their peers' (similarity) |
| `trace.py` | `TraceDetector` | ranks whose collective traces leave the distribution learned while healthy |
| `links.py` | `LinkDetector` | machine pairs whose TCP connections leave the RTT and loss learned while healthy |

`flows/implicit.py` holds one of each and hands every event, committed step and tick to them; a new
detector is one more module here and one more entry in its list. This package's `__init__` imports
nothing, so the job's state can hold a detector's own state types without an import circle.
"""
