"""Settings, database engine, telemetry and the error hierarchy shared by every process."""
