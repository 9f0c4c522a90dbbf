"""Generated protobuf / gRPC code (never hand-edited)."""
