"""One file per parallel axis; applied in the order pipeline → tensor → context → expert → data."""
