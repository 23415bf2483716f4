"""What a run shows: metrics, the metrics server and run page, logs, the loss curve."""
