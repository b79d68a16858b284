"""The HTTP shell: the app and its gate (keys, request ids, the access log, metrics), the error envelope,
JSON bodies, server-sent events, and the routes that read the app's state."""
