"""OpenAI-compatible HTTP gateway sidecar in front of the router's gRPC API."""
