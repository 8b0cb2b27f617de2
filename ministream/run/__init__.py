"""Using an engine: settings for this machine, generate, serve and its server, verify, doctor, nodes."""
