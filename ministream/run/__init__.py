"""Using an engine: settings for this machine, generate, serve, verify, doctor, bench."""
