"""Pure decision rules the job core applies: incident policy, the stop-time ladder, restore planning, hang
and anomaly detection, stack grouping, peer similarity, a plain script's step numbers."""
